"""The preset schema: the dataclasses a preset (TOML) becomes, the allowed values, and the
resolved per-run settings (a run's own value or the comparison's).

Torch-free; ``shardscope.config`` loads, overrides and validates presets into these.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from shardscope.core import batch_follow
from shardscope.core import registry
from shardscope.core.hf_archs import ARCHS as HF_ARCH_VALUES

PRECISIONS = ("fp32", "bf16-autocast", "bf16-params", "fp16")
MODEL_KINDS = ("transformer", "hf", "vit", "module")
DATA_KINDS = ("synthetic", "text", "images", "tokens")
TOKEN_DTYPES = ("uint16", "uint32")  # data.dtype of a raw token file (kind = "tokens")
MODEL_INPUTS = ("tokens", "images")  # model.inputs of a user's module
DEVICES = ("auto", "cpu", "cuda")
START_METHODS = ("auto", "fork", "exec")  # launch.start_method: see LaunchSpec
FAULT_KINDS = ("raise", "exit", "hang", "skip", "slow", "oom", "memlimit", "oomkill", "nospace", "netdrop")
FAULT_LIMITS = {"rank": 1 << 20, "step": 10**9, "ms": 10**7, "code": 255}  # an exit code is one byte
ON_NONFINITE = ("stop", "continue")  # what a run does at its first non-finite loss or grad norm
HF_ARCHS = tuple(HF_ARCH_VALUES)  # hf_archs.ARCHS is the one table of architectures
# The [model] keys each kind uses; any other key a preset or --set gives is an error naming these.
MODEL_KEYS: dict[str, tuple[str, ...]] = {
    "transformer": ("kind", "vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "seq_len"),
    "hf": ("kind", "hf_arch", "path", "hf_layers", "blocks", "seq_len"),
    "vit": ("kind", "d_model", "n_layers", "n_heads", "d_ff", "image_size", "patch_size", "channels", "num_classes"),
    "module": ("kind", "entry", "blocks", "inputs", "args", "seq_len", "image_size", "channels", "num_classes"),
}
# The [data] keys each kind uses.
DATA_KEYS: dict[str, tuple[str, ...]] = {
    "synthetic": ("kind",),
    "text": ("kind", "path", "tokenizer"),
    "tokens": ("kind", "path", "dtype"),
    "images": ("kind",),
}
# Keys holding a file's path: a relative path in a preset file is relative to that file's folder, one given
# with --set to the current directory; both are made absolute when the preset loads.
PATH_KEYS = (("model", "path"), ("data", "path"), ("data", "tokenizer"))
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
MAX_NAME = 64  # characters of a comparison's or run's name (it names directories and files)


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
    hf_arch: str = "qwen2.5-0.5b"  # kind = "hf" without path: a built-in architecture (hf_archs)
    hf_layers: int = 0  # kind = "hf": the first N decoder layers; 0 = every layer of the config
    path: str = ""  # kind = "hf": a local model directory or its config.json (+ *.safetensors beside it: real weights)
    entry: str = ""  # kind = "module": "pkg.mod:build" or "./file.py:build", build(model_table, seed) -> nn.Module
    blocks: str = ""  # attribute path of the ModuleList of blocks; "" = found (module: the only ModuleList; hf: its layers)
    inputs: str = "tokens"  # kind = "module": what forward takes, "tokens" [b, s] or "images" [b, c, h, w]
    args: dict[str, Any] = field(default_factory=dict)  # kind = "module": the user's own keys, handed to build
    image_size: int = 32  # kind = "vit"
    patch_size: int = 4
    channels: int = 3
    num_classes: int = 10
    # What the model check found (core/model_check.py, from the real module on the meta device) for kinds whose
    # shapes shardscope cannot know by itself (hf with a path, module). Never set by a preset.
    described: dict[str, Any] = field(default_factory=dict)
    # The run directory this model was read from (analysis/fold.load_comparison sets it on every load, whatever the
    # file says): code it names runs only when the user names it again (presets/trust.py). Never set by a preset.
    from_run_dir: str = ""


@dataclass
class DataSpec:
    """Where tokens (or images) come from. The global batch at step s is a pure function of (seed, s)."""

    kind: str = "synthetic"
    path: str = ""  # kind = "text": a UTF-8 text file; kind = "tokens": a pre-tokenized file (.bin, llm.c shard, .npy)
    tokenizer: str = ""  # kind = "text": a tokenizer.json (the tokenizers library); "" = byte tokens
    dtype: str = ""  # kind = "tokens": uint16 or uint32 for a raw .bin ("" = uint16, nanoGPT's); others say their own
    # What the data check found (core/token_files.py): the file's format, dtype, token count, content hash. Never
    # set by a preset.
    described: dict[str, Any] = field(default_factory=dict)


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
    rdzv_endpoint: str = ""  # host:port for multi-node; empty = 127.0.0.1:0 (kernel-picked)
    rdzv_id: str = ""  # prefix of each run's rendezvous id; unique per job (sbatch: from SLURM_JOB_ID)
    node_timeout_s: float = 30.0  # several nodes: a node silent this long is lost (its runs fail)
    # host:port where node 0 receives other nodes' records over TCP; empty = a shared filesystem (the default)
    records_endpoint: str = ""
    records_bind: str = ""  # node 0: the address its record server binds when not the endpoint's host (0.0.0.0)
    concurrent: bool = False
    # start the next run's torchrun agent (its import of torch) before its run is due; orchestrator/prestart.py
    prestart: bool = True
    # how torchrun starts ranks: "fork" them from its agent after it preloaded torch (engines/rank.py), "exec" a
    # new interpreter each, "auto" = fork, except DeepSpeed runs on CUDA (orchestrator/prestart.fork_ranks)
    start_method: str = "auto"
    grace_period_s: float = 5.0
    startup_timeout_s: float = 300.0  # until a run's first record (imports, rendezvous); then stall_timeout_s
    # refuse, before the start, a comparison whose ranks on this host need more memory than it has available
    # (orchestrator/preflight.check_memory); false: a user who knows better
    check_memory: bool = True


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
    # shardscope why's re-runs: record every module's output and gradients on the steps up to this one (-1 = off)
    probe_step: int = -1
    # Set by ``with_control``, never by a preset: the run this one repeats as the A/A control (between-run noise),
    # and its own number of steps (0 = the comparison's)
    control_of: str = ""
    steps: int = 0


@dataclass
class Comparison:
    """Shared settings plus the runs to compare. Built by ``load_preset``."""

    name: str
    description: str = ""
    source: str = ""  # the preset file this came from
    steps: int = 30
    schedule_steps: int = 0  # the lr schedule's length; 0 = steps (shardscope why: short re-runs, the original's lr)
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
    # An A/A control: the baseline run again, last, for CONTROL_STEPS steps, so that every verdict on throughput is
    # held against how much a run moves when nothing about it changes, on this machine, now (``with_control``)
    control: bool = True
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

    def shown(self) -> dict[str, Any]:
        """The settings as a user reads them (``--dry-run``): ``[model]`` and ``[data]`` hold only the keys their
        kind uses, and what the model and data checks found is summed up instead of listed tensor by tensor."""
        out = self.to_dict()
        for table, uses in (("model", MODEL_KEYS), ("data", DATA_KEYS)):
            section = out[table]
            found = section.pop("described", None)
            kept = {k: v for k, v in section.items() if k in uses.get(section["kind"], tuple(section))}
            if table == "model" and section["kind"] == "hf":
                kept.pop("hf_arch" if section.get("path") else "path", None)
            if found:
                kept["checked"] = {k: v for k, v in found.items() if k not in ("params", "import_root")}
            out[table] = kept
        return out

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "Comparison":
        """Rebuild a Comparison written by ``to_dict`` (no validation)."""
        data = _known(Comparison, data)
        data["model"] = ModelSpec(**_known(ModelSpec, data.get("model", {})))
        data["data"] = DataSpec(**_known(DataSpec, data.get("data", {})))
        data["profile"] = ProfileSpec(**_known(ProfileSpec, data.get("profile", {})))
        data["launch"] = LaunchSpec(**_known(LaunchSpec, data.get("launch", {})))
        data["runs"] = [RunSpec(**_known(RunSpec, r)) for r in data.get("runs", [])]
        return Comparison(**data)


def _known(cls: type, table: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``table`` that ``cls`` has as fields: a key a newer or older shardscope wrote is left out (a run
    directory written before ``model.weights_dir`` became ``model.path`` still reads)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in dict(table).items() if k in names}



CONTROL_STEPS = 10  # the A/A control's steps: 9 timed ones after the warm-up step
CONTROL_MIN_STEPS = 5  # below this a comparison has too few timed steps for a throughput verdict: no control


def control_name(baseline: str, taken: list[str]) -> str:
    """The A/A control's run name: ``<baseline>.again`` (a name the comparison does not use, within MAX_NAME)."""
    stem = f"{baseline[:MAX_NAME - 8]}.again"
    name, k = stem, 2
    while name in taken:
        name, k = f"{stem}{k}", k + 1
    return name


