"""Every sharding layout, checked exactly: each strategy with each of its sharding options, at world sizes 2
and 4 (where the layout allows), with fp32 and bf16 parameters, through the real command line.

One ``shardscope run`` per (world size, precision): a preset generated here holds every layout as a run
of one comparison, profiled for one step with ``profile.count_collectives`` on. Each run is then checked
three ways against independent counts:

- communication: the trace analysis (the profiler's trace only) equals the in-rank count (the tensors
  handed to each collective, ``comm`` records) per collective type, and observed/theory is 1 +- 0.02;
- model states: the memory model's prediction for every rank equals that rank's exact ``memory`` record
  (counted from the tensors it holds), where the model is exact (see ``STATE_TOLERANCE``);
- the report: every section is written and the command exits 0.

Cost: one comparison of 12 to 16 runs is 1 to 2.5 minutes on 2 CPU cores. Three comparisons: fp32 at 2
and 4 ranks, bf16 parameters at 4 (every layout; the dtype changes the bytes, not which layouts exist,
and the 4-rank comparison holds every 2-rank layout too: a fourth comparison, bf16 at 2 ranks, cost CI
a minute and a half and checked no formula the other three do not). The comparison at 4 ranks in fp32
(every layout, the hybrid ones and tensor parallel included) is marked ``floor``, so .ci/run runs it on
both ends of the torch range; the other two run in the newest torch's suite only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

# (run name, strategy, options, world sizes it runs at). Tensor parallel only at 4 (dp 2 x tp 2); HSDP and
# hybrid groups of 2 need 4 ranks for 2 replicas; FSDP1's HYBRID_SHARD with its default (one node's ranks)
# is one replica: FSDP1 all-reduces across it all the same.
LAYOUTS = [
    ("ddp", "ddp", {}, (2, 4)),
    ("fsdp1-full", "fsdp1", {"sharding_strategy": "FULL_SHARD"}, (2, 4)),
    ("fsdp1-grad-op", "fsdp1", {"sharding_strategy": "SHARD_GRAD_OP"}, (2, 4)),
    ("fsdp1-hybrid", "fsdp1", {"sharding_strategy": "HYBRID_SHARD"}, (2, 4)),
    ("fsdp1-hybrid-2x2", "fsdp1", {"sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 2}, (4,)),
    ("fsdp1-no-shard", "fsdp1", {"sharding_strategy": "NO_SHARD"}, (2, 4)),
    ("fsdp2-reshard", "fsdp2", {"reshard_after_forward": True}, (2, 4)),
    ("fsdp2-keep", "fsdp2", {"reshard_after_forward": False}, (2, 4)),
    ("fsdp2-hsdp-2x2", "fsdp2", {"replicate": 2}, (4,)),
    ("handwritten", "fsdp-handwritten", {"reshard_after_forward": True}, (2, 4)),
    ("handwritten-keep", "fsdp-handwritten", {"reshard_after_forward": False}, (2, 4)),
    ("zero1", "deepspeed-zero1", {}, (2, 4)),
    ("zero2", "deepspeed-zero2", {}, (2, 4)),
    ("zero3", "deepspeed-zero3", {}, (2, 4)),
    ("autotp", "deepspeed-autotp", {"tp": 2, "stage": 1}, (4,)),
    ("fsdp2-tp", "fsdp2-tp", {"tp": 2}, (4,)),
]
FLOOR_TOO = {(4, "fp32")}  # also on the floor of the torch range; the rest runs in the newest torch's suite


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


def preset_text(world_size: int, precision: str) -> str:
    """A preset holding every layout that runs at ``world_size``: a tiny Qwen2-layout model (AutoTP needs a
    Hugging Face model), 4 steps, step 2 profiled with the in-rank collective count."""
    lines = [f'description = "layout matrix at {world_size} ranks, {precision}"', "steps = 4", "global_batch = 8",
             "grad_accum = 1", "lr = 3e-3", "warmup_steps = 1", "grad_clip = 1.0", f'precision = "{precision}"',
             f"world_size = {world_size}", "seed = 1234", "stall_timeout_s = 240", "",
             "[model]", 'kind = "hf"', 'hf_arch = "qwen2-tiny"', "hf_layers = 2", "vocab_size = 512", "seq_len = 16",
             "", "[profile]", "enabled = true", "start_step = 2", "steps = 1", "count_collectives = true",
             "record_shapes = true"]
    for name, strategy, options, sizes in LAYOUTS:
        if world_size not in sizes:
            continue
        lines += ["", "[[runs]]", f'name = "{name}"', f'strategy = "{strategy}"']
        if options:
            lines.append("options = { " + ", ".join(f"{k} = {_toml(v)}" for k, v in options.items()) + " }")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """``get(world_size, precision)``: the run directory of that comparison, run through the command line the
    first time it is asked for (so a selection of tests runs only the comparisons it needs)."""
    done: dict[tuple[int, str], str] = {}

    def get(world_size: int, precision: str) -> str:
        key = (world_size, precision)
        if key not in done:
            base = tmp_path_factory.mktemp(f"matrix-{world_size}-{precision}")
            preset = base / "matrix.toml"
            preset.write_text(preset_text(world_size, precision), encoding="utf-8")
            out = str(base / "run")
            proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "run", "--preset", str(preset), "--headless",
                                   "--out", out], capture_output=True, text=True, timeout=1800, check=False, cwd=REPO)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            done[key] = out
        return done[key]

    return get


def _where(world_size: int, precision: str) -> list:
    return [pytest.mark.floor] if (world_size, precision) in FLOOR_TOO else []


COMPARISONS = [(2, "fp32"), (4, "fp32"), (4, "bf16-params")]
CASES = [pytest.param(ws, p, id=f"{ws}-{p}", marks=_where(ws, p)) for ws, p in COMPARISONS]
RUNS = [pytest.param(ws, p, name, id=f"{ws}-{p}-{name}", marks=_where(ws, p))
        for ws, p in COMPARISONS for name, _, _, sizes in LAYOUTS if ws in sizes]


def _summary(out: str) -> dict:
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as fh:
        return json.load(fh)


def _counted(run_dir: str) -> list[dict]:
    """Each rank's in-rank count: {collective type: figures} from its last ``comm`` record."""
    per_rank = []
    metrics = os.path.join(run_dir, "metrics")
    for name in sorted(os.listdir(metrics)):
        with open(os.path.join(metrics, name), encoding="utf-8") as fh:
            records = [json.loads(line) for line in fh if '"comm"' in line]
        per_rank.append(records[-1]["collectives"])
    return per_rank


