"""The search space of ``shardscope tune``: every registered strategy that can run the comparison, crossed with the
values of the options that change speed or memory but not the mathematics, and with micro-batch x gradient
accumulation at the same global batch (``ACCUM_TRIED``).

No strategy is named here: the space walks the registry and varies options by their own names (``SPEED_OPTIONS``).
A candidate the comparison's checks refuse (the model, the world size, the host) is kept with its refusal, so the
answer lists why it was not tried. What changes the numbers (the precision policy, ``MATH_OPTIONS``: the gradient
reduction's dtype) joins only when the user allows it (``--allow precision``), and every such candidate says so.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any

from shardscope.config import Comparison, ConfigError, RunSpec, validate
from shardscope.core import registry

# option -> values tried (besides its default): each changes speed or memory, never the mathematics.
SPEED_OPTIONS: dict[str, tuple[Any, ...]] = {
    "reshard_after_forward": (True, False),
    "sharding_strategy": ("FULL_SHARD", "SHARD_GRAD_OP"),
    "backward_prefetch": ("pre", "post"),
    "bucket_cap_mb": (25, 100),
    "bucket_mb": (25, 100),  # DeepSpeed's reduce and all-gather buckets: the same sums, grouped otherwise
    "microbatches": (4, 8),
    "dp_shard": ("replicate", "fsdp2"),
    "unit_blocks": (1, 2),  # FSDP2's blocks per unit: the same sums, gathered and reduced in fewer, larger calls
}
# Options whose values follow the world size: the degrees of model parallelism.
DEGREE_OPTIONS = ("tp", "pp")
# micro-batches per optimizer step tried for every strategy (the loop's ``grad_accum`` option): the global batch stays,
# so each is a smaller micro-batch (less activation memory, more calls), the same mean loss
ACCUM_TRIED = (2, 4)
ALLOWED = ("precision",)  # what --allow may add
# Candidates at most (336 for ddp-vs-fsdp at world size 4, every strategy, 2026-11-29): a bound for a space that
# grows as options join it, said when reached (``truncated``), never silent
LIMIT = 2000


PRECISION_TRIED = ("bf16-autocast",)
# option -> values tried with --allow precision only: each changes the numbers (the reduction's rounding)
MATH_OPTIONS: dict[str, tuple[Any, ...]] = {"reduce_dtype": ("bf16",)}


def truncated(cands: list[Candidate]) -> bool:
    """Whether ``candidates`` stopped at ``LIMIT``."""
    return len(cands) >= LIMIT


@dataclass
class Candidate:
    """One configuration: a run of the comparison, and what happened to it."""

    run: RunSpec
    refused: str = ""  # the comparison's checks refused it (one line)
    changes_math: bool = False  # a precision the user allowed: its loss is not the baseline's
    predicted_step_s: float | None = None
    predicted_mem_bytes: int | None = None
    pruned: str = ""  # why it was not measured
    measured: dict[str, Any] = field(default_factory=dict)
    of_preset: str = ""  # the preset's own run this candidate is (measured whatever its prediction: the reference)

    @property
    def name(self) -> str:
        """The run's name."""
        return self.run.name


def _degrees(option: str, spec: registry.OptionSpec, world_size: int) -> list[int]:
    """Degrees of model parallelism that divide the world size (at least the option's minimum)."""
    low = spec.minimum or 1
    return [d for d in range(max(2, low), world_size + 1) if world_size % d == 0]


def _variants(info: registry.StrategyInfo, world_size: int, math: bool = False) -> list[dict[str, Any]]:
    """Every combination of the strategy's speed options and degrees (the defaults included), defaults first;
    with ``math``, the options that change the numbers too (``MATH_OPTIONS``)."""
    axes: list[tuple[str, list[Any]]] = []
    tried = {**SPEED_OPTIONS, **(MATH_OPTIONS if math else {})}
    for key, spec in info.options.items():
        if key in tried:
            values = [spec.default] + [v for v in tried[key] if v != spec.default]
            if spec.choices is not None:
                values = [v for v in values if v in spec.choices]
            axes.append((key, values))
        elif key in DEGREE_OPTIONS:
            degrees = _degrees(key, spec, world_size)
            if degrees:
                axes.append((key, sorted(degrees, key=lambda d: d != spec.default)))
    out = []
    for combo in itertools.product(*(values for _, values in axes)):
        out.append({k: v for (k, _), v in zip(axes, combo) if v != info.options[k].default})
    return out or [{}]


def _name(strategy: str, options: dict[str, Any], ac: bool, precision: str) -> str:
    short = {True: "on", False: "off"}
    parts = [strategy] + [f"{'accum' if k == 'grad_accum' else k.split('_')[0]}-{short.get(v, v) if isinstance(v, bool) else v}"
                          for k, v in options.items()]
    if ac:
        parts.append("ac")
    if precision:
        parts.append(precision)
    return ".".join(str(p).replace("_", "-") for p in parts)


def _reason(message: str, src: str, name: str) -> str:
    """A refusal without the preset's path and the candidate's own name in front."""
    for prefix in (f"{src}: ", f"runs.{name}: ", f"runs.{name}."):
        message = message[len(prefix):] if message.startswith(prefix) else message
    return message


def candidates(c: Comparison, *, world_size: int, allow: tuple[str, ...] = (), host: Any = None,
               only: tuple[str, ...] = (), limit: int = 0) -> list[Candidate]:
    """Every candidate configuration of ``c`` at ``world_size`` (its model, data and global batch), each checked
    by the comparison's own rules: the refused ones carry the reason. ``only``: these strategies (all when empty;
    raises KeyError naming the allowed ones for an unknown name). At most ``limit`` (defaults first; ``LIMIT`` for
    0: a space larger than that is cut, which ``truncated`` tells)."""
    limit = limit or LIMIT
    out: list[Candidate] = []
    precisions = [""] + ([p for p in PRECISION_TRIED if p != c.precision] if "precision" in allow else [])
    chosen = [registry.get(name) for name in only] if only else list(registry.STRATEGIES.values())
    accums = [{}] + [{"grad_accum": a} for a in ACCUM_TRIED if a != c.grad_accum]
    for info in chosen:
        variants = _variants(info, world_size, math="precision" in allow)
        for variant, accum, ac, precision in itertools.product(variants, accums, (False, True), precisions):
            options = {**variant, **accum}
            run = RunSpec(name=_name(info.name, options, ac, precision), strategy=info.name, world_size=world_size,
                          options=options, activation_checkpointing=ac, precision=precision)
            cand = Candidate(run, changes_math=bool(precision) or any(k in MATH_OPTIONS for k in options))
            try:
                validate(dataclasses.replace(c, runs=[run], baseline=run.name, world_size=world_size), host=host)
            except ConfigError as err:
                cand.refused = _reason(str(err), c.source or "preset", run.name)
            out.append(cand)
            if len(out) >= limit:
                return out
    return out
