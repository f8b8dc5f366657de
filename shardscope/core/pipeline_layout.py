"""Pipeline parallelism without torch: how a model's units split into stages, which rank holds which stage, and
the bubble each schedule leaves in theory.

Read by the rank (engines/pipeline.py builds its stages from ``split``), the memory model and the communication
theory (the same split, so predicted per-stage states are the ones the ranks hold) and the report (theory beside
the measured bubble). Must not import torch.

Units are the model's in order: the embeddings (every parameter before the first block), one unit per block, the
head (every parameter after the last block: final norm and output layer). A split is contiguous and balanced by
parameters: the largest stage is as small as any contiguous split can make it (a linear partition, solved exactly
by dynamic programming; ties broken towards earlier stages holding fewer units), each stage at least one unit.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Callable, Collection

# schedule -> (how its bubble is figured in theory, the formula named)
FORMULAS = {
    "gpipe": "(p−1)/(m+p−1)",
    "1f1b": "(p−1)/(m+p−1)",
    "interleaved-1f1b": "(p−1)/(v·m+p−1)",
    "zero-bubble": "its action grid simulated with F = I = W = 1, B = 2 (weight passes fill idle slots)",
}


@dataclass(frozen=True)
class Unit:
    """One unit of the split: its name ("embeddings", "layers.3", "head") and parameter elements."""

    name: str
    numel: int


_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # the built-in transformer's ``layers.<i>.``, Hugging Face's ``model.layers.<i>.``


def unit_names(names: list[str], blocks: str = "", last: Collection[str] = ()) -> list[str]:
    """The unit of each parameter, given the model's parameter names in module order: ``layers.<i>`` for a
    block's (the built-in ``layers.<i>.…``, Hugging Face's ``model.layers.<i>.…``), "embeddings" for a parameter
    before the first block, "head" after it. A user's module (``blocks``: its blocks' attribute path): ``layers.<i>``
    for ``<blocks>.<i>.…``, "head" for the parameters ``post_blocks`` touches (``last``), "embeddings" for the rest."""
    if blocks:
        own = re.compile(rf"^{re.escape(blocks)}\.(\d+)\.")
        return [f"layers.{hit.group(1)}" if (hit := own.match(n)) else "head" if n in last else "embeddings"
                for n in names]
    out, seen = [], False
    for name in names:
        block = _BLOCK.search(name)
        if block:
            out.append(f"layers.{block.group(1)}")
            seen = True
        else:
            out.append("head" if seen else "embeddings")
    return out


def units_of(names_numels: list[tuple[str, int]], units: list[str] | None = None) -> list[Unit]:
    """The split's units, in order, from the model's parameters in module order (``(name, numel)``) and, where the
    caller knows them, each parameter's unit (else ``unit_names`` of the names)."""
    sizes: dict[str, int] = {"embeddings": 0}
    units = units if units is not None else unit_names([n for n, _ in names_numels])
    for unit, (_, numel) in zip(units, names_numels):
        sizes[unit] = sizes.get(unit, 0) + numel
    head = sizes.pop("head", 0)
    return [Unit(k, v) for k, v in sizes.items()] + [Unit("head", head)]


