"""Finding and reading preset files: a built-in name or a user's path, read as UTF-8 TOML.

Every problem is a ``ConfigError`` of one line naming the file and what is wrong with it (missing,
a directory, unreadable, binary, not UTF-8, not TOML). Torch-free, like ``config``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

MAX_DEPTH = 8  # tables or arrays nested in a preset (the built-in ones use 3)
MAX_BYTES = 1 << 20  # a preset's size (the built-in ones: under 4 KiB); read no further

PRESET_DIR = Path(__file__).parent


class ConfigError(ValueError):
    """Bad preset or override. ``str(err)`` is one line fit for stderr."""


def builtin_names() -> list[str]:
    """Return the names of the built-in presets, sorted."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def looks_like_path(name_or_path: str) -> bool:
    """Return True when the argument names a file: it holds a path separator or ends in ``.toml``."""
    seps = [s for s in (os.sep, os.altsep, "/") if s]
    return name_or_path.endswith(".toml") or any(s in name_or_path for s in seps)


def preset_path(name_or_path: str) -> Path:
    """Return the file for a built-in preset name or a path; raises ConfigError.

    A path (see ``looks_like_path``) is always a file. A bare name is a file of that name (or with
    ``.toml``) when one exists in the current directory, else the built-in preset: a folder that
    happens to share a built-in's name (an earlier ``--out smoke``) never shadows it.
    """
    if not name_or_path.strip():
        raise ConfigError(f"--preset '': empty; built-in presets: {', '.join(builtin_names())} (or a path to a .toml "
                          "file)")
    if looks_like_path(name_or_path):
        return _existing_file(name_or_path)
    for candidate in (Path(name_or_path), Path(f"{name_or_path}.toml")):
        if candidate.is_file():
            return candidate
    builtin = PRESET_DIR / f"{name_or_path}.toml"
    if builtin.is_file():
        return builtin
    if Path(name_or_path).exists():
        return _existing_file(name_or_path)
    raise ConfigError(f"preset {name_or_path!r} not found; built-in presets: {', '.join(builtin_names())} "
                      f"(or a path to a .toml file)")


def _existing_file(name: str) -> Path:
    """Return ``name`` as a Path when it is a file; raise ConfigError naming it as the user wrote it."""
    path = Path(name)
    if path.is_dir():
        raise ConfigError(f"{name}: is a directory, not a preset file (give a .toml file or a built-in name: "
                          f"{', '.join(builtin_names())})")
    if not path.exists():
        raise ConfigError(f"{name}: no such preset file")
    return path


def read_preset(path: Path) -> dict[str, Any]:
    """Return the TOML table in ``path``; raises ConfigError when it cannot be read, is binary,
    is not UTF-8 or is not TOML."""
    src = str(path)
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError
        if not stat.S_ISREG(mode):  # a FIFO would block forever, /dev/zero would never end
            raise ConfigError(f"{src}: not a regular file (a pipe or a device); a preset is a UTF-8 TOML file")
        with open(path, "rb") as fh:
            data = fh.read(MAX_BYTES + 1)
    except IsADirectoryError:
        raise ConfigError(f"{src}: is a directory, not a preset file") from None
    except OSError as err:
        raise ConfigError(f"{src}: cannot read: {err.strerror or err}") from None
    if len(data) > MAX_BYTES:
        raise ConfigError(f"{src}: larger than {MAX_BYTES >> 10} KiB; a preset is a short TOML file")
    if b"\x00" in data:
        raise ConfigError(f"{src}: binary file (NUL bytes), not a TOML preset") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{src}: not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); "
                          f"a preset is a UTF-8 TOML file") from None
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{src}: not valid TOML: {err}") from None
    except RecursionError:
        raise ConfigError(f"{src}: nested deeper than {MAX_DEPTH} tables or arrays") from None
    deep = _too_deep(table, MAX_DEPTH)
    if deep:
        raise ConfigError(f"{src}: {deep}: nested deeper than {MAX_DEPTH} tables or arrays")
    return table


def _too_deep(value: Any, limit: int, where: str = "") -> str:
    """The key path of the first value nested more than ``limit`` tables or arrays deep ("" if none);
    iterative, so a hostile file cannot exhaust the stack here."""
    stack = [(value, where, 0)]
    while stack:
        item, path, depth = stack.pop()
        children = item.items() if isinstance(item, dict) else enumerate(item) if isinstance(item, list) else ()
        for key, child in children:
            if isinstance(child, (dict, list)):
                sub = f"{path}.{key}" if path else str(key)
                if depth + 1 > limit:
                    return sub
                stack.append((child, sub, depth + 1))
    return ""
