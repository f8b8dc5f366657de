"""Presets (TOML) -> validated dataclasses.

A preset is a TOML file: shared settings at the top level, ``[model]``, ``[data]``,
``[profile]``, ``[launch]`` tables and one ``[[runs]]`` table per strategy variant. Built-ins
live in ``shardscope/presets/``; a user's file is opened by path. ``--set key=value`` overrides
use dotted keys (``steps=50``, ``model.n_layers=2``, ``runs.fsdp2.options.reshard_after_forward=false``).

Every error is a ``ConfigError`` whose message is one line naming the file, the key, the bad
value and what is allowed. This module never imports torch.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from shardscope import batch_follow
from shardscope import registry
from shardscope.hf_archs import ARCHS as HF_ARCH_VALUES
from shardscope.numbers import json_ready
from shardscope.presets.files import PRESET_DIR, ConfigError, preset_path, read_preset  # noqa: F401

PRECISIONS = ("fp32", "bf16-autocast", "bf16-params", "fp16")
MODEL_KINDS = ("transformer", "hf", "vit")
DATA_KINDS = ("synthetic", "text", "images")
DEVICES = ("auto", "cpu", "cuda")
FAULT_KINDS = ("raise", "exit", "hang", "slow", "oom", "memlimit", "oomkill", "nospace")
ON_NONFINITE = ("stop", "continue")  # what a run does at its first non-finite loss or grad norm
HF_ARCHS = tuple(HF_ARCH_VALUES)  # hf_archs.ARCHS is the one table of architectures
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass
class ModelSpec:
    """The model every run trains."""

    kind: str = "transformer"
    vocab_size: int = 32000
    d_model: int = 768
    n_layers: int = 6
    n_heads: int = 12
    d_ff: int = 3072
    seq_len: int = 256
    hf_arch: str = "qwen2.5-0.5b"  # kind = "hf": built-in architecture values
    hf_layers: int = 2  # kind = "hf": number of decoder layers kept
    weights_dir: str = ""  # kind = "hf": local directory with real weights (never downloaded)
    image_size: int = 32  # kind = "vit"
    patch_size: int = 4
    channels: int = 3
    num_classes: int = 10


@dataclass
class DataSpec:
    """Where tokens (or images) come from. The global batch at step s is a pure function of (seed, s)."""

    kind: str = "synthetic"
    path: str = ""  # kind = "text": a UTF-8 text file, byte-level tokens


@dataclass
class ProfileSpec:
    """The torch.profiler window recorded in each run."""

    enabled: bool = True
    start_step: int = 5
    steps: int = 2
    record_shapes: bool = True  # needed for collective sizes on gloo
    profile_memory: bool = False  # allocation events in the trace (bigger traces)
    count_collectives: bool = False  # in-rank byte count of every collective in the window (a `comm` record)


@dataclass
class LaunchSpec:
    """How runs are started: device, nodes, order."""

    device: str = "auto"
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""  # host:port for multi-node; empty = a free local port
    rdzv_id: str = ""  # prefix of each run's rendezvous id; unique per job (sbatch: from SLURM_JOB_ID)
    node_timeout_s: float = 30.0  # several nodes: a node silent this long is lost (its runs fail)
    concurrent: bool = False
    grace_period_s: float = 5.0
    startup_timeout_s: float = 300.0  # until a run's first record (imports, rendezvous); then stall_timeout_s


@dataclass
class RunSpec:
    """One strategy variant in a comparison."""

    name: str
    strategy: str
    world_size: int = 0  # 0 = the comparison's world_size
    precision: str = ""  # "" = the comparison's precision
    activation_checkpointing: bool = False
    compile: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    fault: str = ""  # "rank=1,step=3,kind=raise|exit|hang" or "rank=1,step=3,kind=slow,ms=50" (tests)


@dataclass
class Comparison:
    """Shared settings plus the runs to compare. Built by ``load_preset``."""

    name: str
    description: str = ""
    source: str = ""  # the preset file this came from
    steps: int = 30
    global_batch: int = batch_follow.DEFAULT_GLOBAL_BATCH  # sequences (or images) per optimizer step, over all data-parallel ranks
    grad_accum: int = 1  # micro-batches per optimizer step on each rank
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 5
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 = no clipping
    seed: int = 1234
    precision: str = "fp32"
    world_size: int = batch_follow.DEFAULT_WORLD_SIZE
    baseline: str = ""  # a run name; "" = the first run
    stall_timeout_s: float = 120.0
    parity: bool = False  # record per-layer norms for the divergence locator
    log_every: int = 1
    loss_tolerance: float = 1e-5  # |loss - baseline loss| allowed, for checks and the locator
    on_nonfinite: str = "stop"  # a non-finite loss or grad norm marks the run diverged; "continue" trains on
    straggler_threshold: float = 1.5  # a rank busy this many times its peers' median ...
    straggler_window: int = 5  # ... for this many steps in a row is named a straggler
    size_profile: str = "full"  # "cpu" when the preset's cpu_overrides were applied (no GPU found)
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    profile: ProfileSpec = field(default_factory=ProfileSpec)
    launch: LaunchSpec = field(default_factory=LaunchSpec)
    runs: list[RunSpec] = field(default_factory=list)
    adjustments: list[str] = field(default_factory=list)  # what load_preset changed for the user, one line each

    def run(self, name: str) -> RunSpec:
        """Return the run called ``name``; raises KeyError."""
        for r in self.runs:
            if r.name == name:
                return r
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict (``from_dict`` reverses it)."""
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "Comparison":
        """Rebuild a Comparison written by ``to_dict`` (no validation)."""
        data = dict(data)
        data["model"] = ModelSpec(**data.get("model", {}))
        data["data"] = DataSpec(**data.get("data", {}))
        data["profile"] = ProfileSpec(**data.get("profile", {}))
        data["launch"] = LaunchSpec(**data.get("launch", {}))
        data["runs"] = [RunSpec(**r) for r in data.get("runs", [])]
        return Comparison(**data)