def with_control(c: Comparison) -> Comparison:
    """``c`` with its A/A control appended: the baseline run again, last, for ``CONTROL_STEPS`` steps on the same lr
    schedule (so its losses equal the baseline's at every common step) with the profiler off. Unchanged when
    ``c.control`` is off, with one run, with fewer than ``CONTROL_MIN_STEPS`` steps, or when it has a control."""
    runs = [r for r in c.runs if not r.control_of]
    if not c.control or len(runs) < 2 or c.steps < CONTROL_MIN_STEPS or len(runs) < len(c.runs):
        return c
    base = next((r for r in runs if r.name == c.baseline), runs[0])
    control = dataclasses.replace(base, name=control_name(base.name, [r.name for r in c.runs]), control_of=base.name,
                                  steps=min(c.steps, CONTROL_STEPS), fault="", probe_step=-1)
    return dataclasses.replace(c, runs=[*c.runs, control])


def control_runs(c: Comparison) -> list[RunSpec]:
    """The A/A control runs of ``c`` (``with_control``)."""
    return [r for r in c.runs if r.control_of]


def resolved_world_size(comparison: Comparison, run: RunSpec) -> int:
    """Return the run's total world size (its own, or the comparison's)."""
    return run.world_size or comparison.world_size


def resolved_precision(comparison: Comparison, run: RunSpec) -> str:
    """Return the run's precision policy (its own, or the comparison's)."""
    return run.precision or comparison.precision


