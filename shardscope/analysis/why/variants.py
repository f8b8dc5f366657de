"""What ``shardscope why`` re-runs: the suspects of one run against the baseline, each a variant that moves one
setting back towards the baseline, pairs of them, the short window they run for and a cost estimate.

Suspects come from two places: the run's own settings that differ from the baseline's (precision policy,
activation checkpointing, compile) and the quirks the registry declares next to each strategy (``suspects``) and
for the shared loop (``LOOP_SUSPECTS``): an option whose effective value differs from the baseline's. A variant
that would change nothing is not a suspect. Torch-free.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import statistics
from dataclasses import dataclass, field
from typing import Any

from shardscope.core import registry
from shardscope.config import Comparison, RunSpec, resolved_options, resolved_precision
from shardscope.profiling.state import RunState

EXTRA_STEPS = 3  # a variant runs this many steps past the first divergent one
MAX_PAIRS = 6
PREFIX = "why-"
DTYPE_OPTION = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # a start record's dtype -> option value
RUN_SETTINGS = (  # the run's own settings a variant can set to the baseline's: (field, the setting's name)
    ("precision", "precision policy"),
    ("activation_checkpointing", "activation checkpointing"),
    ("compile", "compile"),
)


@dataclass
class Variant:
    """One re-run: the settings it moves towards the baseline and the RunSpec changes that do it."""

    name: str
    settings: list[str]
    changes: dict[str, Any] = field(default_factory=dict)  # RunSpec fields; "options": {option: value}
    describe: str = ""  # "reduce_dtype bf16 -> fp32"
    quirk: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The variant as why.json and ``--json`` carry it."""
        return dataclasses.asdict(self)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def _start_dtype(start: dict[str, Any], slot: str) -> str | None:
    """The option value (fp32, bf16, fp16) of a start record's precision slot, or None when not recorded."""
    dtype = (start.get("precision") or {}).get(slot) if isinstance(start.get("precision"), dict) else None
    return DTYPE_OPTION.get(str(dtype)) if dtype else None


def _effective(value: Any, towards: Any, run_start: dict[str, Any]) -> Any:
    """An option's value as it acts: a dtype option's "auto" is the run's own policy dtype in that slot."""
    if value == "auto" and isinstance(towards, str) and towards.startswith("baseline:"):
        return _start_dtype(run_start, towards.split(":", 1)[1]) or "auto"
    return value


def _towards(suspect: registry.Suspect, base: RunSpec, run: RunSpec, base_start: dict[str, Any]) -> Any:
    """The value a variant sets: the baseline's own when it has the option, else the suspect's declared one."""
    if suspect.option in registry.LOOP_OPTIONS:
        return base.options.get(suspect.option, registry.LOOP_OPTIONS[suspect.option].default)
    if base.strategy == run.strategy:
        return resolved_options(base).get(suspect.option)
    if isinstance(suspect.towards, str) and suspect.towards.startswith("baseline:"):
        return _start_dtype(base_start, suspect.towards.split(":", 1)[1]) or "auto"
    return suspect.towards


def _precision_detail(base_start: dict[str, Any], run_start: dict[str, Any]) -> str:
    a, b = base_start.get("precision") or {}, run_start.get("precision") or {}
    if not isinstance(a, dict) or not isinstance(b, dict):
        return ""
    names = {"param": "parameter dtype", "compute": "compute dtype", "reduce": "reduce dtype",
             "master": "master-weight dtype", "loss_scaling": "loss scaling"}
    parts = [f"{label} {b.get(k)} vs {a.get(k)}" for k, label in names.items() if a.get(k) != b.get(k)]
    return "; ".join(parts)


def suspects(c: Comparison, run: RunSpec, base: RunSpec, base_start: dict[str, Any],
             run_start: dict[str, Any]) -> list[Variant]:
    """One variant per setting of ``run`` that differs from the baseline's, in a fixed order: the run's own
    settings, then the strategy's declared quirks, then the loop's."""
    out: list[Variant] = []
    for name, setting in RUN_SETTINGS:
        mine = resolved_precision(c, run) if name == "precision" else getattr(run, name)
        theirs = resolved_precision(c, base) if name == "precision" else getattr(base, name)
        if mine != theirs:
            detail = _precision_detail(base_start, run_start) if name == "precision" else ""
            out.append(Variant(PREFIX + _slug(setting), [setting], {name: theirs}, f"{name} {mine} -> {theirs}",
                               detail))
    info = registry.get(run.strategy)
    options = {**resolved_options(run), **run.options}
    for suspect in (*info.suspects, *registry.LOOP_SUSPECTS):
        spec = info.option(suspect.option)
        value = options.get(suspect.option, spec.default if spec else None)
        towards = _towards(suspect, base, run, base_start)
        if _effective(value, suspect.towards, run_start) == _effective(towards, suspect.towards, base_start):
            continue
        out.append(Variant(PREFIX + _slug(suspect.setting), [suspect.setting], {"options": {suspect.option: towards}},
                           f"{suspect.option} {value} -> {towards}", suspect.quirk))
    return out


