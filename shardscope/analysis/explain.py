"""Strategy explainers filled with a comparison's numbers (``shardscope explain``, the app, report.md).

Each strategy brings its own text: a markdown file next to its module, named from its registry
entry (``shardscope.engines.fsdp1:apply`` -> ``shardscope/engines/fsdp1.apply.md``), so a new
strategy adds one file and no code here. The text is a ``string.Template``: ``$name`` placeholders
(``PLACEHOLDERS``) are filled with figures from the memory model and the communication theory
(``--preset``) or from a run directory's summary.json (predicted beside measured). Pure Python, no
torch: the CLI and the app use it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import string
from typing import Any

from shardscope.config import Comparison, RunSpec
from shardscope.core import registry
from shardscope.profiling import comm_theory, memory_model, phases
from shardscope.core.numbers import fmt_bytes
from shardscope.core.rundir import SUMMARY
from shardscope.core.text import code_block

PLACEHOLDERS = {
    "run": "the run's name and where its numbers come from",
    "world_size": "ranks in the run (N)",
    "dp": "data-parallel ranks", "tp": "tensor-parallel degree",
    "params": "parameters of the model (Ψ)",
    "n_blocks": "transformer blocks (one FSDP/ZeRO-3 unit each)",
    "block_bytes": "one block's parameters in the dtype they are gathered in",
    "block_grad_bytes": "one block's gradients in the dtype they are reduced in",
    "root_bytes": "parameters outside the blocks (embeddings, final norm, head)",
    "options": "this run's option values",
    "sharding": "the ranks each state is split over: all data-parallel ranks, or shard groups x replicas (hybrid)",
    "memory": "model states per rank: the formula evaluated, predicted beside measured",
    "comm": "communication per optimizer step by collective: theory beside the profiled step",
}
NOT_RUN = "not measured (no run: explain a run directory for measured figures)"
UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


class ExplainError(ValueError):
    """A strategy without an explainer, a placeholder the text does not know, or a run not found."""


def explainer_path(info: registry.StrategyInfo) -> str:
    """Return the path of ``info``'s explainer: ``<module file minus .py>.<function>.md``.

    Found without importing the module (it imports torch). Raises ExplainError if the module is missing.
    """
    module, _, function = info.entry.partition(":")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        raise ExplainError(f"strategy {info.name!r}: module {module} not found")
    return f"{os.path.splitext(spec.origin)[0]}.{function}.md"


def load_text(name: str) -> str:
    """Return the explainer template of strategy ``name``; raises ExplainError when it has none."""
    path = explainer_path(registry.get(name))
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as err:
        raise ExplainError(f"strategy {name!r} has no explainer: {path}: {err.strerror}") from None
    unknown = set(string.Template(text).get_identifiers()) - set(PLACEHOLDERS)
    if unknown:
        raise ExplainError(f"{path}: unknown placeholder(s) {', '.join(sorted(unknown))}; "
                           f"allowed: {', '.join(PLACEHOLDERS)}")
    return text


# --- figures -------------------------------------------------------------------------------------


def pick_run(c: Comparison, strategy: str, run_name: str | None = None) -> tuple[RunSpec, list[str]]:
    """Return (the run to explain, the names of the other runs of ``strategy`` in ``c``).

    ``run_name`` picks one run; else the first run of the strategy; else a run of it with default
    options at the comparison's world size. Raises ExplainError for a ``run_name`` not in ``c``.
    """
    if run_name is not None:
        run = next((r for r in c.runs if r.name == run_name), None)
        if run is None:
            raise ExplainError(f"run {run_name!r} not found; runs: {', '.join(r.name for r in c.runs)}")
        return run, []
    mine = [r for r in c.runs if r.strategy == strategy]
    if mine:
        return mine[0], [r.name for r in mine[1:]]
    return RunSpec(name=strategy, strategy=strategy), []


def in_unit(values: list[float], unit_on_all: bool = False) -> list[str]:
    """Format byte counts in one binary unit (the largest that keeps the biggest value at least 1),
    4 significant digits; the unit is written after the last value, or after each with ``unit_on_all``."""
    name, size = next(((n, s) for n, s in UNITS if max(values, default=0) >= s), UNITS[-1])
    out = [f"{v / size:.4g}" for v in values]
    return [f"{v} {name}" if unit_on_all or i == len(out) - 1 else v for i, v in enumerate(out)]


def _memory_line(shards: str, full: dict[str, int], dp: int, predicted: int, measured: Any, replicas: int = 0) -> str:
    """The model-state formula of ``shards`` evaluated, then predicted and measured; ``dp`` is N, the ranks
    states are split over (the shard group under hybrid sharding, whose ``replicas`` hold the same)."""
    p, g, o = in_unit([full[k] for k in ("param_bytes", "grad_bytes", "optim_bytes")])
    forms = {"none": (f"P + G + O = {p} + {g} + {o}", "nothing is sharded"),
             "optim": (f"P + G + O/N = {p} + {g} + {o} / {dp}", "optimizer states sharded"),
             "grads": (f"P + (G + O)/N = {p} + ({g} + {o}) / {dp}", "gradients and optimizer states sharded"),
             "all": (f"(P + G + O)/N = ({p} + {g} + {o}) / {dp}", "parameters, gradients and optimizer states sharded")}
    formula, what = forms[shards]
    if isinstance(measured, (int, float)):
        pred, meas = in_unit([predicted, measured], unit_on_all=True)
        meas += " measured"
    else:
        pred, meas = in_unit([predicted])[0], str(measured)
    ranks = (f"N = {dp} ranks of a shard group, replicated {replicas} time(s) across the data-parallel ranks"
             if replicas else f"N = {dp} data-parallel ranks")
    return (f"model states per rank = {formula} = **{pred} predicted**, **{meas}** "
            f"({what}; {ranks}; P, G, O = parameters, gradients, optimizer states of the "
            f"whole model on one tensor-parallel rank)")


def _sharding_text(layout: memory_model.Layout, theory: dict[str, Any] | None) -> str:
    """How the run splits its data-parallel ranks, with the all-reduce across replicas under hybrid sharding."""
    if not layout.hybrid:
        return f"no hybrid sharding: states split over all {layout.dp} data-parallel rank(s)"
    replicas = layout.dp // layout.shard_size
    reduce = ((theory or {}).get("by_type") or {}).get("all_reduce")
    return (f"hybrid: {replicas} replica(s) of a shard group of {layout.shard_size} ranks ({layout.dp} data-parallel "
            f"ranks); each gradient shard is all-reduced across the replicas"
            + (f", {fmt_bytes(reduce)} per step" if reduce else ""))


def _comm_lines(theory: dict[str, Any] | None, measured: dict[str, Any] | None, why_not: str) -> str:
    """One bullet per collective type: bytes per step in theory and in the profiled step."""
    by_type = dict((theory or {}).get("by_type") or {})
    kinds = sorted(set(by_type) | set(measured or {}))
    if not kinds:
        return "- no collectives in theory (one rank, nothing to synchronise)"
    lines = []
    for kind in kinds:
        row = (measured or {}).get(kind)
        got = row.get("bytes_per_step") if row else None
        both = in_unit([by_type.get(kind, 0), got or 0], unit_on_all=True)
        pred = f"{both[0]} predicted" if kind in by_type else "none predicted"
        if row and got is None:
            reason = (row.get("not_measured") or {}).get("bytes_per_step", "size unknown")
            meas = f"{row['count_per_step']:g} call(s), bytes not measured ({reason})"
        else:
            meas = (f"{both[1]} measured in {row['count_per_step']:g} call(s)" if row
                    else (why_not if measured is None else "none measured"))
        lines.append(f"- {kind.replace('_', '-')} per step: {pred}, {meas}")
    if theory and theory.get("basis"):
        lines.append(f"- theory: {theory['basis']}")
    return "\n".join(lines)


def figures(c: Comparison, run: RunSpec, source: str, memory: dict[str, Any] | None = None,
            comm: dict[str, Any] | None = None, steps: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return the placeholder values (``PLACEHOLDERS``) and raw numbers for ``run`` of ``c``.

    Without ``memory``/``comm``/``steps`` (summary.json's sections for the run: memory, communication,
    ``phases``) the figures are predictions only. The raw numbers are under ``numbers`` so tests and
    views can compare them with summary.json.
    """
    d = memory_model.describe_run(c, run)  # the model and its layout, once: everything below reads it
    info, layout, params, options = d.info, d.layout, list(d.params), d.options
    predicted = (memory or {}).get("predicted") or memory_model.predict_run(c, run, described=d)
    full = memory_model.model_state_bytes(params, dataclasses.replace(layout, dp=1, shard_group=0))
    if memory is None:
        measured: Any = NOT_RUN
    else:
        measured = ((memory.get("measured") or {}).get("model_state_bytes")
                    or f"not measured ({SUMMARY} has no memory record of this run: it failed or stopped before its first "
                       "step, or the summary was written before memory records existed)")
    theory = (comm or {}).get("theory") or comm_theory.comm_of(d)
    collectives = (comm or {}).get("collectives") or None
    why = NOT_RUN if memory is None else "not measured (no trace: profiling off, or the run ended before its profiled steps)"
    p_bytes, g_bytes, c_bytes = memory_model.PRECISION_BYTES.get(layout.precision, (4, 4, 4))
    if layout.low_precision_params:
        p_bytes = g_bytes = c_bytes
    units = d.unit_numels
    blocks = [n for k, n in units.items() if k != "root"]
    values = {
        "run": f"run `{run.name}` — {source}",
        "world_size": str(layout.world_size), "dp": str(layout.dp), "tp": str(layout.tp),
        "params": f"{d.model.param_count:,}",
        "n_blocks": str(d.model.layers),
        "block_bytes": fmt_bytes(max(blocks, default=0) * p_bytes),
        "block_grad_bytes": fmt_bytes(max(blocks, default=0) * g_bytes),
        "root_bytes": fmt_bytes(units.get("root", 0) * p_bytes),
        "options": ", ".join(f"`{k} = {v}`" for k, v in options.items()) or "none",
        "sharding": _sharding_text(layout, theory),
        "memory": _memory_line(layout.shards, full, layout.shard_size, predicted["model_state_bytes"], measured,
                               layout.dp // layout.shard_size if layout.hybrid else 0),
        "comm": _comm_lines(theory, collectives, why) + _phase_text(c, run, theory, steps, why),
    }
    numbers = {"model_state_bytes_predicted": predicted["model_state_bytes"],
               "model_state_bytes_measured": measured if isinstance(measured, (int, float)) else None,
               "full": full, "shards": layout.shards, "dp": layout.dp, "shard_group": layout.shard_size,
               "comm_bytes_predicted": (theory or {}).get("bytes_per_step"),
               "comm_bytes_measured": ({k: v["bytes_per_step"] for k, v in collectives.items()}
                                       if collectives else None),
               "models": info.models,
               "phases_measured": ((steps or {}).get("measured") or {}).get("rows")}
    return {"values": values, "numbers": numbers}


def _phase_text(c: Comparison, run: RunSpec, theory: dict[str, Any], steps: dict[str, Any] | None, why: str) -> str:
    """The step phase by phase (theory beside the profiled step) and, with a trace, its picture."""
    rows = (steps or {}).get("theory") or phases.theory_phases(c, run, theory)
    measured = (steps or {}).get("measured")
    text = "\n\nPhase by phase (one optimizer step):\n" + "\n".join(phases.sequence_lines(rows, measured, why))
    if (steps or {}).get("timeline"):
        text += "\n\nThe profiled step, as it ran:\n\n```text\n" + steps["timeline"] + "\n```"
    return text


def run_entry(c: Comparison, run: RunSpec, memory: dict[str, Any] | None, comm: dict[str, Any] | None,
              steps: dict[str, Any]) -> dict[str, Any]:
    """summary.json's ``explain`` entry of one run: its strategy, the memory line and the step phase by
    phase (predicted beside measured) and the timeline, as report.md prints them."""
    f = figures(c, run, "", memory=memory or {}, comm=comm or {}, steps=steps)
    theory = (comm or {}).get("theory") or {}
    why = "not measured (no trace: profiling off, or the run ended before its profiled steps)"
    return {"strategy": run.strategy, "memory": f["values"]["memory"],
            "sequence": phases.sequence_lines(steps["theory"], steps.get("measured"), why),
            "timeline": steps.get("timeline", ""), "theory": steps["theory"], "measured": steps.get("measured"),
            "comm_bytes_predicted": theory.get("bytes_per_step")}


def render(strategy: str, values: dict[str, str]) -> str:
    """Return ``strategy``'s explainer with ``values`` filled in (markdown)."""
    return string.Template(load_text(strategy)).substitute(values)


def explain_preset(c: Comparison, strategy: str, run_name: str | None = None) -> dict[str, Any]:
    """Explain ``strategy`` with the preset's model and world size: {"text", "numbers", "notes"}."""
    registry.get(strategy)
    run, others = pick_run(c, strategy, run_name)
    notes = [f"also in preset {c.name}: {', '.join(others)} (--run NAME)"] if others else []
    if c.model.kind not in registry.get(run.strategy).models:
        notes.append(f"preset {c.name}'s model kind {c.model.kind!r} cannot run {run.strategy} (it needs "
                     f"{', '.join(registry.get(run.strategy).models)}); the figures are the memory model's")
    f = figures(c, run, f"preset {c.name}, predicted by the memory model and the communication theory")
    return {"text": render(run.strategy, f["values"]), "numbers": f["numbers"], "notes": notes, "run": run.name}


def explain_summary(c: Comparison, summary: dict[str, Any], run_name: str) -> dict[str, Any]:
    """Explain the run ``run_name`` of a run directory (its comparison and summary.json): predicted
    beside measured. Raises ExplainError when the run is not in the summary."""
    run, _ = pick_run(c, "", run_name)
    mem = ((summary.get("memory") or {}).get("runs") or {}).get(run_name) or {}
    comm = ((summary.get("communication") or {}).get("runs") or {}).get(run_name)
    if "error" in mem:
        mem = {}
    steps = ((summary.get("explain") or {}).get(run_name) or {})
    f = figures(c, run, f"run directory {summary.get('out_dir', '')}, predicted beside measured",
                memory=mem, comm=comm or {}, steps=steps or None)
    return {"text": render(run.strategy, f["values"]) + settings_section(summary, run_name), "numbers": f["numbers"],
            "notes": [], "run": run.name}


def settings_section(summary: dict[str, Any], run_name: str) -> str:
    """The run's settings as its rank 0 wrote them (summary.json's ``code``: the strategy's calls with the values
    it passed), as a section to paste from; "" when the run wrote none."""
    entry = next((r for r in summary.get("runs") or [] if isinstance(r, dict) and r.get("name") == run_name), {})
    code = entry.get("code")
    if not isinstance(code, str) or not code:
        return ""
    return ("\n\n## The settings to paste into your own training script\n\nWritten by the run's rank 0 from the values "
            "it passed to the library.\n\n" + code_block(code) + "\n")