def resolved_grad_accum(comparison: Comparison, run: RunSpec) -> int:
    """Return the run's micro-batches per optimizer step: its ``options.grad_accum``, or the comparison's."""
    return int(run.options.get("grad_accum") or comparison.grad_accum)


def resolved_options(run: RunSpec) -> dict[str, Any]:
    """Return the run's strategy options with registry defaults filled in."""
    return {**registry.option_defaults(run.strategy), **run.options}


def parse_fault(text: str) -> dict[str, Any]:
    """Parse ``rank=1,step=3,kind=raise`` into a dict; raises ValueError on a bad spec."""
    out: dict[str, Any] = {"rank": 0, "step": 0, "kind": "raise"}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, val = part.partition("=")
        if key in ("rank", "step", "ms", "code"):
            if not val.isdigit():
                raise ValueError(f"{key} must be a non-negative integer, got {val!r}")
            top = FAULT_LIMITS[key]
            if int(val) > top:
                raise ValueError(f"{key} = {val}: at most {top:,}")
            out[key] = int(val)
        elif key == "kind":
            if val not in FAULT_KINDS:
                raise ValueError(f"kind must be one of {', '.join(FAULT_KINDS)}, got {val!r}")
            out[key] = val
        else:
            raise ValueError(f"unknown fault key {key!r}; allowed: rank, step, kind, ms (kind=slow), code (kind=exit)")
    return out