def combine(a: Variant, b: Variant) -> Variant | None:
    """Both variants' changes at once; None when they set the same thing."""
    shared = set(a.changes) & set(b.changes) - {"options"}
    opts_a, opts_b = a.changes.get("options", {}), b.changes.get("options", {})
    if shared or set(opts_a) & set(opts_b):
        return None
    changes = {**a.changes, **b.changes}
    if opts_a or opts_b:
        changes["options"] = {**opts_a, **opts_b}
    name = (a.name + "." + b.name.removeprefix(PREFIX))[:64]
    return Variant(name, a.settings + b.settings, changes, f"{a.describe}; {b.describe}",
                   " / ".join(q for q in (a.quirk, b.quirk) if q))


def pairs(singles: list[Variant], gaps: dict[str, float]) -> list[Variant]:
    """Pairs of single variants, those whose singles closed the most of the gap first (``gaps``: variant name ->
    its max |Δloss|, smaller is better), at most MAX_PAIRS."""
    ranked = sorted(singles, key=lambda v: gaps.get(v.name, float("inf")))
    found = [p for a, b in itertools.combinations(ranked, 2) if (p := combine(a, b)) is not None]
    return found[:MAX_PAIRS]


def applied(run: RunSpec, variant: Variant) -> RunSpec:
    """``run`` with the variant's changes, renamed after the variant (no fault, no probe)."""
    changes = dict(variant.changes)
    options = {**run.options, **changes.pop("options", {})}
    return dataclasses.replace(run, name=variant.name, options=options, fault="", probe_step=-1, **changes)


def window(first_step: int, steps: int) -> int:
    """How many steps the re-runs take: through the first divergent step and EXTRA_STEPS more, within the original."""
    return max(1, min(steps, first_step + 1 + EXTRA_STEPS))


def round_comparison(c: Comparison, base: RunSpec, run: RunSpec, variants: list[Variant], *, steps: int,
                     probe_step: int | None, name: str) -> Comparison:
    """The comparison of one round: the baseline, the run as it is (both probed at ``probe_step``; the run only
    when ``probe_step`` is given: a later round reuses round 1's) and the variants, for ``steps`` steps on the
    original's lr schedule, per-layer norms on, no profiler."""
    probe = -1 if probe_step is None else min(probe_step, steps - 1)
    runs = [dataclasses.replace(base, probe_step=probe)]
    runs += [dataclasses.replace(run, probe_step=probe)] if probe_step is not None else []
    runs += [applied(run, v) for v in variants]
    return dataclasses.replace(
        c, name=name, description=f"shardscope why {run.name}: controlled re-runs against {base.name}",
        steps=steps, schedule_steps=c.schedule_steps or c.steps, parity=True, baseline=base.name, runs=runs,
        profile=dataclasses.replace(c.profile, enabled=False), adjustments=[], control=False)


def run_cost(state: RunState | None) -> tuple[float | None, float | None]:
    """(seconds from the launch of an original run to its first step's end, its median step seconds), from its
    records: the launch is when its torchrun agent started (the start record's ``startup``), so the time torchrun
    took to import, rendezvous and start the ranks is in it, as a re-run pays it again. None where not recorded."""
    if state is None:
        return None, None
    times = [dt for step, dt in state.step_times if step > 0] or [dt for _, dt in state.step_times]
    step_s = statistics.median(times) if times else None
    start = state.start.get(0) or {}
    marks = start.get("startup") if isinstance(start.get("startup"), dict) else {}
    began = marks.get("agent") or marks.get("process") or marks.get("entry")
    first = state.first_step_t or (float(start["t"]) if start.get("t") else None)
    startup = float(first) - float(began) if began and first else None
    return startup, step_s


ROUND_S = 2.0  # each round's own cost beside its runs: the orchestrator, the last run's teardown, the reports


def estimate_s(states: dict[str, RunState], base: str, run: str, runs: int, steps: int) -> dict[str, Any]:
    """Seconds ``runs`` re-runs of ``steps`` steps should take (the baseline's figures for one, the run's for the
    rest): each what its original paid from its launch to its first step's end, then its median step for the other
    steps, and the round's own ``ROUND_S``; ``basis`` says what was known."""
    total, known = ROUND_S, []
    for i in range(runs):
        startup, step_s = run_cost(states.get(base if i == 0 else run))
        total += (startup or 0.0) + (step_s or 0.0) * max(0, steps - (1 if startup is not None else 0))
        known.append(startup is not None and step_s is not None)
    basis = ("what each original run paid from its launch to its first step, then its median step" if all(known) else
             "the original runs' median step time (their launch was not recorded: not included)")
    return {"seconds": total, "runs": runs, "steps": steps, "basis": basis}