# ---------------------------------------------------------------------------------------------
# Loading


def list_presets() -> list[tuple[str, str]]:
    """Return (name, description) of every built-in preset, sorted by name."""
    out = []
    for path in sorted(PRESET_DIR.glob("*.toml")):
        try:
            with open(path, "rb") as fh:
                desc = str(tomllib.load(fh).get("description", ""))
        except (OSError, tomllib.TOMLDecodeError):
            desc = "(unreadable)"
        out.append((path.stem, desc.strip().splitlines()[0] if desc.strip() else ""))
    return out


def load_preset(
    name_or_path: str,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    host: "HostInfo | None" = None,
) -> Comparison:
    """Load, override and validate a preset; return the Comparison.

    ``host`` describes the machine (device kind and how many ranks it can host); without it,
    host-dependent checks are skipped. Raises ConfigError with a one-line message.
    """
    path = preset_path(name_or_path)
    src = str(path)
    raw = read_preset(path)
    raw.setdefault("name", path.stem)
    cpu_sizes = raw.pop("cpu_overrides", None)
    if cpu_sizes is not None:
        if not isinstance(cpu_sizes, dict):
            raise ConfigError(f"{src}: cpu_overrides must be a table of dotted keys, e.g. \"model.d_model\" = 256")
        if host is not None and host.device == "cpu":
            # Without a GPU the preset shrinks to sizes that finish in minutes; the user's --set still wins.
            for key, value in cpu_sizes.items():
                _set_dotted(raw, key, value, src)
            raw["size_profile"] = "cpu"
    as_preset_set = dict(raw)
    for item in overrides:
        apply_override(raw, item, src)
    notes = batch_follow.follow_world_size(as_preset_set, raw, [parse_override(i)[0] for i in overrides])
    comparison = build_comparison(raw, src)
    comparison.adjustments = notes
    validate(comparison, host=host)
    return comparison


