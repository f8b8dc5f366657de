"""Compare two comparison directories run by run: the regression gate behind ``shardscope diff``.

Runs are matched by name (or by ``old=new`` pairs). For each pair this reports the loss at common
steps (max and mean |Δ|, the first step beyond the loss tolerance; a non-finite loss on either side
is a difference), the ratio of median throughputs with a noise range taken from each run's own
step-to-step spread, the peak memory ratio, bytes per step per collective type where traces
measured them, and what differs between the two (versions, device, initial weights, settings),
read from the runs' ``start`` records and ``comparison.json``. A run present on one side only is
listed, never an error.

Run states come from the same fold every view uses (``fold.replay_states``); medians from
``numbers.median_rate``. Pure Python, no torch.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from shardscope.config import Comparison
from shardscope.core.numbers import (  # noqa: F401  (relative_spread: importable from diff as before)
    common_steps, median_rate, relative_spread, speed_verdict, timed_rates,
)
from shardscope.analysis import fold
from shardscope.profiling.state import OK, RunState
from shardscope.profiling import traces
from shardscope.core.rundir import COMPARISON, RunDir, read_summary
from shardscope.core.numbers import dotted_get

DEFAULT_LOSS_TOL = 1e-4  # |Δloss| at any common step
DEFAULT_SPEED_TOL = 0.10  # new median throughput more than 10% below old (and outside the noise range)
DEFAULT_MEM_TOL = 0.10  # new peak memory more than 10% above old

# Start-record fields compared between the two sides (dotted paths), beyond versions.*.
START_FIELDS = ("device", "device_name", "backend", "host", "init_sha256", "world_size", "dp", "tp", "params",
                "micro_batch_size", "grad_accum", "precision", "spec.strategy", "spec.options",
                "spec.activation_checkpointing", "spec.compile")
# comparison.json keys that say nothing about the training itself.
IGNORED_SETTINGS = ("name", "description", "source", "runs", "launch.rdzv_endpoint", "launch.node_rank")


class DiffInputError(ValueError):
    """A directory or mapping that cannot be compared; ``str(err)`` is one line."""


@dataclass(frozen=True)
class Tolerances:
    """When a difference fails the gate."""

    loss: float = DEFAULT_LOSS_TOL
    speed: float = DEFAULT_SPEED_TOL
    mem: float = DEFAULT_MEM_TOL


@dataclass
class Side:
    """One comparison directory, read through the shared fold."""

    out_dir: str
    comparison: Comparison
    states: dict[str, RunState]
    summary: dict[str, Any] | None


def load_side(out_dir: str) -> Side:
    """Read a comparison directory; raises DiffInputError when it is not one."""
    if not RunDir(out_dir).holds_comparison():
        raise DiffInputError(f"{out_dir}: not a shardscope run directory (no {COMPARISON})")
    try:
        comparison = fold.load_comparison(out_dir)
    except (OSError, ValueError, TypeError) as err:
        raise DiffInputError(f"{RunDir(out_dir).comparison}: unreadable ({err})") from None
    return Side(out_dir, comparison, fold.replay_states(out_dir), read_summary(out_dir))


def parse_map(items: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    """Parse ``old=new`` items into pairs; raises DiffInputError on a malformed one."""
    pairs = []
    for item in items:
        old, sep, new = item.partition("=")
        if not sep or not old.strip() or not new.strip():
            raise DiffInputError(f"--map {item!r}: expected OLD_RUN=NEW_RUN")
        pairs.append((old.strip(), new.strip()))
    return pairs


def match_runs(old: Side, new: Side, pairs: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """Return (matched (old, new) pairs, old-only names, new-only names). Explicit pairs first, then
    runs with the same name; a side's A/A control (``control_of``) is its noise, not a run to compare. Raises
    DiffInputError when a mapped name is on neither side."""
    old_names = [r.name for r in old.comparison.runs if not r.control_of]
    new_names = [r.name for r in new.comparison.runs if not r.control_of]
    for a, b in pairs:
        if a not in old_names:
            raise DiffInputError(f"--map {a}={b}: no run {a!r} in {old.out_dir} (runs: {', '.join(old_names)})")
        if b not in new_names:
            raise DiffInputError(f"--map {a}={b}: no run {b!r} in {new.out_dir} (runs: {', '.join(new_names)})")
    matched = list(pairs)
    mapped_old, mapped_new = {a for a, _ in pairs}, {b for _, b in pairs}
    matched += [(n, n) for n in old_names if n in new_names and n not in mapped_old and n not in mapped_new]
    used_old, used_new = {a for a, _ in matched}, {b for _, b in matched}
    return matched, [n for n in old_names if n not in used_old], [n for n in new_names if n not in used_new]


# --- per-figure comparisons ---------------------------------------------------------------------


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def loss_diff(old: list[tuple[int, float]], new: list[tuple[int, float]], tol: float) -> dict[str, Any]:
    """Compare losses at common steps. A step where either side is non-finite (and they are not the
    same infinity) counts as beyond tolerance and is listed in ``nonfinite_steps``; max/mean |Δ| are
    over the finite steps (None when there are none)."""
    diffs: list[float] = []
    nonfinite: list[int] = []
    first: dict[str, Any] | None = None
    pairs = common_steps(sorted(new), old)
    for step, value, base in pairs:
        if _finite(value) and _finite(base):
            d = abs(value - base)
            diffs.append(d)
            beyond = d > tol
        else:
            beyond = not (value == base and not math.isnan(value))  # NaN never equals; +inf == +inf
            if beyond:
                nonfinite.append(step)
            d = math.inf
        if beyond and first is None:
            first = {"step": step, "old": base, "new": value, "abs_diff": d}
    return {"steps_compared": len(pairs), "max_abs_diff": max(diffs) if diffs else None,
            "mean_abs_diff": sum(diffs) / len(diffs) if diffs else None, "nonfinite_steps": nonfinite,
            "first_beyond": first, "tolerance": tol}


def _range(noise_range: list[float] | None) -> str:
    """``[lo, hi]`` as '0.91-1.10x', or 'not measured'."""
    return f"{noise_range[0]:.2f}-{noise_range[1]:.2f}x" if noise_range else "not measured"


def speed_diff(old: RunState, new: RunState, between: float | None = None) -> dict[str, Any]:
    """Median throughput of each side, their ratio (new/old), the verdict of the one rule (``numbers.speed_verdict``:
    the two runs' own spreads composed, or wider, how far either side's A/A control moved: ``between``) and its
    noise range (a ratio within it is indistinguishable from noise)."""
    a, b = median_rate(old.throughput), median_rate(new.throughput)
    sa, sb = relative_spread(timed_rates(old.throughput)), relative_spread(timed_rates(new.throughput))
    out: dict[str, Any] = {"unit": new.unit, "old": a, "new": b, "ratio": b / a if a and b else None,
                           "noise_range": None, "spreads": [sa, sb], "between": between, "verdict": None}
    if out["ratio"] is None:
        out["reason"] = "not measured: a side has no throughput"
        return out
    v = speed_verdict(b, a, sb, sa, between)
    out["verdict"] = v["verdict"]
    if v["band"] is None:
        out["reason"] = "noise range not measured: fewer than 4 timed steps on a side and no A/A control"
    else:
        out["noise_range"] = [1 / v["band"], v["band"]]
    return out


def side_between(side: Side) -> float | None:
    """How far a side's A/A control moved from its baseline (summary.json's ``noise``), None where not measured."""
    between = ((side.summary or {}).get("noise") or {}).get("between") or {}
    return between.get("moved") if between.get("measured") else None


def mem_diff(old: RunState, new: RunState) -> dict[str, Any]:
    """Peak memory (max over ranks of allocator peak, or peak RSS on CPU) of each side and new/old; ``kind`` says
    which, and an allocator peak is never set against a process RSS."""
    from shardscope.analysis.summary import on_gpu

    a, b = old.peak_mem_bytes, new.peak_mem_bytes
    kinds = ["allocator peak" if on_gpu(s) else "process RSS" for s in (old, new)]
    out: dict[str, Any] = {"old": a, "new": b, "ratio": b / a if a and b and kinds[0] == kinds[1] else None,
                           "kind": kinds[1]}
    if not (a and b):
        out["reason"] = "not measured: a side has no memory figure"
    elif kinds[0] != kinds[1]:
        out["reason"] = f"not comparable: old is the {kinds[0]}, new the {kinds[1]}"
    return out


def _collectives(side: Side, run: str) -> dict[str, Any] | None:
    comm = ((side.summary or {}).get("communication") or {}).get("runs", {}).get(run)
    if comm is None and side.summary is None:  # no summary yet: analyse the traces themselves
        comm = traces.analyse_run(os.path.join(side.out_dir, run))
    if not comm or not comm.get("collectives") or not comm.get("comm_bytes_per_step"):
        return None
    return {k: v.get("bytes_per_step") for k, v in comm["collectives"].items()}


def comm_diff(old: Side, new: Side, old_run: str, new_run: str) -> dict[str, Any]:
    """Bytes per step per collective type on each side (from the profiled steps' traces); a side
    without traces with sizes is ``None`` ("not measured"), never 0."""
    a, b = _collectives(old, old_run), _collectives(new, new_run)
    kinds = sorted(set(a or {}) | set(b or {}))
    rows = {k: {"old": (a or {}).get(k) if a is not None else None, "new": (b or {}).get(k) if b is not None else None}
            for k in kinds}
    for row in rows.values():
        row["ratio"] = row["new"] / row["old"] if row["old"] and row["new"] is not None else None
    out: dict[str, Any] = {"per_type": rows}
    if a is None or b is None:
        missing = " and ".join(s for s, v in (("old", a), ("new", b)) if v is None)
        out["reason"] = f"not measured on the {missing} side: no profiled traces with collective sizes"
    return out


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def setting_diffs(old: Side, new: Side, old_run: str, new_run: str) -> list[dict[str, Any]]:
    """What differs between the two runs: versions and device from their rank-0 ``start`` records,
    shared settings from ``comparison.json``, and the run's own settings. ``[{key, old, new}]``."""
    out: list[dict[str, Any]] = []
    sa, sb = old.states[old_run].start.get(0) or {}, new.states[new_run].start.get(0) or {}
    fields = {f"versions.{k}" for k in set(sa.get("versions") or {}) | set(sb.get("versions") or {})}
    for key in sorted(fields) + list(START_FIELDS):
        a, b = _flatten(dotted_get(sa, key), key), _flatten(dotted_get(sb, key), key)
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                out.append({"key": k, "old": a.get(k), "new": b.get(k)})
    seen = {d["key"] for d in out}
    ca, cb = _flatten(old.comparison.shown()), _flatten(new.comparison.shown())
    ra = _flatten(next(r for r in old.comparison.to_dict()["runs"] if r["name"] == old_run), "run")
    rb = _flatten(next(r for r in new.comparison.to_dict()["runs"] if r["name"] == new_run), "run")
    ca.update(ra)
    cb.update(rb)
    for k in sorted(set(ca) | set(cb)):
        if k in seen or k == "run.name" or any(k == i or k.startswith(i + ".") for i in IGNORED_SETTINGS):
            continue
        if ca.get(k) != cb.get(k):
            out.append({"key": k, "old": ca.get(k), "new": cb.get(k)})
    return out


# --- the whole diff ------------------------------------------------------------------------------


def compare_pair(old: Side, new: Side, old_run: str, new_run: str, tol: Tolerances) -> dict[str, Any]:
    """Return the comparison of one matched pair, with ``failures``: one line per difference that
    passes a tolerance (a slowdown beyond both ``tol.speed`` and the noise range; more memory than
    ``tol.mem``; any loss step beyond ``tol.loss``; a new run that did not end ok)."""
    a, b = old.states[old_run], new.states[new_run]
    entry: dict[str, Any] = {
        "old_run": old_run, "new_run": new_run, "old_status": a.status, "new_status": b.status,
        "loss": loss_diff(a.losses, b.losses, tol.loss), "memory": mem_diff(a, b),
        "speed": speed_diff(a, b, max((x for x in (side_between(old), side_between(new)) if x is not None), default=None)),
        "communication": comm_diff(old, new, old_run, new_run), "differs": setting_diffs(old, new, old_run, new_run),
    }
    label = old_run if old_run == new_run else f"{old_run}→{new_run}"
    failures = []
    if b.status != OK:
        failures.append(f"{label}: new run ended {b.status}" + (f" ({b.error})" if b.error else ""))
    first = entry["loss"]["first_beyond"]
    if first is not None:
        failures.append(f"{label}: loss differs beyond {tol.loss:g} from step {first['step']} "
                        f"(old {first['old']:.6g}, new {first['new']:.6g}, |Δ| {first['abs_diff']:.3g})")
    if not entry["loss"]["steps_compared"]:
        failures.append(f"{label}: no common step with a loss to compare")
    speed = entry["speed"]
    if speed["ratio"] is not None:
        if speed["ratio"] < 1 - tol.speed and speed["verdict"] in ("slower", "untested"):
            failures.append(f"{label}: throughput {speed['ratio']:.3f}x of old ({speed['new']:,.0f} vs "
                            f"{speed['old']:,.0f} {speed['unit']}), beyond {tol.speed:.0%} and the noise range "
                            f"{_range(speed['noise_range'])}")
    mem = entry["memory"]
    if mem["ratio"] is not None and mem["ratio"] > 1 + tol.mem:
        failures.append(f"{label}: {mem['kind']} {mem['ratio']:.3f}x of old ({mem['new']:,} vs {mem['old']:,} bytes), "
                        f"beyond {tol.mem:.0%}")
    entry["failures"] = failures
    return entry


def diff_dirs(old_dir: str, new_dir: str, pairs: list[tuple[str, str]] | None = None,
              tol: Tolerances = Tolerances()) -> dict[str, Any]:
    """Compare two comparison directories; return a JSON-ready dict with ``runs`` (one entry per
    matched pair), ``only_old``/``only_new`` (run names), ``failures`` (all lines), ``passed``, and ``_losses``
    ({(old run, new run): (old losses, new losses)}, for plots; not JSON).
    Raises DiffInputError on a directory or mapping that cannot be compared."""
    old, new = load_side(old_dir), load_side(new_dir)
    matched, only_old, only_new = match_runs(old, new, list(pairs or []))
    runs = [compare_pair(old, new, a, b, tol) for a, b in matched]
    failures = [line for r in runs for line in r["failures"]]
    return {"old": os.path.abspath(old_dir), "new": os.path.abspath(new_dir),
            "tolerances": {"loss": tol.loss, "speed": tol.speed, "mem": tol.mem},
            "runs": runs, "only_old": only_old, "only_new": only_new, "failures": failures, "passed": not failures,
            "_losses": {(a, b): (old.states[a].losses, new.states[b].losses) for a, b in matched}}
