"""Module by module: where the probes of two re-runs (``engines/module_probe.py``) first differ, and whether
forward or backward first.

Steps are walked in order; in each, the forward outputs in execution order (every data-parallel rank's slice,
compared rank with rank), then the gradients in backward order (the reverse). A module differs when its norm or
a projection moves by more than the noise tolerance relative to its norm; an equal hash is bitwise equality.
Pure Python.
"""

from __future__ import annotations

import math
from typing import Any

from shardscope.core import events
from shardscope.core.events import read_records
from shardscope.core.rundir import RunFiles

Entry = list[Any]  # [module, norm, [projections], hash, numel, dtype]


def read_probes(run_dir: str) -> dict[int, dict[str, Any]]:
    """step -> ``{"forward": {dp_rank: [entries]}, "grads": [entries] | None, "grads_note": str}`` from a run's
    probe records (tensor-parallel rank 0's forward outputs)."""
    out: dict[int, dict[str, Any]] = {}
    for path in RunFiles(run_dir).rank_files():
        for r in read_records(path)[0]:
            if r.get("kind") != events.PROBE or not isinstance(r.get("step"), int):
                continue
            step = out.setdefault(r["step"], {"forward": {}, "grads": None, "grads_note": ""})
            if int(r.get("tp_rank", 0)) == 0:
                step["forward"].setdefault(int(r.get("dp_rank", 0)), r.get("forward") or [])
            if "grads" in r:
                step["grads"] = r["grads"]
            elif r.get("grads_note"):
                step["grads_note"] = r["grads_note"]
    return out


def score(a: Entry, b: Entry) -> float | None:
    """How far apart two fingerprints are, relative to the larger norm (0.0 when bitwise equal); None when the
    tensors are not comparable (different sizes: a tensor-parallel shard against a whole tensor)."""
    if a[4] != b[4]:
        return None
    if a[3] == b[3] and a[5] == b[5]:
        return 0.0
    scale = max(abs(a[1]), abs(b[1]), 1e-30)
    diffs = [abs(a[1] - b[1])] + [abs(x - y) for x, y in zip(a[2], b[2])]
    if not all(math.isfinite(d) for d in diffs):
        return math.inf
    return max(diffs) / scale


def _forward(base: dict[str, Any], run: dict[str, Any], rtol: float, state: dict[str, Any]) -> dict[str, Any] | None:
    ranks = sorted(set(base["forward"]) & set(run["forward"]))
    others = {dp: {e[0]: e for e in run["forward"][dp]} for dp in ranks}
    order = base["forward"][ranks[0]] if ranks else []
    for entry in order:  # execution order (the baseline's)
        for dp in ranks:
            mine = next((e for e in base["forward"][dp] if e[0] == entry[0]), None)
            other = others[dp].get(entry[0])
            if mine is None or other is None:
                continue
            s = score(mine, other)
            if s is None:
                state["not_comparable"].add(entry[0])
                continue
            state["bitwise"] = state["bitwise"] and s == 0.0
            if s > rtol:
                return {"module": entry[0], "rel": s, "dp_rank": dp, "first": entry is order[0],
                        "dtypes": [mine[5], other[5]]}
    return None


def _backward(base: dict[str, Any], run: dict[str, Any], rtol: float, state: dict[str, Any]) -> dict[str, Any] | None:
    others = {e[0]: e for e in run["grads"]}
    for entry in reversed(base["grads"]):  # backward runs the modules in reverse
        other = others.get(entry[0])
        s = score(entry, other) if other is not None else None
        if s is None:
            continue
        state["grads_bitwise"] = state["grads_bitwise"] and s == 0.0
        if s > rtol:
            return {"module": entry[0], "rel": s}
    return None


def first_difference(base: dict[int, dict[str, Any]], run: dict[int, dict[str, Any]], rtol: float) -> dict[str, Any]:
    """The first (step, phase, module) at which ``run``'s probes leave ``base``'s by more than ``rtol``: a dict with
    ``found``, ``step``, ``phase`` ("forward" | "backward"), ``module``, ``rel``, ``steps`` (probed in both) and
    ``finding`` (one sentence)."""
    steps = sorted(set(base) & set(run))
    if not steps:
        return {"found": False, "steps": [], "finding": "no probe records in both re-runs: no module comparison"}
    notes: list[str] = []
    previous: dict[str, Any] | None = None
    for step in steps:
        state = {"bitwise": True, "grads_bitwise": True, "not_comparable": set()}
        hit = _forward(base[step], run[step], rtol, state)
        phase = "forward"
        grads = base[step]["grads"] is not None and run[step]["grads"] is not None
        if hit is None and grads:
            hit, phase = _backward(base[step], run[step], rtol, state), "backward"
        if state["not_comparable"]:
            notes.append(f"not comparable (sizes differ: a tensor-parallel shard?): {', '.join(sorted(state['not_comparable']))}")
        if hit is not None:
            found = {"found": True, "step": step, "phase": phase, **hit, "steps": steps, "notes": notes}
            if phase == "forward" and previous is not None and previous["grads"]:
                # step-1's outputs and gradients matched: only its update can have moved the parameters apart
                found.update(step=previous["step"], phase="optimizer step", seen_at=step)
            found["finding"] = _sentence(found, state, previous)
            return found
        previous = {"step": step, "grads": grads, "bitwise": state["bitwise"], "grads_bitwise": state["grads_bitwise"],
                    "note": run[step]["grads_note"] or base[step]["grads_note"]}
    return {"found": False, "steps": steps, "notes": notes,
            "finding": f"every probed module matched within float noise (rtol {rtol:g}) at steps {steps[0]}-{steps[-1]}"}


def _sentence(hit: dict[str, Any], state: dict[str, Any], previous: dict[str, Any] | None) -> str:
    rel = f"rel {hit['rel']:.2g}"
    if hit["phase"] == "backward":
        how = "bitwise equal" if state["bitwise"] else "within float noise"
        return (f"step {hit['step']}: backward first: {hit['module']}'s gradients differ ({rel}) while every forward "
                f"output matched ({how})")
    if hit["phase"] == "optimizer step":
        how = "bitwise equal" if previous and previous["bitwise"] and previous["grads_bitwise"] else "within float noise"
        return (f"step {hit['step']}: optimizer step first: its forward outputs and gradients matched ({how}), but "
                f"step {hit['seen_at']}'s outputs differ, first {hit['module']}'s ({rel}): the update (clipping, the "
                "optimizer) moved the parameters apart")
    dtypes = hit.get("dtypes") or ["", ""]
    rel += f"; {dtypes[1]} vs {dtypes[0]}" if dtypes[0] != dtypes[1] else ""
    text = f"step {hit['step']}: forward first: {hit['module']}'s output differs ({rel})"
    if previous is not None:
        note = previous["note"] or "gradients not probed"
        return (text + f"; step {previous['step']}'s forward outputs matched ({note}): the difference entered in its "
                "backward or optimizer step")
    if not hit.get("first"):
        return text + " while every module before it matched"
    if hit["step"] == 0:
        return text + ": the first module, at step 0, from the same initial weights: it computes differently"
    return text + ": the first module, at the first probed step: its parameters or its compute already differ"
