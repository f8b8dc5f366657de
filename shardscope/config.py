"""Presets (TOML) -> validated dataclasses.

A preset is a TOML file: shared settings at the top level, ``[model]``, ``[data]``,
``[profile]``, ``[launch]`` tables and one ``[[runs]]`` table per strategy variant. Built-ins
live in ``shardscope/presets/``; a user's file is opened by path. ``--set key=value`` overrides
use dotted keys (``steps=50``, ``model.n_layers=2``, ``runs.fsdp2.options.reshard_after_forward=false``).

Every error is a ``ConfigError`` whose message is one line naming the file, the key, the bad
value and what is allowed. This module never imports torch.

The schema lives in ``presets/schema.py``, overrides and the typed build in ``presets/overrides.py``,
validation in ``presets/checks.py``; this module loads a preset through them, writes the run spec the
ranks read, and re-exports the names the rest of shardscope uses (``config.X``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Callable

from shardscope.core import batch_follow
from shardscope.core import registry  # noqa: F401  (config.registry: the strategy table, for callers)
from shardscope.core.numbers import json_ready
from shardscope.presets.checks import (  # noqa: F401
    LAYOUT_CHECKS, HostInfo, cpu_has_fp16_isa, cpu_host, validate,
)
from shardscope.presets.inputs import check_inputs
from shardscope.presets.files import PRESET_DIR, ConfigError, preset_path, read_preset  # noqa: F401
from shardscope.presets.overrides import (  # noqa: F401
    _set_dotted, apply_override, build_comparison, list_presets, parse_override,
)
from shardscope.presets.schema import (  # noqa: F401
    CONTROL_STEPS, DATA_KINDS, DEVICES, FAULT_KINDS, HF_ARCHS, MAX_NAME, MODEL_KINDS, NAME_RE, ON_NONFINITE, PATH_KEYS,
    PRECISIONS, Comparison,
    DataSpec, LaunchSpec, ModelSpec, ProfileSpec, RunSpec, parse_fault, resolved_grad_accum, resolved_options,
    resolved_precision, resolved_world_size, with_control, control_runs,
)
from shardscope.core.rundir import PARTIAL_SUFFIX, RunDir


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
    _absolute_paths(raw, path.parent)  # relative to the preset file's folder...
    as_preset_set = dict(raw)
    for item in overrides:
        apply_override(raw, item, src)
    _absolute_paths(raw, Path.cwd())  # ...and those given with --set, to the current directory
    notes = batch_follow.follow_world_size(as_preset_set, raw, [parse_override(i)[0] for i in overrides])
    try:
        comparison = dataclasses.replace(build_comparison(raw, src), adjustments=notes)
        return validate(check_inputs(comparison), host=host)
    except ConfigError as err:
        raise ConfigError(_blame_override(str(err), src, overrides)) from None


def _absolute_paths(raw: dict[str, Any], base: Path) -> None:
    """Make the preset's file paths (``schema.PATH_KEYS`` and a ``model.entry`` file) absolute against ``base``, in
    place, so that every rank and every later command reads the same file whatever its working directory."""
    def absolute(text: str) -> str:
        expanded = os.path.expanduser(text)
        return expanded if os.path.isabs(expanded) else os.path.normpath(os.path.join(base, expanded))

    for table, key in PATH_KEYS:
        section = raw.get(table)
        if isinstance(section, dict) and isinstance(section.get(key), str) and section[key]:
            section[key] = absolute(section[key])
    model = raw.get("model")
    entry = model.get("entry") if isinstance(model, dict) else None
    if isinstance(entry, str) and looks_like_file_entry(entry):
        file, _, attr = entry.rpartition(":")
        model["entry"] = f"{absolute(file)}:{attr}"


def looks_like_file_entry(entry: str) -> bool:
    """True when a ``model.entry`` names a file (``./mymodel.py:build``), not a module (``pkg.mod:build``)."""
    file = entry.rpartition(":")[0]
    return file.endswith(".py") or "/" in file or file.startswith("~")


def cpu_overrides(name_or_path: str) -> dict[str, Any]:
    """The preset's ``[cpu_overrides]`` (dotted key -> value) that shrink it on a machine without a GPU; {} when
    it has none. Raises ConfigError when the preset does not load."""
    table = read_preset(preset_path(name_or_path)).get("cpu_overrides")
    return dict(table) if isinstance(table, dict) else {}


def _blame_override(message: str, src: str, overrides: list[str] | tuple[str, ...]) -> str:
    """Name ``--set key=value`` instead of the preset file when the bad value came from an override."""
    head = f"{src}: "
    if not message.startswith(head):
        return message
    rest = message[len(head):]
    unknown = re.match(r"unknown key '([^']+)'", rest)
    key = unknown.group(1) if unknown else re.split(r" = |: ", rest, maxsplit=1)[0]
    for item in reversed(overrides):  # the last --set of a key is the one that counts
        if item.partition("=")[0].strip() == key:
            reason = rest if unknown else re.split(r" = .*?: |: ", rest, maxsplit=1)[-1]
            return f"--set {item.strip()}: {reason}"
    return message


def run_spec_payload(c: Comparison, run: RunSpec, *, out_dir: str, device: str) -> dict[str, Any]:
    """Return the dict written to the run's spec file (``RunFiles.spec``) and read by every rank of the run."""
    resolved = dataclasses.asdict(run)
    resolved["world_size"] = resolved_world_size(c, run)
    resolved["precision"] = resolved_precision(c, run)
    resolved["options"] = resolved_options(run)
    info = registry.get(run.strategy)
    resolved["tp"] = info.tp_degree(resolved["options"])
    resolved["pp"] = info.pp_degree(resolved["options"])
    resolved["dp"] = resolved["world_size"] // (resolved["tp"] * resolved["pp"])
    comp = c.to_dict()
    comp.pop("runs")
    comp["grad_accum"] = resolved_grad_accum(c, run)  # the rank's loop and data read the run's own
    if run.steps:  # the A/A control: fewer steps on the baseline's lr schedule, the same losses step by step
        comp["steps"], comp["schedule_steps"] = run.steps, c.schedule_steps or c.steps
    if run.control_of:
        comp["profile"]["enabled"] = False
    out = RunDir(os.path.abspath(out_dir))
    return {
        "comparison": comp,
        "run": resolved,
        "out_dir": out.path,
        "run_dir": out.run(run.name).path,
        "init_path": out.init_weights,
        "device": device,
    }


def dump_json(path: str | os.PathLike[str], data: Any) -> None:
    """Write ``data`` as indented strict JSON (non-finite floats quoted), atomically (write then rename)."""
    write_atomic(path, lambda fh: (json.dump(json_ready(data), fh, indent=2, default=str), fh.write("\n")))


def write_atomic(path: str | os.PathLike[str], write: Callable[[Any], Any], *, binary: bool = False) -> None:
    """Call ``write(fh)`` on a new partial file beside ``path`` and rename it over ``path``; on any failure (a
    full disk, a bug) remove the partial file and re-raise, so ``path`` holds the old or the new content, whole.

    The partial file is created exclusively and never through a symlink, and the rename replaces a symlink at
    ``path`` instead of writing where it points: no write leaves the directory through a link."""
    tmp = f"{os.fspath(path)}.{os.getpid()}{PARTIAL_SUFFIX}"  # unique: several nodes may write the same file
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(tmp, flags, 0o644)
    except FileExistsError:  # left by a killed process that had this pid: it is ours to replace
        os.remove(tmp)
        fd = os.open(tmp, flags, 0o644)
    try:
        with (os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8")) as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
