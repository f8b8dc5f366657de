"""The answer a comparison gives, in one screen: what to pick for speed and for memory and at what cost, what fits
the named device, whether every run trains like the baseline, and how far this machine's noise lets it tell.

Built from summary.json's sections alone (the recommendation, with its one verdict rule; the measured model states;
the loss differences; the A/A control), so report.md's first section, the headless command's closing lines and the
app's report screen say the same thing in the same order.
"""

from __future__ import annotations

from typing import Any

from shardscope.analysis import noise
from shardscope.analysis.recommend import verdict_text
from shardscope.core.numbers import fmt_bytes, fmt_sig

MAX_LINES = 12  # one screen, with the heading and the pointer to the detail


def _runs(summary: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in summary.get("runs", []) if isinstance(r, dict) and not r.get("control_of")]


def _memory(summary: dict[str, Any]) -> str | None:
    """The run holding the least model state per rank (counted exactly), with what its speed costs."""
    measured = ((summary.get("memory") or {}).get("runs") or {})
    held = {r["name"]: ((measured.get(r["name"]) or {}).get("measured") or {}).get("model_state_bytes")
            for r in _runs(summary) if r.get("status") == "ok"}
    held = {k: v for k, v in held.items() if v}
    if len(held) < 2:
        return None
    least = min(held, key=held.get)
    base = summary.get("baseline")
    rec = summary.get("recommendation") or {}
    rec_run = (rec.get("runs") or {}).get(least) or {}
    busy = str(rec.get("ranked_by", "")).startswith("tokens per busy")
    cost = f"; against {base}: {verdict_text(rec_run['verdict'], busy)}" if rec_run.get("verdict") else ""
    others = ", ".join(f"{n} {fmt_bytes(v)}" for n, v in sorted(held.items(), key=lambda kv: kv[1]) if n != least)
    return f"memory: {least} holds the least model state per rank, {fmt_bytes(held[least])} (counted exactly; {others}){cost}"


def _loss(summary: dict[str, Any]) -> str:
    """Whether every run trains like the baseline, and where to look when one does not."""
    tol = summary.get("loss_tolerance")
    base = summary.get("baseline")
    apart = [r for r in _runs(summary) if r.get("name") != base and r.get("status") in ("ok", "diverged")
             and r.get("loss_max_abs_diff") is not None and (tol is None or not r["loss_max_abs_diff"] <= tol)]
    if not apart:
        return f"loss: every run within {fmt_sig(tol)} of {base} at every common step"
    worst = max(apart, key=lambda r: r["loss_max_abs_diff"])
    names = ", ".join(r["name"] for r in apart)
    return (f"loss: {names} leave{'s' if len(apart) == 1 else ''} {base}'s loss by more than {fmt_sig(tol)} "
            f"({worst['name']}: max |Δ| {fmt_sig(worst['loss_max_abs_diff'])}); why: `shardscope why "
            f"{summary.get('out_dir', 'DIR')} {worst['name']}`")


def lines(summary: dict[str, Any]) -> list[str]:
    """The answer's sentences, at most ``MAX_LINES``: speed, memory, fit, loss, failures, noise."""
    rec = summary.get("recommendation") or {}
    rec_lines = list(rec.get("lines") or [])
    out: list[str] = []
    waited = [line for line in rec_lines if line.startswith("ranks waited for a core")]
    speed = [line for line in rec_lines if line.startswith(("fastest run", "no clear difference", "no run finished"))]
    out += [f"speed: {line}" for line in speed] or ["speed: not measured (no run finished ok)"]
    memory = _memory(summary)
    if memory:
        out.append(memory)
    out += [f"fit: {line}" for line in rec_lines if " would not fit " in line]
    out.append(_loss(summary))
    out += [line for line in rec_lines if ": left out of the recommendation" in line]
    out += waited
    out.append(noise.line(summary.get("noise") or {}, rec.get("ranked_by") == "tokens per busy CPU second"))
    out += [f"caveat: {c}" for c in rec.get("caveats") or []]
    return out[:MAX_LINES]


def markdown(summary: dict[str, Any]) -> str:
    """report.md's first section."""
    body = "\n".join(f"- {line}" for line in lines(summary))
    return f"## Answer\n\n{body}\n\nThe detail follows: every figure below, with its own check.\n"
