"""Helpers for tests that launch real torchrun jobs (gloo on CPU).

Typical use::

    comparison = tiny_comparison(runs=[RunSpec("ddp", "ddp"), RunSpec("fsdp2", "fsdp2")], steps=5)
    out = prepare(tmp_path, comparison)          # writes comparison.json and init.safetensors
    result = launch(out, comparison, "ddp")      # runs torchrun, returns a LaunchResult
    steps = result.steps(rank=0)                 # the step records of rank 0

Each launch uses a fresh free port for the c10d rendezvous and a hard timeout; on timeout the whole
process group of torchrun is killed so no rank is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardscope import config
from shardscope.core import events
from shardscope.config import Comparison, ModelSpec, ProfileSpec, RunSpec

REPO = Path(__file__).resolve().parents[1]


def tiny_comparison(runs: list[RunSpec], **overrides: Any) -> Comparison:
    """Return a validated Comparison with a tiny transformer (2 layers, d 32, vocab 128, seq 16),
    global batch 4, 2 ranks, fp32, profiler off; ``overrides`` set Comparison fields."""
    fields: dict[str, Any] = dict(
        name="test", steps=5, global_batch=4, lr=3e-3, warmup_steps=2, world_size=2, seed=1234,
        model=ModelSpec(vocab_size=128, d_model=32, n_layers=2, n_heads=4, d_ff=64, seq_len=16),
        profile=ProfileSpec(enabled=False), stall_timeout_s=60.0,
    )
    fields.update(overrides)
    comparison = Comparison(runs=runs, **fields)
    comparison = config.validate(comparison)
    return comparison


def smoke_preset(path: Path, runs_toml: str) -> Path:
    """Write the built-in smoke preset (its model and settings) with ``runs_toml`` as its runs to ``path``: a test
    reading one run launches one, not smoke's two (CI is CPU-bound; a run's start-up is most of its cost)."""
    smoke = (REPO / "shardscope" / "presets" / "smoke.toml").read_text(encoding="utf-8")
    path.write_text(smoke[:smoke.index("[[runs]]")] + runs_toml, encoding="utf-8")
    return path


def free_port() -> int:
    """Return a TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare(out_dir: Path, comparison: Comparison) -> Path:
    """Write ``comparison.json`` in ``out_dir`` (the first run's ranks write ``init.safetensors``, as in a
    comparison)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config.dump_json(out_dir / "comparison.json", comparison.to_dict())
    return out_dir


@dataclass
class LaunchResult:
    """What one torchrun job left behind."""

    returncode: int
    run_dir: Path
    console: str
    records: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # rank -> records

    def of_kind(self, kind: str, rank: int = 0) -> list[dict[str, Any]]:
        """Return the records of ``kind`` written by ``rank``."""
        return [r for r in self.records.get(rank, []) if r["kind"] == kind]

    def steps(self, rank: int = 0) -> list[dict[str, Any]]:
        """Return rank's step records in order."""
        return self.of_kind(events.STEP, rank)

    def local_losses(self, rank: int = 0) -> list[float]:
        """Return rank's per-step local losses (the mean over its own micro-batches)."""
        return [r["local_loss"] for r in self.steps(rank)]

    def losses(self) -> list[float]:
        """Return the run's per-step loss: the global ``loss`` where the records carry it, else the mean
        of every rank's local loss (computed here, independently of the fold's ``LossMean``)."""
        ranks = sorted(self.records)
        out = []
        for i, record in enumerate(self.steps(0)):
            if "loss" in record:
                out.append(record["loss"])
            else:
                out.append(sum(self.steps(r)[i]["local_loss"] for r in ranks) / len(ranks))
        return out


