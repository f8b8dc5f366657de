"""Validation of a Comparison: cross-field rules, each run's layout, and what this host can run.

``validate`` is pure: it returns a new, validated Comparison (baseline filled in, option values
normalised) and leaves its argument as it was. Every error is a one-line ``ConfigError``. Torch-free.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from dataclasses import dataclass
from typing import Any

from shardscope.core import model_facts, registry
from shardscope.core.record_wire import parse_endpoint
from shardscope.presets.files import ConfigError
from shardscope.presets import pipeline_checks
from shardscope.presets.inputs import model_refusal
from shardscope.presets.schema import (
    DATA_KINDS, DEVICES, HF_ARCHS, MAX_NAME, MODEL_INPUTS, MODEL_KINDS, NAME_RE, ON_NONFINITE, PRECISIONS, START_METHODS,
    TOKEN_DTYPES, Comparison, RunSpec, parse_fault, resolved_grad_accum, resolved_options, resolved_precision, resolved_world_size,
)


@dataclass(frozen=True)
class HostInfo:
    """What the machine offers: the device kind chosen and how many ranks fit on one node."""

    device: str  # "cpu" | "cuda"
    max_ranks_per_node: int
    detail: str = ""  # for messages: "2 CPU cores" or "8 GPUs"
    has_deepspeed: bool = True
    cpu_fp16: bool = False  # the CPU has AVX512-FP16 or AMX-FP16 (DeepSpeed's CPU accelerator needs one for fp16)


def cpu_has_fp16_isa(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Return True when the CPU flags include AVX512-FP16 or AMX-FP16, the instructions oneDNN
    needs for fp16 (DeepSpeed's CPU accelerator refuses fp16 without them). Read from the
    kernel's flag list so that the orchestrator stays torch-free; False where unreadable."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            flags = {word for line in f if line.startswith("flags") for word in line.split()}
    except OSError:
        return False
    return bool(flags & {"avx512_fp16", "amx_fp16"})


def cpu_host() -> HostInfo:
    """Host info for gloo on CPU: ranks may oversubscribe cores, up to max(4, 2 x cores)."""
    cores = os.cpu_count() or 1
    has_ds = importlib.util.find_spec("deepspeed") is not None
    return HostInfo("cpu", max(4, 2 * cores), f"{cores} CPU cores", has_ds, cpu_has_fp16_isa())



def _positive(src: str, key: str, value: float, allow_zero: bool = False) -> None:
    if isinstance(value, float) and not math.isfinite(value):  # nan passes every comparison below
        raise ConfigError(f"{src}: {key} = {value!r}: must be a finite number")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{src}: {key} = {value!r}: must be {'>= 0' if allow_zero else '> 0'}")


def _one_of(src: str, key: str, value: Any, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{src}: {key} = {value!r}: allowed: {', '.join(map(str, allowed))}")


def _name(src: str, key: str, value: str) -> None:
    """A comparison's or run's name: it names a directory, so letters, digits, '.', '_', '-' and a length cap."""
    if not NAME_RE.match(value):
        raise ConfigError(f"{src}: {key} = {value!r}: use letters, digits, '.', '_' or '-'")
    if len(value) > MAX_NAME:
        raise ConfigError(f"{src}: {key} = {value[:20]!r}... ({len(value)} characters): at most {MAX_NAME}")


# What a rank can honour: a value past these fails only inside every rank (a seed torch refuses, a timeout
# datetime cannot hold, a model no memory holds), so it is refused before the start. Keys: a field of the
# Comparison, or "<table>.<field>".
LIMITS: dict[str, float] = {
    "steps": 10**9, "schedule_steps": 10**9, "global_batch": 1 << 24, "grad_accum": 1 << 16, "world_size": 1 << 20,
    "seed": 2**63 - 1, "log_every": 10**9, "straggler_window": 10**6, "warmup_steps": 10**9,
    "stall_timeout_s": 10**7, "straggler_threshold": 10**6, "lr": 10**9, "weight_decay": 10**3, "grad_clip": 10**9,
    "min_lr_ratio": 1.0, "loss_tolerance": 10**6,
    "model.vocab_size": 1 << 24, "model.d_model": 1 << 20, "model.n_layers": 1 << 14, "model.n_heads": 1 << 14,
    "model.d_ff": 1 << 24, "model.seq_len": 1 << 24, "model.hf_layers": 1 << 14, "model.image_size": 1 << 16,
    "model.patch_size": 1 << 16, "model.channels": 1 << 12, "model.num_classes": 1 << 24,
    "profile.start_step": 10**9, "profile.steps": 10**6,
    "launch.nnodes": 1 << 16, "launch.node_rank": 1 << 16, "launch.node_timeout_s": 10**7,
    "launch.grace_period_s": 10**6, "launch.startup_timeout_s": 10**7,
}


def _within_limits(c: Comparison, src: str) -> None:
    """Refuse a number no rank can honour (``LIMITS``), in one line naming the key and the limit."""
    for key, limit in LIMITS.items():
        owner: Any = c
        for part in key.split(".")[:-1]:
            owner = getattr(owner, part)
        value = getattr(owner, key.split(".")[-1])
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > limit:
            shown = f"{limit:,}" if isinstance(limit, int) else f"{limit:g}"
            raise ConfigError(f"{src}: {key} = {value!r}: at most {shown}")


def validate(c: Comparison, *, host: HostInfo | None = None) -> Comparison:
    """Check cross-field rules and the layout of every run; return a new, validated Comparison.

    The result has ``baseline`` filled in (the first run when empty) and integer values of float
    options made floats; ``c`` itself is left unchanged. Raises ConfigError (one line).
    """
    src = c.source or "preset"
    _name(src, "name", c.name)
    _within_limits(c, src)
    for key in ("steps", "global_batch", "grad_accum", "world_size", "log_every", "straggler_window"):
        _positive(src, key, getattr(c, key))
    for key in ("lr", "stall_timeout_s", "straggler_threshold"):
        _positive(src, key, getattr(c, key))
    for key in ("warmup_steps", "weight_decay", "grad_clip", "min_lr_ratio", "seed", "loss_tolerance", "schedule_steps"):
        _positive(src, key, getattr(c, key), allow_zero=True)
    if c.schedule_steps and c.schedule_steps < c.steps:
        raise ConfigError(f"{src}: schedule_steps = {c.schedule_steps}: must be 0 or >= steps = {c.steps}")
    _one_of(src, "precision", c.precision, PRECISIONS)
    _one_of(src, "on_nonfinite", c.on_nonfinite, ON_NONFINITE)
    m = c.model
    _one_of(src, "model.kind", m.kind, MODEL_KINDS)
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "seq_len",
                "image_size", "patch_size", "channels", "num_classes"):
        _positive(src, f"model.{key}", getattr(m, key))
    _positive(src, "model.hf_layers", m.hf_layers, allow_zero=True)
    if m.kind == "transformer" and m.d_model % m.n_heads:
        raise ConfigError(f"{src}: model.n_heads = {m.n_heads}: must divide model.d_model = {m.d_model}")
    if m.kind == "hf" and not m.path:
        _one_of(src, "model.hf_arch", m.hf_arch, HF_ARCHS)
    if m.kind == "module":
        _one_of(src, "model.inputs", m.inputs, MODEL_INPUTS)
    if m.kind == "vit" and m.image_size % m.patch_size:
        raise ConfigError(f"{src}: model.patch_size = {m.patch_size}: must divide model.image_size = {m.image_size}")
    _one_of(src, "data.kind", c.data.kind, DATA_KINDS)
    if c.data.kind == "tokens":
        _one_of(src, "data.dtype", c.data.dtype or "uint16", TOKEN_DTYPES)
    takes = model_facts.inputs(m) if m.kind != "module" or m.inputs in MODEL_INPUTS else "tokens"
    if (c.data.kind == "images") != (takes == "images"):
        raise ConfigError(f"{src}: data.kind = {c.data.kind!r}: model.kind {m.kind!r} takes {takes}, so data.kind "
                          f"must be {'images' if takes == 'images' else 'synthetic, text or tokens'}")
    _positive(src, "profile.steps", c.profile.steps, allow_zero=True)
    _positive(src, "profile.start_step", c.profile.start_step, allow_zero=True)
    _one_of(src, "launch.device", c.launch.device, DEVICES)
    _one_of(src, "launch.start_method", c.launch.start_method, START_METHODS)
    _positive(src, "launch.nnodes", c.launch.nnodes)
    _positive(src, "launch.grace_period_s", c.launch.grace_period_s)
    _positive(src, "launch.startup_timeout_s", c.launch.startup_timeout_s)
    _positive(src, "launch.node_timeout_s", c.launch.node_timeout_s)
    for key in ("records_endpoint", "rdzv_endpoint"):  # host:port, checked before any torchrun reads it
        value = getattr(c.launch, key)
        if value:
            try:
                parse_endpoint(value)
            except ValueError as err:
                raise ConfigError(f"{src}: launch.{key} = {value!r}: {err}") from None
    if not 0 <= c.launch.node_rank < c.launch.nnodes:
        raise ConfigError(f"{src}: launch.node_rank = {c.launch.node_rank}: must be in 0..{c.launch.nnodes - 1}")
    names = [r.name for r in c.runs]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise ConfigError(f"{src}: runs: duplicate run name {sorted(dupes)[0]!r}; names must be unique")
    if c.baseline and c.baseline not in names:
        raise ConfigError(f"{src}: baseline = {c.baseline!r}: not a run; runs: {', '.join(names)}")
    baseline = c.baseline or names[0]
    runs, notes, errors = [], list(c.adjustments), []
    described = model_facts.is_described(c.model)
    for i, run in enumerate(c.runs):
        refusal = _refusal(c, run)
        if not refusal:
            try:
                runs.append(_validate_run(c, run, f"runs[{i}]", src, host))
                continue
            except LayoutRefusal as err:
                if not described:  # shardscope's own models: their limits are the preset's errors
                    errors.append(str(err))
                    continue
                refusal = err.reason
            except ConfigError as err:
                errors.append(str(err))
                continue
        # this strategy cannot run the user's model (or not at this layout): left out, with the reason; the others run
        if run.name == baseline:
            errors.append(f"{src}: runs.{run.name}: the baseline cannot run this model: {run.strategy}: {refusal}; "
                          "choose another baseline")
            continue
        notes.append(f"run {run.name} left out: {run.strategy}: {refusal}")
    if errors:  # every run's error at once, not only the first
        raise ConfigError(errors[0] if len(errors) == 1 else
                          f"{errors[0]} (and {len(errors) - 1} more: " + "; ".join(errors[1:]) + ")")
    return dataclasses.replace(c, runs=runs, baseline=baseline, adjustments=notes)


class LayoutRefusal(ConfigError):
    """A run that its strategy's layout checks refuse for this model (``reason``: the check's one line)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _refusal(c: Comparison, run: RunSpec) -> str:
    """Why the run's strategy cannot run the comparison's (described) model; "" when it can."""
    try:
        info = registry.get(run.strategy)
    except KeyError:
        return ""  # _validate_run names the unknown strategy
    return model_refusal(c, info)


