"""What a machine cannot hold or build is refused before anything starts: a comparison this host's memory cannot hold
(orchestrator/preflight.check_memory: one line naming the run, the figure and what to change, exit 2, nothing
launched; ``launch.check_memory = false`` for a user who knows better; the figure the memory model's own, checked
against its parts here), and a config deeper than the model check builds in its time budget (core/model_check)."""

from __future__ import annotations

import subprocess
import sys

from shardscope import config
from shardscope.orchestrator.preflight import RANK_RUNTIME_BYTES, check_memory
from shardscope.profiling import memory_model


def test_the_figure_is_the_memory_models_per_rank_total_times_the_ranks_here():
    c = config.load_preset("smoke", ["global_batch=65536"])
    worst = max(memory_model.predict_comparison(c), key=lambda p: p["total_bytes"])
    per_rank = max(worst["total_bytes"], 4 * memory_model.param_count(c.model)) + RANK_RUNTIME_BYTES
    need = 2 * per_rank
    assert check_memory(c, "cpu", available=need) is None  # exactly enough
    said = check_memory(c, "cpu", available=need - 1)
    assert said is not None and said.startswith(f"run {worst['run']}: 2 ranks x "), said
    assert "--set launch.check_memory=false" in said
    assert check_memory(c, "cuda", available=0) is None  # on a GPU the ranks hold their states on the device
    off = config.load_preset("smoke", ["global_batch=65536", "launch.check_memory=false"])
    assert check_memory(off, "cpu", available=0) is None


def test_a_batch_no_host_holds_is_refused_before_anything_starts(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "run", "--preset", "smoke", "--headless",
                           "--set", "global_batch=1048576", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("shardscope: error:")]
    assert len(lines) == 1 and "of this host's memory" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()  # nothing written, nothing launched


def test_a_config_too_deep_to_check_is_refused_from_its_numbers(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                      "num_hidden_layers": 10**6}), encoding="utf-8")
    (tmp_path / "p.toml").write_text("\n".join(["global_batch = 4", "world_size = 2", "[model]", 'kind = "hf"',
                                                f'path = "{tmp_path}"', "seq_len = 8", "[[runs]]", 'name = "ddp"',
                                                'strategy = "ddp"']) + "\n", encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "run", "--preset", str(tmp_path / "p.toml"),
                           "--dry-run"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "1,000,000 decoder layers: more than the model check builds in its time budget (at most 512)" in proc.stderr


def test_the_model_check_ends_with_the_command_that_started_it(tmp_path):
    """SIGTERM to ``shardscope run --dry-run`` while its model check builds a deep config: the check ends too."""
    import json
    import os
    import signal

    import psutil

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 500, "num_attention_heads": 4, "num_key_value_heads": 2}),
        encoding="utf-8")
    (tmp_path / "p.toml").write_text("\n".join(["global_batch = 4", "world_size = 2", "[model]", 'kind = "hf"',
                                               f'path = "{tmp_path}"', "seq_len = 8", "[[runs]]", 'name = "ddp"',
                                               'strategy = "ddp"']) + "\n", encoding="utf-8")
    cli = subprocess.Popen([sys.executable, "-m", "shardscope.cli", "run", "--preset", str(tmp_path / "p.toml"),
                            "--dry-run"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        check = None
        for _ in range(1200):  # until the model check has started (bounded: 120 s)
            found = [p for p in psutil.Process(cli.pid).children() if "describe" in " ".join(p.cmdline())]
            if found:
                check = found[0]
                break
            if cli.poll() is not None:
                break
            psutil.wait_procs([], timeout=0.1)
        assert check is not None, "the model check never started"
        os.kill(cli.pid, signal.SIGTERM)
        cli.wait(timeout=60)
        gone, alive = psutil.wait_procs([check], timeout=60)
        assert not alive, "the model check outlived the command"
    finally:
        if cli.poll() is None:
            cli.kill()


def test_a_tokenizer_that_cannot_encode_the_text_is_one_line(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1}))  # no [UNK]: any other word cannot be encoded
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "corpus.txt").write_text("a b c " * 200, encoding="utf-8")
    env = {**__import__("os").environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "run", "--preset", "smoke", "--dry-run",
                           "--set", "data.kind=text", "--set", f"data.path={tmp_path / 'corpus.txt'}",
                           "--set", f"data.tokenizer={tmp_path / 'tokenizer.json'}"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "could not encode" in proc.stderr and "Missing [UNK] token" in proc.stderr, proc.stderr


def test_a_token_file_that_cannot_be_memory_mapped_is_one_line(tmp_path):
    big = tmp_path / "big.bin"
    with open(big, "wb") as fh:  # sparse: 20 GB of zeros that take no disk
        fh.truncate(20 * 2**30)
    cmd = (f"ulimit -v 3000000; {sys.executable} -m shardscope.cli run --preset smoke --dry-run "
           f"--set data.kind=tokens --set data.path={big}")
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "cannot be memory-mapped" in proc.stderr, proc.stderr
