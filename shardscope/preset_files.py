"""Which file a ``--preset`` names, and reading it as TOML text, with one-line errors.

A value with a path separator or a ``.toml`` suffix is a path. A bare name is a file of that name
(or with ``.toml``) in the working directory when one exists, else the built-in preset of that name:
a *folder* called ``smoke`` (an earlier ``--out smoke``) never shadows the built-in ``smoke``.
Reading refuses, in one line naming the file, a directory, an unreadable file, binary bytes and text
that is not UTF-8. No torch, no textual.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


class PresetFileError(ValueError):
    """A preset that cannot be found or read; the message is one line naming the file."""


def is_path(name_or_path: str) -> bool:
    """True when ``name_or_path`` is meant as a path (a separator or a ``.toml`` suffix), not a name."""
    seps = {os.sep, "/"} | ({os.altsep} if os.altsep else set())
    return any(s in name_or_path for s in seps) or Path(name_or_path).suffix == ".toml"


def resolve(name_or_path: str, builtin_dir: Path, builtin_names: list[str]) -> Path:
    """Return the preset file meant by ``name_or_path``; raises PresetFileError when there is none."""
    candidate = Path(name_or_path)
    if is_path(name_or_path):
        if candidate.is_dir():
            raise PresetFileError(f"{name_or_path}: is a directory, not a preset file")
        if not candidate.exists():
            raise PresetFileError(f"{name_or_path}: no such preset file")
        return candidate
    for local in (candidate, Path(f"{name_or_path}.toml")):  # a user's file of that name wins
        if local.is_file():
            return local
    builtin = builtin_dir / f"{name_or_path}.toml"
    if builtin.is_file():
        return builtin
    raise PresetFileError(f"preset {name_or_path!r} not found; built-in presets: {', '.join(builtin_names)} "
                          "(or a path to a .toml file)")


def read_toml(path: Path) -> dict[str, Any]:
    """Return the TOML table in ``path``; raises PresetFileError for a directory, an unreadable file,
    binary or non-UTF-8 bytes, or invalid TOML (one line, naming the file and the problem)."""
    src = str(path)
    if path.is_dir():
        raise PresetFileError(f"{src}: is a directory, not a preset file")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise PresetFileError(f"{src}: cannot read: {err.strerror or err}") from None
    nul = data.find(b"\0")
    if nul >= 0:
        raise PresetFileError(f"{src}: binary data (a NUL byte at offset {nul}), not a TOML text file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PresetFileError(f"{src}: not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); "
                              "presets are TOML files in UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise PresetFileError(f"{src}: not valid TOML: {err}") from None
