"""The user's model and data, checked before anything starts (no torchrun): the model check's description against
the real module, the token formats against the file's own bytes, every bad input as one line and exit 2.

The description (``engines/describe.py``, fake tensors in a subprocess) is held against the module built for real:
every parameter's name and shape, the blocks, the embeddings; its FLOPs against torchtitan's count. The token
sources are held against windows cut from the file with numpy. Each bad input goes through the command line
(``run --dry-run``: nothing launches) and must give exit 2, one line on stderr, no traceback.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shardscope import config
from shardscope.core import model_facts
from shardscope.engines import data
from shardscope.engines.model import build_model
from shardscope.engines.parallelize import blocks_of
from shardscope.profiling import memory_model

DATA = Path(__file__).resolve().parent / "data" / "user"
FAMILIES = ["llama", "mistral", "qwen3", "gemma2", "phi3", "olmo2"]
MODULE = f"{DATA / 'module' / 'mymodel.py'}:build"


def _preset(tmp: Path, model: list[str], data_lines: list[str] = (), top: list[str] = (), name: str = "p") -> Path:
    path = tmp / f"{name}.toml"
    path.write_text("\n".join(["steps = 3", "global_batch = 4", "world_size = 2", *top, "", "[model]", *model, "",
                               *data_lines, "", "[[runs]]", 'name = "ddp"', 'strategy = "ddp"', "",
                               "[[runs]]", 'name = "fsdp2"', 'strategy = "fsdp2"']) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("family", [*FAMILIES, "module"])
def test_the_description_is_the_real_module(tmp_path, family):
    model = (['kind = "module"', f'entry = "{MODULE}"', "seq_len = 16"] if family == "module"
             else ['kind = "hf"', f'path = "{DATA / family}"', "seq_len = 16"])
    c = config.load_preset(str(_preset(tmp_path, model)))
    real = build_model(c.model, c.seed)
    described = {p.name: p for p in memory_model.model_params(c.model)}
    assert {n: tuple(p.shape) for n, p in real.named_parameters()} == {n: p.shape for n, p in described.items()}
    blocks = blocks_of(real)
    assert model_facts.layers(c.model) == len(blocks) == 2
    prefix = next(n for n, m in real.named_modules() if m is blocks)
    for name, p in described.items():  # each tensor in its block's unit, the rest in the root
        inside = name.startswith(prefix + ".")
        assert p.unit == (f"layers.{name[len(prefix) + 1:].split('.')[0]}." if inside else "root"), name
    embeddings = {f"{n}.weight" for n, m in real.named_modules() if isinstance(m, torch.nn.Embedding)}
    assert memory_model.embedding_count(c.model) == sum(p.numel() for n, p in real.named_parameters() if n in embeddings)
    vocab = real(torch.zeros(1, 16, dtype=torch.long)).shape[-1]
    assert model_facts.vocab_size(c.model) == vocab
    tied = family in ("module", "llama", "gemma2")
    assert model_facts.tied_embeddings(c.model) == tied


def test_flops_counted_on_the_module_agree_with_torchtitans_count(tmp_path):
    """FLOPs per token counted by FlopCounterMode over a training step of the real Llama module, against
    6 (N - N_emb) + 12 L H d T plus the tied output layer's 6 V h (its weight is the embedding's)."""
    c = config.load_preset(str(_preset(tmp_path, ['kind = "hf"', f'path = "{DATA / "llama"}"', "seq_len = 32"])))
    cfg = json.loads((DATA / "llama" / "config.json").read_text())
    n = memory_model.param_count(c.model)
    emb = memory_model.embedding_count(c.model)
    h, heads, layers, vocab = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"], cfg["vocab_size"]
    titan = 6 * (n - emb) + 12 * layers * heads * (h // heads) * 32 + 6 * vocab * h
    assert memory_model.flops_per_token(c.model) == pytest.approx(titan, rel=0.02)


def test_estimate_of_a_llama_7b_config(tmp_path):
    """Llama-2-7B's public config.json: 6,738,415,616 parameters from the shapes of the real module, with fake
    tensors (nothing allocated), and its memory at 8 ranks with activations."""
    folder = tmp_path / "llama-7b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}))
    preset = _preset(tmp_path, ['kind = "hf"', f'path = "{folder}"', "seq_len = 1024"])
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "estimate", "--preset", str(preset),
                           "--world-size", "8", "--device-memory", "80GiB"], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "6,738,415,616 parameters" in proc.stdout, proc.stdout
    assert "activations" in proc.stdout.lower()


def _batch(tmp_path, data_lines, model=None, step=3):
    model = model or ['kind = "hf"', f'path = "{DATA / "llama"}"', "seq_len = 16"]
    c = config.load_preset(str(_preset(tmp_path, model, data_lines)))
    return c, data.make_source(c).global_batch(step)


def test_one_token_stream_in_three_formats(tmp_path):
    """train.bin (raw uint16), shard.bin (llm.c) and tokens.npy (uint32) hold the same tokens: every format gives the
    same batches, and each batch is windows of the file itself at the positions drawn from (seed, step)."""
    raw = np.fromfile(DATA / "train.bin", dtype=np.uint16).astype(np.int64)
    batches = {}
    for name in ("train.bin", "shard.bin", "tokens.npy"):
        c, (inputs, targets) = _batch(tmp_path, ["[data]", 'kind = "tokens"', f'path = "{DATA / name}"'])
        assert c.data.described["tokens"] == len(raw), name
        batches[name] = (inputs, targets)
    assert c.data.described["format"] == ".npy" and c.data.described["dtype"] == "uint32"
    gen = torch.Generator().manual_seed(data.step_seed(c.seed, 3))
    starts = torch.randint(len(raw) - 17 + 1, (4,), generator=gen).numpy()
    expected = np.stack([raw[s:s + 17] for s in starts])
    for name, (inputs, targets) in batches.items():
        assert np.array_equal(inputs.numpy(), expected[:, :-1]), name
        assert np.array_equal(targets.numpy(), expected[:, 1:]), name


def test_text_through_a_tokenizer(tmp_path, monkeypatch):
    from tokenizers import Tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    text = (DATA / "corpus.txt").read_text(encoding="utf-8")
    ids = np.asarray(Tokenizer.from_file(str(DATA / "tokenizer.json")).encode(text).ids)
    c, (inputs, _) = _batch(tmp_path, ["[data]", 'kind = "text"', f'path = "{DATA / "corpus.txt"}"',
                                       f'tokenizer = "{DATA / "tokenizer.json"}"'])
    assert c.data.described["tokens"] == len(ids)
    assert list(Path(tmp_path / "cache" / "shardscope" / "tokens").iterdir())  # tokenised once, kept
    starts = [int(np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(ids, 16) == row, axis=1))[0])
              for row in inputs.numpy()]
    assert len(starts) == 4
    again = config.load_preset(str(tmp_path / "p.toml"))  # the cache is reused: same file, same tokens
    assert again.data.described["path"] == c.data.described["path"]


def _refused(preset: Path, *sets: str) -> str:
    """The one-line reason ``config.load_preset`` refuses ``preset`` with (what the command line prints after
    ``shardscope: error:``, exit 2: ``_usage_error`` checks that path once per kind of input)."""
    from shardscope.config import ConfigError

    with pytest.raises(ConfigError) as err:
        config.load_preset(str(preset), list(sets))
    assert "\n" not in str(err.value)
    return str(err.value)


def _usage_error(tmp_path, preset: Path, *sets: str) -> str:
    args = [a for s in sets for a in ("--set", s)]
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "run", "--preset", str(preset), "--dry-run", *args],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_bad_models_are_one_line_before_anything_starts(tmp_path):
    hf = _preset(tmp_path, ['kind = "hf"', f'path = "{DATA / "llama"}"', "seq_len = 16"])
    line = _usage_error(tmp_path, hf, f'model.path="{tmp_path / "nowhere"}"')
    assert line.startswith("shardscope: error: --set model.path=") and "no such file or directory" in line, line
    missing = _preset(tmp_path, ['kind = "hf"', f'path = "{tmp_path / "nowhere"}"', "seq_len = 16"], name="missing")
    line = _usage_error(tmp_path, missing)
    assert f"missing.toml: model.path = '{tmp_path / 'nowhere'}': no such file or directory" in line, line
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "not-a-model", "hidden_size": 8}))
    line = _usage_error(tmp_path, hf, f'model.path="{odd}"')
    assert "not-a-model" in line, line
    broken = tmp_path / "broken"
    shutil.copytree(DATA / "llama-weights", broken)
    cfg = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 48}))
    line = _usage_error(tmp_path, hf, f'model.path="{broken}"')
    assert "weights do not match the config" in line and "[16, 48] from the config" in line, line
    assert "not used by model.kind = 'hf'" in _usage_error(tmp_path, hf, "model.d_model=128")
    assert "hf_layers = 5: the config has 2 decoder layers" in _usage_error(tmp_path, hf, "model.hf_layers=5")


def test_bad_modules_are_one_line_before_anything_starts(tmp_path):
    mod = _preset(tmp_path, ['kind = "module"', f'entry = "{MODULE}"', "seq_len = 16"])
    line = _usage_error(tmp_path, mod, f'model.entry="{tmp_path / "missing.py"}:build"')
    assert "no such file" in line, line
    bad = tmp_path / "bad.py"
    bad.write_text("def build(:\n")
    assert "importing" in _refused(mod, f'model.entry="{bad}:build"')
    assert "has no function 'nope'" in _refused(mod, f'model.entry="{DATA / "module" / "mymodel.py"}:nope"')
    assert "build raised RuntimeError: out of ideas" in _refused(mod, f'model.entry="{DATA / "module" / "mymodel.py"}:raises"')
    assert "returned a dict, not an nn.Module" in _refused(mod, f'model.entry="{DATA / "module" / "mymodel.py"}:no_module"')
    assert "model.blocks = 'norm': a RMSNorm, not an nn.ModuleList" in _refused(mod, 'model.blocks="norm"')
    assert "has no attribute 'stack'" in _refused(mod, 'model.blocks="stack"')


def test_bad_data_is_one_line_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    small = ['kind = "hf"', f'path = "{DATA / "llama-weights"}"', "seq_len = 16"]  # vocabulary 128
    tokens = _preset(tmp_path, small, ["[data]", 'kind = "tokens"', f'path = "{DATA / "train.bin"}"'])
    line = _usage_error(tmp_path, tokens)
    assert "outside the model's vocabulary of 128" in line, line
    llama = ['kind = "hf"', f'path = "{DATA / "llama"}"', "seq_len = 16"]
    short = _preset(tmp_path, llama, ["[data]", 'kind = "tokens"', f'path = "{DATA / "train.bin"}"'],
                    top=["global_batch = 1024"], name="short")
    short.write_text(short.read_text().replace("global_batch = 4\n", ""))
    assert "one global batch needs 1024 windows" in _refused(short)
    as_text = _preset(tmp_path, llama, ["[data]", 'kind = "text"', f'path = "{DATA / "train.bin"}"'], name="as_text")
    assert "data.kind = 'tokens'" in _refused(as_text)
    bytes_small = _preset(tmp_path, small, ["[data]", 'kind = "text"', f'path = "{DATA / "corpus.txt"}"'], name="bytes")
    assert "it must be at least 256" in _refused(bytes_small)
    tiny_vocab = _preset(tmp_path, ['kind = "module"', f'entry = "{MODULE}"', "seq_len = 16", "", "[model.args]",
                                    "vocab = 16"],
                         ["[data]", 'kind = "text"', f'path = "{DATA / "corpus.txt"}"',
                          f'tokenizer = "{DATA / "tokenizer.json"}"'], name="tiny")
    assert "more than the model's 16" in _refused(tiny_vocab)
    assert "data.dtype = 'int8': allowed: uint16, uint32" in _refused(
        _preset(tmp_path, llama, ["[data]", 'kind = "tokens"', f'path = "{DATA / "train.bin"}"', 'dtype = "int8"'],
                name="dtype"))


@pytest.mark.parametrize("family, tp, autotp", [
    ("llama", "", ""), ("gemma2", "", ""), ("mistral", "", ""),
    ("qwen3", "splits model.layers.*.self_attn.q_norm as 'replicated_with_grad_allreduce'",
     "DeepSpeed AutoTP follows the model's own"),
    ("phi3", "splits model.layers.*.self_attn.qkv_proj as 'colwise_gather_output'", "DeepSpeed AutoTP follows the model's own"),
    ("olmo2", "splits model.layers.*.self_attn.q_proj as 'colwise_gather_output'", "DeepSpeed AutoTP follows the model's own")])
def test_each_family_s_own_plan_decides_tensor_parallelism_before_the_start(tmp_path, family, tp, autotp):
    """FSDP2 + TP applies a family's own plan when it is plain column/row splits, and AutoTP runs the checked
    architectures, tied or not; otherwise the run is left out with the reason, before anything starts, and the others
    stay (the FSDP2 + TP and AutoTP runs of Llama and Mistral run in tests/test_user_models.py)."""
    c = config.load_preset(_with_tp(tmp_path, family))
    names = [r.name for r in c.runs]
    notes = " ".join(c.adjustments)
    assert ("tp" in names) == (not tp) and ("autotp" in names) == (not autotp), (names, notes)
    if tp:
        assert f"run tp left out: fsdp2-tp: its tensor-parallel plan {tp}" in notes, notes
    if autotp:
        assert f"run autotp left out: deepspeed-autotp: {autotp}" in notes, notes
    assert names[:2] == ["ddp", "fsdp2"]


def _with_tp(tmp_path: Path, family: str) -> str:
    path = _preset(tmp_path, ['kind = "hf"', f'path = "{DATA / family}"', "seq_len = 16"], name=family)
    path.write_text(path.read_text() + "\n[[runs]]\nname = \"tp\"\nstrategy = \"fsdp2-tp\"\nworld_size = 4\n"
                    "\n[[runs]]\nname = \"autotp\"\nstrategy = \"deepspeed-autotp\"\nworld_size = 4\n")
    return str(path)
