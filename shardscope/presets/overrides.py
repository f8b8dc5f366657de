"""Preset tables -> schema: ``--set`` overrides on the raw TOML table and the typed build of a Comparison.

Checks keys and scalar types only; cross-field rules live in ``presets.checks``. Torch-free.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, get_type_hints

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from shardscope.presets.files import PRESET_DIR, ConfigError
from shardscope.presets.schema import (
    DATA_KEYS, MODEL_KEYS, Comparison, DataSpec, LaunchSpec, ModelSpec, ProfileSpec, RunSpec,
)

_INTERNAL = ("described", "from_run_dir")  # filled in by the checks and by a run directory's load, never by a preset
_RUN_INTERNAL = ("control_of", "steps")  # the A/A control's (schema.with_control), never a preset's
# Why a key another kind uses means nothing here, said after the list of keys the kind does use.
_KIND_HINTS = {
    "hf": "the config sets width, depth, heads and vocabulary (model.hf_layers keeps its first N layers)",
    "module": "your build function's own keys go in [model.args]",
}


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
    parts = {k: _build(cls, raw.get(k, {}), k, src, skip=_INTERNAL) for k, cls in nested.items()}
    _check_kind_keys(raw.get("model", {}), "model", parts["model"].kind, MODEL_KEYS, src)
    _check_kind_keys(raw.get("data", {}), "data", parts["data"].kind, DATA_KEYS, src)
    runs_raw = raw.get("runs", [])
    if not isinstance(runs_raw, list) or not runs_raw:
        raise ConfigError(f"{src}: runs: a preset needs at least one [[runs]] table with name and strategy")
    runs = [_build(RunSpec, r, f"runs[{i}]", src, skip=_RUN_INTERNAL) for i, r in enumerate(runs_raw)]
    top = {k: v for k, v in raw.items() if k not in nested and k != "runs"}
    top.pop("source", None)
    comparison = _build(Comparison, top, "", src, skip=(*nested, "runs", "source", "adjustments"))
    for k, v in parts.items():
        setattr(comparison, k, v)
    comparison.runs = runs
    comparison.source = src
    return comparison



def _check_kind_keys(table: dict[str, Any], where: str, kind: str, uses: dict[str, tuple[str, ...]], src: str) -> None:
    """Refuse a key of ``[model]`` or ``[data]`` that its kind does not use (it would be accepted and ignored); an
    unknown kind is left to validation, which names the allowed ones."""
    allowed = uses.get(kind)
    if allowed is None:
        return
    for key in table:
        if key not in allowed:
            hint = f"; {_KIND_HINTS[kind]}" if where == "model" and kind in _KIND_HINTS else ""
            raise ConfigError(f"{src}: {where}.{key}: not used by {where}.kind = {kind!r}; it uses: "
                              f"{', '.join(k for k in allowed if k != 'kind') or '(no other key)'}{hint}")