def _validate_run(c: Comparison, run: RunSpec, where: str, src: str, host: HostInfo | None) -> RunSpec:
    """Check one run; return it with its option values normalised (a new RunSpec)."""
    _name(src, f"{where}.name", run.name)
    where = f"runs.{run.name}"
    try:
        info = registry.get(run.strategy)
    except KeyError as err:
        raise ConfigError(f"{src}: {where}.strategy = {run.strategy!r}: {err.args[0].split('; ')[1]}") from None
    if run.world_size < 0:
        raise ConfigError(f"{src}: {where}.world_size = {run.world_size}: must be >= 1")
    if not -1 <= run.probe_step < c.steps:
        raise ConfigError(f"{src}: {where}.probe_step = {run.probe_step}: must be -1 (off) or a step below {c.steps}")
    if run.precision:
        _one_of(src, f"{where}.precision", run.precision, PRECISIONS)
    options = dict(run.options)
    for key, value in run.options.items():
        spec = info.option(key)  # its own options and the loop's (registry.LOOP_OPTIONS)
        if spec is None:
            allowed = ", ".join(sorted(info.option_names())) or "(none)"
            raise ConfigError(f"{src}: {where}.options.{key}: unknown option of {run.strategy}; allowed: {allowed}")
        ok = isinstance(value, spec.type) and not (spec.type is int and isinstance(value, bool))
        if spec.type is float and isinstance(value, int) and not isinstance(value, bool):
            ok, options[key] = True, float(value)
        if not ok or (spec.choices is not None and value not in spec.choices) or (
            spec.minimum is not None and value < spec.minimum
        ):
            raise ConfigError(f"{src}: {where}.options.{key} = {value!r}: allowed: {spec.describe()}")
    run = dataclasses.replace(run, options=options)
    if run.fault:
        try:
            parse_fault(run.fault)
        except ValueError as err:
            raise ConfigError(f"{src}: {where}.fault = {run.fault!r}: {err}") from None
    ws = resolved_world_size(c, run)
    if ws < 1:
        raise ConfigError(f"{src}: {where}.world_size = {ws}: must be >= 1")
    if ws % c.launch.nnodes:
        raise ConfigError(f"{src}: {where}.world_size = {ws}: must be a multiple of launch.nnodes = {c.launch.nnodes}")
    if ws < info.min_world_size:
        raise ConfigError(f"{src}: {where}.world_size = {ws}: {run.strategy} needs at least {info.min_world_size} ranks")
    if c.model.kind not in info.models:
        raise ConfigError(f"{src}: model.kind = {c.model.kind!r}: {run.strategy} supports {', '.join(info.models)}")
    if host is not None:
        per_node = ws // c.launch.nnodes
        if per_node > host.max_ranks_per_node:
            raise ConfigError(
                f"{src}: {where}.world_size = {ws}: {per_node} ranks per node but this machine hosts at most "
                f"{host.max_ranks_per_node} ({host.detail})"
                + ("; launch.device = 'cpu' (`run --device cpu`) runs it on CPU cores with gloo"
                   if host.device == "cuda" else "")
            )
        if info.gpu_only and host.device != "cuda":
            raise ConfigError(f"{src}: {where}.strategy = {run.strategy!r}: needs a GPU; this machine has {host.detail}")
        if info.needs_deepspeed and not host.has_deepspeed:
            raise ConfigError(f"{src}: {where}.strategy = {run.strategy!r}: needs DeepSpeed (pip install deepspeed)")
        if host.device != "cuda" and resolved_precision(c, run) == "fp16" and info.needs_deepspeed and not host.cpu_fp16:
            # torch's CPU autocast runs fp16 anywhere; DeepSpeed's CPU accelerator refuses it without the ISA.
            raise ConfigError(
                f"{src}: {where}.precision = 'fp16': {run.strategy} runs fp16 on CPU only with AVX512-FP16 or "
                f"AMX-FP16, which this CPU lacks; use fp32 or bf16-params here, or a GPU"
            )
    tp, pp = info.tp_degree(resolved_options(run)), info.pp_degree(resolved_options(run))
    if ws % tp:
        raise ConfigError(f"{src}: {where}: world_size {ws} is not dp x tp with tp = {tp} (dp would be {ws / tp:g})")
    if ws % pp:
        raise ConfigError(f"{src}: {where}: world_size {ws} is not dp x pp with options.pp = {pp} (dp would be "
                          f"{ws / pp:g})")
    dp = ws // (tp * pp)
    accum = resolved_grad_accum(c, run)
    if c.global_batch % (dp * accum):
        own = " (its options.grad_accum)" if run.options.get("grad_accum") else ""
        raise ConfigError(
            f"{src}: global_batch = {c.global_batch}: must be divisible by dp ({dp}) x grad_accum ({accum}){own} "
            f"for run {run.name}"
        )
    for check in info.extra_checks:
        message = LAYOUT_CHECKS[check](c, run, tp, dp)
        if message:
            raise LayoutRefusal(f"{src}: {where}: {message}", message)
    if info.hybrid is not None:  # a hybrid size that does not divide dp fails here, not in every rank
        try:
            info.hybrid.groups(resolved_options(run), dp, ws // c.launch.nnodes)
        except ValueError as err:
            value = resolved_options(run).get(info.hybrid.option)
            raise ConfigError(f"{src}: {where}.options.{info.hybrid.option} = {value!r}: {err}") from None
    return run


def _check_heads_divisible(c: Comparison, run: RunSpec, tp: int, dp: int) -> str:
    """Tensor parallel splits attention heads (and KV heads) across tp ranks."""
    if c.model.kind == "transformer":
        if c.model.n_heads % tp or c.model.d_ff % tp:
            return f"tp = {tp} must divide model.n_heads = {c.model.n_heads} and model.d_ff = {c.model.d_ff}"
    if c.model.kind in ("hf", "module"):
        heads, kv_heads = model_facts.heads(c.model)
        if heads and (heads % tp or kv_heads % tp):
            name = c.model.hf_arch if c.model.kind == "hf" and not c.model.path else "the model"
            return f"tp = {tp} must divide {name}'s {heads} query heads and {kv_heads} key/value heads"
    return ""


# Named layout checks a registry entry can ask for (extra_checks); each returns "" or a message.
LAYOUT_CHECKS = {"heads_divisible_by_tp": _check_heads_divisible}


def _check_autotp_zero_stage(c: Comparison, run: RunSpec, tp: int, dp: int) -> str:
    """DeepSpeed AutoTP training combines with ZeRO stages 0-2 only (its AutoTP training tutorial)."""
    stage = resolved_options(run).get("stage", 0)
    if stage not in (0, 1, 2):
        sharded_tp = ", ".join(s.name for s in registry.STRATEGIES.values() if s.tp_option and s.shards == "all")
        return (f"options.stage = {stage}: DeepSpeed AutoTP (tp = {tp}, dp = {dp}) trains with ZeRO stage 0, 1 or 2; "
                f"for sharded parameters with tensor parallelism use {sharded_tp}")
    return ""


def _check_vit_heads_divisible(c: Comparison, run: RunSpec, tp: int, dp: int) -> str:
    """The ViT's attention and MLP are split like the built-in transformer's."""
    if c.model.kind == "vit" and (c.model.n_heads % tp or c.model.d_ff % tp):
        return f"tp = {tp} must divide model.n_heads = {c.model.n_heads} and model.d_ff = {c.model.d_ff}"
    return ""


LAYOUT_CHECKS["autotp_zero_stage"] = _check_autotp_zero_stage
LAYOUT_CHECKS["pipeline_split"] = pipeline_checks.check_pipeline
LAYOUT_CHECKS["vit_heads_divisible_by_tp"] = _check_vit_heads_divisible