def split(sizes: list[int], n_stages: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` unit ranges for ``n_stages`` stages minimising the largest stage's size (each
    stage at least one unit). Raises ValueError when there are fewer units than stages."""
    n = len(sizes)
    if n_stages < 1 or n < n_stages:
        raise ValueError(f"{n} units cannot fill {n_stages} stages (each stage needs at least one)")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)

    @functools.lru_cache(maxsize=None)
    def best(i: int, k: int) -> tuple[int, tuple[int, ...]]:
        """(largest stage, cut points) for units i.. into k stages."""
        if k == 1:
            return prefix[n] - prefix[i], ()
        out: tuple[int, tuple[int, ...]] | None = None
        for j in range(i + 1, n - k + 2):  # the first stage is units i..j-1
            rest, cuts = best(j, k - 1)
            cost = max(prefix[j] - prefix[i], rest)
            if out is None or cost < out[0]:
                out = (cost, (j, *cuts))
        assert out is not None
        return out

    cuts = (0, *best(0, n_stages)[1], n)
    return [(cuts[i], cuts[i + 1]) for i in range(n_stages)]


def stage_ranks(n_stages: int, pp: int) -> dict[int, int]:
    """Pipeline rank of each stage: looped (stage s on rank s mod pp), as torch's interleaved schedules place
    them; with one stage per rank, stage s on rank s."""
    return {s: s % pp for s in range(n_stages)}


def stages_of(pp_rank: int, pp: int, v: int) -> list[int]:
    """The stages ``pp_rank`` holds, in order."""
    return [s for s, r in stage_ranks(pp * v, pp).items() if r == pp_rank]


def bubble_theory(schedule: str, p: int, m: int, v: int = 1) -> float | None:
    """The idle fraction of a step's pipeline time in theory (equal forward and backward costs per stage), or None
    for a schedule whose bubble comes from its action grid (``grid_bubble``)."""
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1)
    return None


def single_stage_order(schedule: str, p: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    """The action order of a one-stage-per-rank schedule, written out from its definition (torch 2.13's 1F1B grid
    labels its last rank's forwards F1..Fm, so it is not read from torch): GPipe runs every forward, then every
    backward; 1F1B warms up with ``p - rank`` forwards, then alternates one backward and one forward."""
    if schedule == "gpipe":
        return {r: [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)] for r in range(p)}
    if schedule != "1f1b":
        raise ValueError(f"{schedule}: not a one-stage-per-rank schedule")
    order = {}
    for r in range(p):
        forwards = min(m, p - r)
        actions = [("F", r, i) for i in range(forwards)]
        for b in range(m):
            actions.append(("B", r, b))
            if forwards < m:
                actions.append(("F", r, forwards))
                forwards += 1
        order[r] = actions
    return order


def simulate(order: dict[int, list[tuple[str, int, int]]], n_stages: int,
             cost: dict[str, float] | Callable[[str, int], float]) -> dict[int, list[tuple[str, int, int, float, float]]]:
    """Run each rank's actions (``(kind, stage, microbatch)``, kind F, B (full backward), I (input gradient) or W
    (weight gradient)) in order, each lasting ``cost[kind]`` (or ``cost(kind, stage)``) and starting when its inputs
    are ready: F(s, m) after F(s-1, m); B or I (s, m) after F(s, m) and B/I(s+1, m); W(s, m) after I(s, m). Returns
    each rank's actions with their start and end. Raises ValueError when the grid cannot complete (an action waits
    for one that never runs)."""
    duration = cost if callable(cost) else (lambda kind, stage: cost[kind])  # type: ignore[index]

    def needs(kind: str, s: int, mb: int) -> list[tuple[str, int, int]]:
        if kind == "F":
            return [("F", s - 1, mb)] if s > 0 else []
        if kind in ("B", "I"):
            return [("F", s, mb)] + ([("BI", s + 1, mb)] if s < n_stages - 1 else [])
        return [("BI", s, mb)]

    done: dict[tuple[str, int, int], float] = {}
    clock = {r: 0.0 for r in order}
    pos = {r: 0 for r in order}
    out: dict[int, list[tuple[str, int, int, float, float]]] = {r: [] for r in order}
    left = sum(len(v) for v in order.values())
    while left:
        moved = False
        for r, actions in order.items():
            while pos[r] < len(actions):
                kind, s, mb = actions[pos[r]]
                deps = needs(kind, s, mb)
                if not all(d in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] for d in deps])
                clock[r] = start + duration(kind, s)
                done[("BI" if kind in ("B", "I") else kind, s, mb)] = clock[r]
                out[r].append((kind, s, mb, start, clock[r]))
                pos[r] += 1
                left -= 1
                moved = True
        if not moved:
            raise ValueError("the action grid cannot complete: an action waits for one that never runs")
    return out


def grid_bubble(order: dict[int, list[tuple[str, int, int]]], stage_rank: dict[int, int],
                cost: dict[str, float] | None = None) -> float:
    """The idle fraction of a schedule's action grid (``simulate``, by default with a full backward twice a forward
    and an input or weight pass as long as a forward): 1 - busy / (ranks x makespan). Raises ValueError when the
    grid cannot complete."""
    cost = cost or {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    timed = simulate(order, len(stage_rank), cost)
    makespan = max((a[-1][4] for a in timed.values() if a), default=0.0)
    busy = sum(end - start for actions in timed.values() for *_, start, end in actions)
    return 1.0 - busy / (len(order) * makespan) if makespan else 0.0
