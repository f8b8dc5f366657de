"""Repeats of ``shardscope tune``'s proof, as the noise rule needs: one comparison can name a winner that a second
sitting on a shared machine would not (issue 44), so the proof runs again while the budget allows, with the order
of the runs reversed each round (A B C, then C B A: a drift of the machine's load favours no one), each round with
its own A/A control.

- **Who runs again**: the winner and the candidates within its noise (a tie to resolve), else the runner-up (a lead
  to confirm), and the preset's own runs measured beside them (the answer is stated against them).
- **Pooling**: in each round every run's ratio to the first round's winner (the reference, every round's baseline),
  on that round's own measure (tokens/s, or tokens per busy CPU second where ranks waited for a core) and with its
  noise band (``numbers.speed_verdict``). The winner is the highest median ratio; another run is distinguishable
  from it only when every round that measured both puts it below the winner beyond that round's band. Otherwise
  the two are a tie: "not distinguishable on this machine now".
- **Budget**: the first round is chosen within ``FIRST_ROUND_SHARE`` of the budget when further rounds may follow.
- **Stop**: when a round leaves no tie to resolve after a confirmation, at ``MAX_ROUNDS``, or when the next round's
  estimated cost no longer fits the budget.
"""

from __future__ import annotations

import statistics
from typing import Any

from shardscope.analysis.tune.space import Candidate

MAX_ROUNDS = 3
# The first round's share of the budget when further rounds may follow: the rest is what confirms or resolves its
# verdict (the first round otherwise fills the budget, and no lead is ever measured twice; seen on ddp-vs-fsdp at 4
# ranks with a 5-minute budget, 2026-11-29: round 1 took 265 s of 300, round 2 needed about 60)
FIRST_ROUND_SHARE = 0.7


def contenders(cands: list[Candidate], answer: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    """The runs of the next round, the winner first: those within its noise, else the measured runner-up, then the
    preset's own runs measured ok ([] when there is no winner or nothing to run it beside)."""
    winner = answer.get("winner")
    if not winner:
        return []
    rates = {r.get("name"): r.get("median_tokens_per_s") or r.get("median_samples_per_s")
             for r in summary.get("runs") or [] if isinstance(r, dict) and r.get("status") == "ok"}
    others = [n for n in answer.get("tie") or [] if n in rates]
    if not others:
        ranked = sorted((n for n in rates if n != winner and n in {x.name for x in cands}),  # not the A/A control
                        key=lambda n: -(rates[n] or 0))
        others = ranked[:1]
    preset = [x.name for x in cands if x.of_preset and x.name in rates]
    names = [winner] + [n for n in dict.fromkeys([*others, *preset]) if n != winner]
    return names if len(names) > 1 else []


def ratios(summary: dict[str, Any], reference: str) -> dict[str, tuple[float, float | None]]:
    """{run: (its ratio to ``reference`` on the round's own measure, the noise band of that ratio or None when
    untested)} from one round's recommendation (each run's verdict against the round's baseline)."""
    rec = summary.get("recommendation") or {}
    base = summary.get("baseline")
    per = rec.get("runs") or {}

    def against_base(name: str) -> tuple[float | None, float | None]:
        if name == base:
            return 1.0, None
        v = (per.get(name) or {}).get("verdict") or {}
        ratio = v.get("ratio")
        return (float(ratio) if isinstance(ratio, (int, float)) and ratio > 0 else None,
                float(v["band"]) if isinstance(v.get("band"), (int, float)) else None)

    ref, ref_band = against_base(reference)
    if not ref:
        return {}
    out = {}
    for name, entry in per.items():
        if not isinstance(entry, dict) or entry.get("status") != "ok":
            continue
        ratio, band = against_base(name)
        if ratio:
            bands = [b for b in (band, ref_band) if b]
            out[name] = (ratio / ref, max(bands) if bands else None)
    return out


def combine(rounds: list[dict[str, Any]], reference: str, cands: list[Candidate]) -> dict[str, Any]:
    """The answer of several rounds (``rounds``: their summaries, the first round's winner ``reference`` in each):
    ``winner``, ``tie``, ``pooled`` ({run: median ratio to the reference}) and ``lines``."""
    per_round = [ratios(s, reference) for s in rounds]
    names = [n for n in per_round[-1] if all(n in r for r in per_round)]  # measured ok in every round
    pooled = {n: statistics.median(r[n][0] for r in per_round) for n in names}
    if not pooled:
        return {"winner": None, "tie": [], "pooled": {}, "lines": ["no run was measured ok in every round"]}
    winner = max(pooled, key=lambda n: pooled[n])
    tie = []
    for name in sorted(pooled, key=lambda n: -pooled[n]):
        if name == winner:
            continue
        beaten = []
        for r in per_round:
            q = r[name][0] / r[winner][0]
            bands = [b for b in (r[name][1], r[winner][1]) if b]
            beaten.append(bool(bands) and q < 1 / max(bands))
        if not all(beaten):
            tie.append(name)
    order = " / ".join(" ".join(n for n in r.get("order") or [] if n in pooled) for r in rounds if r.get("order"))
    lines = [f"measured in {len(rounds)} rounds, the order reversed each round ({order}); each run's median ratio to "
             f"{reference}: " + ", ".join(f"{n} {pooled[n]:.3f}" for n in sorted(pooled, key=lambda n: -pooled[n]))]
    if tie:
        lines.append(f"no clear difference between {', '.join([winner, *tie])}: not distinguishable on this machine "
                     "now (in some round within that round's noise, or ahead)")
    else:
        lines.append(f"fastest in every round beyond each round's noise: {winner}")
    by = {x.name: x for x in cands}
    for name, ratio in pooled.items():
        if name in by:
            by[name].measured["rounds"] = [round(r[name][0], 4) for r in per_round]
            by[name].measured["pooled_ratio"] = ratio
    return {"winner": winner, "tie": tie, "pooled": pooled, "lines": lines}