def parse_override(item: str) -> tuple[list[str], Any]:
    """Split ``key=value`` into (dotted key parts, TOML-typed value); raises ConfigError."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value, for example steps=50")
    key, _, text = item.partition("=")
    key = key.strip()
    if not key:
        raise ConfigError(f"--set {item!r}: empty key")
    try:
        value = tomllib.loads(f"x = {text.strip()}")["x"]
    except tomllib.TOMLDecodeError:
        value = text.strip()  # bare words are strings: precision=bf16-autocast
    return key.split("."), value


def apply_override(raw: dict[str, Any], item: str, src: str) -> None:
    """Apply one ``--set key=value`` to the raw preset table in place; raises ConfigError."""
    parts, value = parse_override(item)
    _set_dotted(raw, ".".join(parts), value, src, where=f"--set {'.'.join(parts)}")


def _set_dotted(raw: dict[str, Any], key: str, value: Any, src: str, where: str = "") -> None:
    """Set a dotted key (``runs.<name>.…`` addresses a run by name) in the raw preset table."""
    parts = key.split(".")
    where = where or f"{src}: cpu_overrides.{key}"
    if parts[0] == "runs":
        if len(parts) < 3:
            raise ConfigError(f"{where}: use runs.<run name>.<key>=value")
        runs = raw.get("runs", [])
        match = [r for r in runs if isinstance(r, dict) and r.get("name") == parts[1]]
        if not match:
            names = ", ".join(str(r.get("name")) for r in runs if isinstance(r, dict))
            raise ConfigError(f"{where}: no run named {parts[1]!r} in {src}; runs: {names}")
        target: dict[str, Any] = match[0]
        parts = parts[2:]
    else:
        target = raw
    for part in parts[:-1]:
        nxt = target.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{where}: {part!r} is not a table")
        target = nxt
    target[parts[-1]] = value


def _build(cls: type, table: Any, where: str, src: str, skip: tuple[str, ...] = ()) -> Any:
    """Build dataclass ``cls`` from a TOML table, checking keys and scalar types."""
    if not isinstance(table, dict):
        raise ConfigError(f"{src}: {where} must be a table, got {table!r}")
    hints = get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)} - set(skip)
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        full = f"{where}.{key}" if where else key
        if key not in fields:
            raise ConfigError(f"{src}: unknown key {full!r}; allowed: {', '.join(sorted(fields))}")
        kwargs[key] = _check_type(value, hints[key], full, src)
    try:
        return cls(**kwargs)
    except TypeError as err:  # a required field is missing
        missing = re.findall(r"'(\w+)'", str(err))
        raise ConfigError(f"{src}: {where or 'preset'} is missing required key {', '.join(missing)!s}") from None


def _check_type(value: Any, hint: Any, key: str, src: str) -> Any:
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{src}: {key} = {value!r}: expected true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{src}: {key} = {value!r}: expected an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{src}: {key} = {value!r}: expected a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{src}: {key} = {value!r}: expected a string")
        return value
    if getattr(hint, "__origin__", None) is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{src}: {key} = {value!r}: expected a table")
        return dict(value)
    return value


def build_comparison(raw: dict[str, Any], src: str) -> Comparison:
    """Turn a raw TOML table into a Comparison, checking keys and types (not cross-field rules)."""
    nested = {"model": ModelSpec, "data": DataSpec, "profile": ProfileSpec, "launch": LaunchSpec}
    parts = {k: _build(cls, raw.get(k, {}), k, src) for k, cls in nested.items()}
    runs_raw = raw.get("runs", [])
    if not isinstance(runs_raw, list) or not runs_raw:
        raise ConfigError(f"{src}: runs: a preset needs at least one [[runs]] table with name and strategy")
    runs = [_build(RunSpec, r, f"runs[{i}]", src) for i, r in enumerate(runs_raw)]
    top = {k: v for k, v in raw.items() if k not in nested and k != "runs"}
    top.pop("source", None)
    comparison = _build(Comparison, top, "", src, skip=(*nested, "runs", "source", "adjustments"))
    for k, v in parts.items():
        setattr(comparison, k, v)
    comparison.runs = runs
    comparison.source = src
    return comparison


# ---------------------------------------------------------------------------------------------
# Validation


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


def resolved_world_size(comparison: Comparison, run: RunSpec) -> int:
    """Return the run's total world size (its own, or the comparison's)."""
    return run.world_size or comparison.world_size


def resolved_precision(comparison: Comparison, run: RunSpec) -> str:
    """Return the run's precision policy (its own, or the comparison's)."""
    return run.precision or comparison.precision


def resolved_options(run: RunSpec) -> dict[str, Any]:
    """Return the run's strategy options with registry defaults filled in."""
    info = registry.get(run.strategy)
    opts = {k: spec.default for k, spec in info.options.items()}
    opts.update(run.options)
    return opts


def parse_fault(text: str) -> dict[str, Any]:
    """Parse ``rank=1,step=3,kind=raise`` into a dict; raises ValueError on a bad spec."""
    out: dict[str, Any] = {"rank": 0, "step": 0, "kind": "raise"}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, val = part.partition("=")
        if key in ("rank", "step", "ms"):
            if not val.isdigit():
                raise ValueError(f"{key} must be a non-negative integer, got {val!r}")
            out[key] = int(val)
        elif key == "kind":
            if val not in FAULT_KINDS:
                raise ValueError(f"kind must be one of {', '.join(FAULT_KINDS)}, got {val!r}")
            out[key] = val
        else:
            raise ValueError(f"unknown fault key {key!r}; allowed: rank, step, kind, ms (kind=slow)")
    return out


