"""The user's own models, end to end through the real command line: one strategy per way of wrapping a model on a
Llama ``config.json`` and every strategy on a module of the user's (``tests/data/user/``), checked as the built-in
models are checked.

For each run of each comparison (2 ranks, 4 for tensor parallelism; fp32; per-layer norms on; step 2 profiled with
the in-rank collective count):
- parity: the loss and global grad norm stay within the strategy's tolerance of DDP's at every step;
- communication: the trace's bytes equal the in-rank count (the tensors each rank handed to each collective), and
  observed / theory is 1.000, the theory computed from the model check's description of the real module;
- model states: the memory model's prediction for every rank equals that rank's count of the tensors it holds.

The user's module (``module/mymodel.py``: blocks at ``self.blocks``, tied embeddings, a tensor-parallel plan of its
own) reads the user's tokens (``train.bin``, nanoGPT's uint16 format). DeepSpeed AutoTP runs only on Hugging Face
models: its run is left out of the module's comparison with that reason, and the others run.

Two other Hugging Face families (Mistral, Gemma 2) run under DDP and FSDP2 (tests/test_architectures.py: the other block layouts); Mistral (an untied
output layer, which DeepSpeed AutoTP splits by vocabulary and whose logits it gathers) also under AutoTP, its bytes and
model states checked as above.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _launch import grad_norms, max_abs_diff, read_run

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "user"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ALL = [("ddp", "ddp", {}, 2), ("fsdp1", "fsdp1", {}, 2), ("fsdp2", "fsdp2", {}, 2),
       ("handwritten", "fsdp-handwritten", {}, 2), ("zero1", "deepspeed-zero1", {}, 2),
       ("zero2", "deepspeed-zero2", {}, 2), ("zero3", "deepspeed-zero3", {}, 2),
       ("fsdp2-tp", "fsdp2-tp", {"tp": 2}, 4), ("autotp", "deepspeed-autotp", {"tp": 2}, 4)]
TOLERANCE = {"fsdp2-tp": 1e-4, "autotp": 1e-5}  # else 1e-5
# The Llama config.json is a Hugging Face model, which the layout matrix runs under every layout (a Qwen2 one): here
# one strategy per way of wrapping it (DDP, FSDP1, FSDP2, DeepSpeed ZeRO, the two tensor-parallel ones), 3 runs and
# ~50 s of CI fewer (2026-11-29). The user's module runs every strategy that takes it.
LEFT_OUT = {"llama": ("handwritten", "zero1", "zero2"), "module": ("autotp",)}
MODELS = {
    "llama": ['kind = "hf"', f'path = "{DATA / "llama"}"', "seq_len = 32"],
    "module": ['kind = "module"', f'entry = "{DATA / "module" / "mymodel.py"}:build"', "seq_len = 32", "",
               "[model.args]", "width = 64", "heads = 4"],
}
DATA_TABLES = {"llama": [], "module": ["[data]", 'kind = "tokens"', f'path = "{DATA / "train.bin"}"']}


def preset(model: str, runs=ALL) -> str:
    lines = ["steps = 4", "global_batch = 8", "grad_accum = 2", "parity = true", "lr = 3e-3", "warmup_steps = 1",
             'precision = "fp32"', "world_size = 2", "stall_timeout_s = 240", "loss_tolerance = 1e-4", "",
             "[model]", *MODELS[model], "", *DATA_TABLES[model], "",
             "[profile]", "start_step = 2", "steps = 1", "count_collectives = true"]
    for name, strategy, options, ws in runs:
        lines += ["", "[[runs]]", f'name = "{name}"', f'strategy = "{strategy}"', f"world_size = {ws}"]
        if options:
            lines.append("options = { " + ", ".join(f"{k} = {v}" for k, v in options.items()) + " }")
    return "\n".join(lines) + "\n"


def run_cli(tmp: Path, text: str, *args: str) -> tuple[subprocess.CompletedProcess, str]:
    path = tmp / "user.toml"
    path.write_text(text, encoding="utf-8")
    out = str(tmp / "run")
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "run", "--preset", str(path), "--headless",
                           "--out", out, *args], capture_output=True, text=True, timeout=1700, cwd=tmp)
    return proc, out


@pytest.fixture(scope="module")
def comparisons(tmp_path_factory):
    done: dict[str, tuple[subprocess.CompletedProcess, str]] = {}

    def get(model: str):
        if model not in done:
            # the module's preset names AutoTP all the same: shardscope leaves it out, with the reason
            runs = ALL if model == "module" else [r for r in ALL if r[0] not in LEFT_OUT[model]]
            done[model] = run_cli(tmp_path_factory.mktemp(model), preset(model, runs))
        return done[model]

    return get


def _summary(out: str) -> dict:
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as fh:
        return json.load(fh)


def _ran(model: str) -> list[str]:
    return [name for name, *_ in ALL if name not in LEFT_OUT[model]]


CASES = [pytest.param(m, name, id=f"{m}-{name}") for m in MODELS for name in _ran(m)]


@pytest.mark.parametrize("model", list(MODELS))
def test_the_comparison_runs_and_says_what_it_left_out(comparisons, model):
    proc, out = comparisons(model)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = _summary(out)
    assert [r["name"] for r in s["runs"]] == _ran(model)
    assert all(r["status"] == "ok" for r in s["runs"]), [(r["name"], r.get("error")) for r in s["runs"]]
    if model == "module":
        assert "run autotp left out: deepspeed-autotp: it runs Hugging Face models only" in proc.stderr
    report = open(os.path.join(out, "report.md"), encoding="utf-8").read()
    first = "\n".join(report.splitlines()[:8])
    assert ("LlamaForCausalLM" if model == "llama" else "TinyGPT") in first, first
    if model == "module":
        assert "train.bin" in first and "sha256" in first, first


@pytest.mark.parametrize("model, name", CASES)
def test_parity_with_ddp(comparisons, model, name):
    out = comparisons(model)[1]
    ddp, run = read_run(Path(out) / "ddp"), read_run(Path(out) / name)
    tol = TOLERANCE.get(name, 1e-5)
    assert len(run.losses()) == len(ddp.losses()) == 4
    assert max_abs_diff(run.losses(), ddp.losses()) <= tol, (name, run.losses(), ddp.losses())
    assert max_abs_diff(grad_norms(run), grad_norms(ddp)) <= 1e-5, name
    mine, theirs = run.of_kind("layers"), ddp.of_kind("layers")
    assert len(mine) == len(theirs) == 4
    for a, b in zip(theirs, mine):
        assert a["grad_norms"].keys() == b["grad_norms"].keys()
        if model == "module":  # the user's blocks (self.blocks) are the layers the locator names
            assert {"blocks.0", "blocks.1"} <= set(a["grad_norms"]), a["grad_norms"].keys()
        for layer, value in a["grad_norms"].items():
            assert abs(value - b["grad_norms"][layer]) <= tol, (name, a["step"], layer)


@pytest.mark.parametrize("model, name", CASES)
def test_bytes_equal_the_in_rank_count_and_the_theory(comparisons, model, name):
    out = comparisons(model)[1]
    comm = _summary(out)["communication"]["runs"][name]
    counted = []
    for f in sorted(os.listdir(os.path.join(out, name, "metrics"))):
        with open(os.path.join(out, name, "metrics", f), encoding="utf-8") as fh:
            counted.append([json.loads(line) for line in fh if '"comm"' in line][-1]["collectives"])
    kinds = {k for rank in counted for k in rank}
    assert set(comm["collectives"]) == kinds
    for kind in kinds:
        mean = sum(rank.get(kind, {}).get("bytes_per_step", 0.0) for rank in counted) / len(counted)
        assert comm["collectives"][kind]["bytes_per_step"] == pytest.approx(mean, rel=1e-9), kind
    assert comm["theory"]["ratio"] == pytest.approx(1.0, abs=1e-3), comm["theory"]


@pytest.mark.parametrize("model, name", CASES)
def test_predicted_model_states_equal_every_ranks_own_count(comparisons, model, name):
    memory = _summary(comparisons(model)[1])["memory"]["runs"][name]
    assert memory["per_rank"]
    for rank, row in memory["per_rank"].items():
        for key in ("param_bytes", "grad_bytes", "optim_bytes", "model_state_bytes"):
            assert row["predicted"][key] == row["measured"][key], (name, rank, key)


# One family per layout the others do not cover: Mistral (an untied head AutoTP splits), Gemma 2 (sliding window,
# soft-capping). Qwen3, Phi-3 and OLMo 2 share Llama's model.layers layout, which the Llama config and the layout
# matrix's Qwen2 run under every strategy; benchmarks/architectures.py runs every family (docs/architectures.md).
FAMILIES = ["mistral", "gemma2"]


@pytest.mark.parametrize("family", FAMILIES)
def test_other_families_train_under_ddp_and_fsdp2(tmp_path, family):
    """Each family trains under DDP and FSDP2 from the same weights, within 1e-4 of each other. (Whether FSDP2 + TP
    applies each family's own plan is checked before the start, in tests/test_user_inputs.py.) Mistral's untied
    output layer also runs under AutoTP (tp 2 x dp 2): parity, observed / theory bytes 1.000 (the gathered logits
    included) and model states equal to every rank's own count."""
    autotp = family == "mistral"
    text = "\n".join(["steps = 3", "global_batch = 8" if autotp else "global_batch = 4", "world_size = 2",
                      "stall_timeout_s = 240", "control = false", "",
                      "[model]", 'kind = "hf"', f'path = "{DATA / family}"', "seq_len = 16", "",
                      *(["[profile]", "start_step = 2", "steps = 1", "count_collectives = true"] if autotp
                        else ["[profile]", "enabled = false"]), "",
                      "[[runs]]", 'name = "ddp"', 'strategy = "ddp"', "",
                      "[[runs]]", 'name = "fsdp2"', 'strategy = "fsdp2"',
                      *(["", "[[runs]]", 'name = "autotp"', 'strategy = "deepspeed-autotp"', "world_size = 4"]
                        if autotp else [])]) + "\n"
    proc, out = run_cli(tmp_path, text)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = _summary(out)
    assert [r["name"] for r in s["runs"]] == ["ddp", "fsdp2"] + (["autotp"] if autotp else [])
    ddp = read_run(Path(out) / "ddp")
    assert max_abs_diff(read_run(Path(out) / "fsdp2").losses(), ddp.losses()) <= 1e-4
    if autotp:
        assert max_abs_diff(read_run(Path(out) / "autotp").losses(), ddp.losses()) <= 1e-5
        comm = s["communication"]["runs"]["autotp"]
        assert comm["theory"]["by_type"]["all_gather"] == comm["collectives"]["all_gather"]["bytes_per_step"]
        assert comm["theory"]["ratio"] == pytest.approx(1.0, abs=1e-3), comm["theory"]
        assert any("lm_head.weight" in r for r in comm["theory"]["reasons"]), comm["theory"]["reasons"]
        for rank, row in s["memory"]["runs"]["autotp"]["per_rank"].items():
            assert row["predicted"] == {k: row["measured"][k] for k in row["predicted"]}, rank


COMMANDS = [["report", "{out}"], ["diff", "{out}", "{out}"], ["recommend", "{out}"],
            ["explain", "deepspeed-zero3", "--preset", "{preset}"], ["estimate", "--preset", "{preset}", "-n", "8"],
            ["slurm", "--preset", "{preset}", "--nodes", "2"], ["predict", "--preset", "{preset}", "--calibrate", "{out}", "--quick"],
            ["why", "{out}", "fsdp2"]]


@pytest.mark.parametrize("model", list(MODELS))
def test_every_command_reads_a_user_models_comparison(comparisons, model):
    """report, diff, recommend, explain, estimate, slurm, predict and why on the user's model: exit 0, no traceback,
    and the figures that name the model come from its description (its parameter count). ``why`` re-runs a module
    read from the run directory only with ``--trust-code`` (presets/trust.py; tests/test_trust_code.py)."""
    proc, out = comparisons(model)
    preset = str(Path(out).parent / "user.toml")
    described = json.load(open(os.path.join(out, "comparison.json"), encoding="utf-8"))["model"]["described"]
    for args in COMMANDS:
        argv = [a.format(out=out, preset=preset) for a in args]
        if args[0] == "why" and model == "module":  # re-runs build the directory's module: the user names it again
            argv.append("--trust-code")
        done = subprocess.run([sys.executable, "-m", "shardscope.cli", *argv], capture_output=True, text=True,
                              timeout=600, cwd=Path(out).parent, env={**os.environ, "COLUMNS": "200"})
        assert done.returncode == 0 and "Traceback" not in done.stderr, (argv, done.stdout[-2000:], done.stderr[-2000:])
        if args[0] == "estimate":
            assert f"{described['param_count']:,} parameters" in done.stdout, done.stdout
        if args[0] == "predict":
            assert "not predicted" not in done.stdout.split("every run")[0], done.stdout