@pytest.mark.parametrize("world_size, precision", CASES)
def test_every_section_of_the_report_is_written(matrix, world_size, precision):
    out = matrix(world_size, precision)
    s = _summary(out)
    assert all(r["status"] == "ok" for r in s["runs"]), [(r["name"], r.get("error")) for r in s["runs"]]
    for key in ("memory", "communication", "parity", "traces", "explain", "recommendation"):
        assert key in s, key
    assert not [name for name, e in s["explain"].items() if "error" in e]
    assert os.path.exists(os.path.join(out, "report.md"))


@pytest.mark.parametrize("world_size, precision, name", RUNS)
def test_bytes_equal_the_in_rank_count_and_the_theory(matrix, world_size, precision, name):
    comm = _summary(matrix(world_size, precision))["communication"]["runs"][name]
    counted = _counted(os.path.join(matrix(world_size, precision), name))
    assert not comm["unknown_sizes"], comm.get("note")
    kinds = {k for rank in counted for k in rank}
    assert set(comm["collectives"]) == kinds
    for kind in kinds:
        row = comm["collectives"][kind]
        mean = sum(rank.get(kind, {}).get("bytes_per_step", 0.0) for rank in counted) / len(counted)
        assert row["bytes_per_step"] == pytest.approx(mean, rel=1e-9), kind
        groups = {rank[kind]["group_size"] for rank in counted if kind in rank}
        if row["group_size"] is not None:  # a group size the trace gives is the one the ranks handed in
            assert {row["group_size"]} == groups, kind
        else:  # or it says why not: never 1 or 0 standing in for "unknown"
            assert row["not_measured"]["group_size"], kind
    assert comm["theory"]["ratio"] == pytest.approx(1.0, abs=0.02), comm["theory"]


@pytest.mark.parametrize("world_size, precision, name", RUNS)
def test_predicted_model_states_equal_every_ranks_own_count(matrix, world_size, precision, name):
    memory = _summary(matrix(world_size, precision))["memory"]["runs"][name]
    assert sorted(memory["per_rank"]) == [str(r) for r in range(world_size)]
    for rank, row in memory["per_rank"].items():
        for key in ("param_bytes", "grad_bytes", "optim_bytes", "model_state_bytes"):
            assert row["predicted"][key] == row["measured"][key], (rank, key, row)