def _positive(src: str, key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{src}: {key} = {value!r}: must be {'>= 0' if allow_zero else '> 0'}")


def _one_of(src: str, key: str, value: Any, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{src}: {key} = {value!r}: allowed: {', '.join(map(str, allowed))}")


def validate(c: Comparison, *, host: HostInfo | None = None) -> None:
    """Check cross-field rules and the layout of every run; raises ConfigError (one line)."""
    src = c.source or "preset"
    if not NAME_RE.match(c.name):
        raise ConfigError(f"{src}: name = {c.name!r}: use letters, digits, '.', '_' or '-'")
    for key in ("steps", "global_batch", "grad_accum", "world_size", "log_every", "straggler_window"):
        _positive(src, key, getattr(c, key))
    for key in ("lr", "stall_timeout_s", "straggler_threshold"):
        _positive(src, key, getattr(c, key))
    for key in ("warmup_steps", "weight_decay", "grad_clip", "min_lr_ratio", "seed", "loss_tolerance"):
        _positive(src, key, getattr(c, key), allow_zero=True)
    _one_of(src, "precision", c.precision, PRECISIONS)
    _one_of(src, "on_nonfinite", c.on_nonfinite, ON_NONFINITE)
    m = c.model
    _one_of(src, "model.kind", m.kind, MODEL_KINDS)
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "seq_len", "hf_layers",
                "image_size", "patch_size", "channels", "num_classes"):
        _positive(src, f"model.{key}", getattr(m, key))
    if m.kind == "transformer" and m.d_model % m.n_heads:
        raise ConfigError(f"{src}: model.n_heads = {m.n_heads}: must divide model.d_model = {m.d_model}")
    if m.kind == "hf":
        _one_of(src, "model.hf_arch", m.hf_arch, HF_ARCHS)
        arch_vocab = HF_ARCH_VALUES[m.hf_arch]["vocab_size"]
        if c.data.kind == "synthetic" and m.vocab_size > arch_vocab:  # synthetic tokens are drawn below model.vocab_size
            raise ConfigError(f"{src}: model.vocab_size = {m.vocab_size}: must be <= {m.hf_arch}'s vocabulary ({arch_vocab})")
        if m.weights_dir and not Path(m.weights_dir).is_dir():
            raise ConfigError(f"{src}: model.weights_dir = {m.weights_dir!r}: no such directory")
    if m.kind == "vit" and m.image_size % m.patch_size:
        raise ConfigError(f"{src}: model.patch_size = {m.patch_size}: must divide model.image_size = {m.image_size}")
    _one_of(src, "data.kind", c.data.kind, DATA_KINDS)
    if c.data.kind == "text" and not Path(c.data.path).is_file():
        raise ConfigError(f"{src}: data.path = {c.data.path!r}: no such text file")
    if (c.data.kind == "images") != (m.kind == "vit"):
        raise ConfigError(f"{src}: data.kind = {c.data.kind!r}: model.kind {m.kind!r} needs "
                          f"{'images' if m.kind == 'vit' else 'synthetic or text'}")
    _positive(src, "profile.steps", c.profile.steps, allow_zero=True)
    _positive(src, "profile.start_step", c.profile.start_step, allow_zero=True)
    _one_of(src, "launch.device", c.launch.device, DEVICES)
    _positive(src, "launch.nnodes", c.launch.nnodes)
    _positive(src, "launch.grace_period_s", c.launch.grace_period_s)
    _positive(src, "launch.startup_timeout_s", c.launch.startup_timeout_s)
    _positive(src, "launch.node_timeout_s", c.launch.node_timeout_s)
    if not 0 <= c.launch.node_rank < c.launch.nnodes:
        raise ConfigError(f"{src}: launch.node_rank = {c.launch.node_rank}: must be in 0..{c.launch.nnodes - 1}")
    names = [r.name for r in c.runs]
    for i, run in enumerate(c.runs):
        _validate_run(c, run, f"runs[{i}]", src, host)
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise ConfigError(f"{src}: runs: duplicate run name {sorted(dupes)[0]!r}; names must be unique")
    if c.baseline and c.baseline not in names:
        raise ConfigError(f"{src}: baseline = {c.baseline!r}: not a run; runs: {', '.join(names)}")
    if not c.baseline:
        c.baseline = names[0]


def _validate_run(c: Comparison, run: RunSpec, where: str, src: str, host: HostInfo | None) -> None:
    if not NAME_RE.match(run.name):
        raise ConfigError(f"{src}: {where}.name = {run.name!r}: use letters, digits, '.', '_' or '-'")
    where = f"runs.{run.name}"
    try:
        info = registry.get(run.strategy)
    except KeyError as err:
        raise ConfigError(f"{src}: {where}.strategy = {run.strategy!r}: {err.args[0].split('; ')[1]}") from None
    if run.world_size < 0:
        raise ConfigError(f"{src}: {where}.world_size = {run.world_size}: must be >= 1")
    if run.precision:
        _one_of(src, f"{where}.precision", run.precision, PRECISIONS)
    for key, value in run.options.items():
        spec = info.options.get(key)
        if spec is None:
            allowed = ", ".join(sorted(info.options)) or "(none)"
            raise ConfigError(f"{src}: {where}.options.{key}: unknown option of {run.strategy}; allowed: {allowed}")
        ok = isinstance(value, spec.type) and not (spec.type is int and isinstance(value, bool))
        if spec.type is float and isinstance(value, int) and not isinstance(value, bool):
            ok, run.options[key] = True, float(value)
        if not ok or (spec.choices is not None and value not in spec.choices) or (
            spec.minimum is not None and value < spec.minimum
        ):
            raise ConfigError(f"{src}: {where}.options.{key} = {value!r}: allowed: {spec.describe()}")
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
    tp = info.tp_degree(resolved_options(run))
    if ws % tp:
        raise ConfigError(f"{src}: {where}: world_size {ws} is not dp x tp with tp = {tp} (dp would be {ws / tp:g})")
    dp = ws // tp
    if c.global_batch % (dp * c.grad_accum):
        raise ConfigError(
            f"{src}: global_batch = {c.global_batch}: must be divisible by dp ({dp}) x grad_accum ({c.grad_accum}) "
            f"for run {run.name}"
        )
    for check in info.extra_checks:
        message = LAYOUT_CHECKS[check](c, run, tp, dp)
        if message:
            raise ConfigError(f"{src}: {where}: {message}")


def _check_heads_divisible(c: Comparison, run: RunSpec, tp: int, dp: int) -> str:
    """Tensor parallel splits attention heads (and KV heads) across tp ranks."""
    if c.model.kind == "transformer":
        if c.model.n_heads % tp or c.model.d_ff % tp:
            return f"tp = {tp} must divide model.n_heads = {c.model.n_heads} and model.d_ff = {c.model.d_ff}"
    if c.model.kind == "hf":
        from shardscope.hf_archs import ARCHS  # torch-free table

        arch = ARCHS[c.model.hf_arch]
        if arch["num_attention_heads"] % tp or arch["num_key_value_heads"] % tp:
            return (f"tp = {tp} must divide {c.model.hf_arch}'s {arch['num_attention_heads']} query heads and "
                    f"{arch['num_key_value_heads']} key/value heads")
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
LAYOUT_CHECKS["vit_heads_divisible_by_tp"] = _check_vit_heads_divisible


# ---------------------------------------------------------------------------------------------
# Run specs handed to ranks


def run_spec_payload(c: Comparison, run: RunSpec, *, out_dir: str, device: str) -> dict[str, Any]:
    """Return the dict written to ``<out>/<run>/spec.json`` and read by every rank of the run."""
    resolved = dataclasses.asdict(run)
    resolved["world_size"] = resolved_world_size(c, run)
    resolved["precision"] = resolved_precision(c, run)
    resolved["options"] = resolved_options(run)
    info = registry.get(run.strategy)
    resolved["tp"] = info.tp_degree(resolved["options"])
    resolved["dp"] = resolved["world_size"] // resolved["tp"]
    comp = c.to_dict()
    comp.pop("runs")
    return {
        "comparison": comp,
        "run": resolved,
        "out_dir": os.path.abspath(out_dir),
        "run_dir": os.path.abspath(os.path.join(out_dir, run.name)),
        "init_path": os.path.abspath(os.path.join(out_dir, "init.safetensors")),
        "device": device,
    }


def dump_json(path: str | os.PathLike[str], data: Any) -> None:
    """Write ``data`` as indented strict JSON (non-finite floats quoted), atomically (write then rename)."""
    tmp = f"{os.fspath(path)}.{os.getpid()}.tmp"  # unique: several nodes may write the same file
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(json_ready(data), fh, indent=2, default=str)
        fh.write("\n")
    os.replace(tmp, path)