def launch(out_dir: Path, comparison: Comparison, run_name: str, *, device: str = "cpu",
           timeout_s: float = 300.0) -> LaunchResult:
    """Run ``run_name`` of ``comparison`` under torchrun; return its LaunchResult.

    Raises subprocess.TimeoutExpired (after killing the job) when it outlives ``timeout_s``.
    """
    run = comparison.run(run_name)
    payload = config.run_spec_payload(comparison, run, out_dir=str(out_dir), device=device)
    run_dir = Path(payload["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    config.dump_json(run_dir / "spec.json", payload)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(payload["run"]["world_size"]),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
           "-m", "shardscope.engines.worker", str(run_dir / "spec.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        console, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session holds torchrun and every rank
        proc.communicate()
        raise
    records = {}
    for path in sorted((run_dir / "metrics").glob("rank*.jsonl")):
        records[int(path.stem[4:])], _ = events.read_records(path)
    return LaunchResult(proc.returncode, run_dir, console, records)


def read_run(run_dir: Path) -> LaunchResult:
    """The records a finished run left in ``run_dir`` (a run of a ``shardscope run`` comparison), as a LaunchResult."""
    records = {}
    for path in sorted((Path(run_dir) / "metrics").glob("rank*.jsonl")):
        records[int(path.stem[4:])], _ = events.read_records(path)
    return LaunchResult(0, Path(run_dir), "", records)


def assert_ok(result: LaunchResult) -> None:
    """Raise AssertionError with the console tail when the job failed."""
    assert result.returncode == 0, f"torchrun exited {result.returncode}:\n{result.console[-4000:]}"
    ends = result.of_kind(events.END)
    assert ends and ends[-1]["status"] == "ok", f"no ok end record:\n{result.console[-4000:]}"


def read_json(path: Path) -> Any:
    """Return the JSON in ``path``."""
    return json.loads(path.read_text())


def launch_all(out_dir: Path, comparison: Comparison, names: list[str] | None = None, *,
               timeout_s: float = 300.0) -> dict[str, LaunchResult]:
    """Prepare ``out_dir`` and launch the named runs (default: all) one after another, each within
    ``timeout_s``; assert each ended ok; return {run name: LaunchResult}."""
    prepare(out_dir, comparison)
    results = {}
    for name in names or [r.name for r in comparison.runs]:
        results[name] = launch(out_dir, comparison, name, timeout_s=timeout_s)
        assert_ok(results[name])
    return results


def max_abs_diff(a: list[float], b: list[float]) -> float:
    """Return max |a[i] - b[i]|; raises AssertionError when the lengths differ."""
    assert len(a) == len(b), f"{len(a)} values vs {len(b)}"
    return max(abs(x - y) for x, y in zip(a, b))


def grad_norms(result: LaunchResult, rank: int = 0) -> list[float]:
    """Return rank's per-step global gradient norms."""
    return [r["grad_norm"] for r in result.steps(rank)]


def assert_matches(base: LaunchResult, other: LaunchResult, tol: float, *, layers: bool = False,
                   exact_first: bool = True) -> dict[str, float]:
    """Assert ``other`` trains like ``base``: identical step-0 loss (``exact_first``; within ``tol`` when the
    loss is summed in another order, as over micro-batches), every step's loss and global grad norm within
    ``tol`` and, with ``layers``, every per-layer grad and param norm within ``tol``.
    Returns the measured maxima {"loss": ..., "grad_norm": ...}."""
    first = (other.losses()[0], base.losses()[0])
    assert first[0] == first[1] if exact_first else abs(first[0] - first[1]) <= tol, first
    measured = {"loss": max_abs_diff(other.losses(), base.losses()),
                "grad_norm": max_abs_diff(grad_norms(other), grad_norms(base))}
    assert measured["loss"] <= tol and measured["grad_norm"] <= tol, measured
    if layers:
        mine, theirs = base.of_kind("layers"), other.of_kind("layers")
        assert len(mine) == len(theirs) == len(base.steps())
        for a, b in zip(mine, theirs):
            for key in ("grad_norms", "param_norms"):
                assert a[key].keys() == b[key].keys()
                for layer, value in a[key].items():
                    assert abs(value - b[key][layer]) <= tol, (key, a["step"], layer, value, b[key][layer])
    return measured
