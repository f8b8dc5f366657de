"""Small formatting helpers shared by the widgets (numbers, sizes, durations, paths, run colours)."""

from __future__ import annotations

import os

from shardscope.profiling.state import STATUS_STYLE  # noqa: F401  (one style per status, in state.py)
from shardscope.core.numbers import fmt_bytes as human_bytes  # noqa: F401  (one byte formatter for the project)

# One colour per run, in definition order: used by cards, chart lines and legends alike.
RUN_COLOURS = ("#4fc1ff", "#ffa94d", "#69db7c", "#f783ac", "#b197fc", "#ffd43b", "#63e6be", "#ff6b6b")


def run_colour(index: int) -> str:
    """Return the hex colour of the run at ``index`` (cycling after eight runs)."""
    return RUN_COLOURS[index % len(RUN_COLOURS)]


def rgb(hex_colour: str) -> tuple[int, int, int]:
    """Return ``#rrggbb`` as an (r, g, b) tuple (plotext's colour form)."""
    h = hex_colour.lstrip("#")
    return int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16)


def human_rate(x: float | None) -> str:
    """Return a throughput as ``12.3k``; ``–`` for None."""
    if x is None:
        return "–"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.1f}{suffix}"
    return f"{x:.1f}"


def human_duration(seconds: float | None) -> str:
    """Return seconds as ``1:05`` or ``1:02:03``; ``–`` for None."""
    if seconds is None:
        return "–"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def fmt_loss(x: float | None) -> str:
    """Return a loss with four decimals; ``–`` for None."""
    return "–" if x is None else f"{x:.4f}"


def fmt_float(x: float | None, spec: str = ".3g") -> str:
    """Return ``format(x, spec)``; ``–`` for None or a non-number."""
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else "–"


def display_path(path: str) -> str:
    """Return ``path`` relative to the current directory when inside it, else with ``~`` for home."""
    if not path:
        return ""
    absolute = os.path.abspath(path)
    cwd = os.getcwd()
    if absolute == cwd or absolute.startswith(cwd + os.sep):
        return os.path.relpath(absolute, cwd)
    home = os.path.expanduser("~")
    if absolute.startswith(home + os.sep):
        return "~" + absolute[len(home):]
    return absolute


def short_command(line: str) -> str:
    """The launch line a run's console.log opens with (``$ ENV=... python -m torch.distributed.run ...``),
    shortened for a narrow pane: ``$ torchrun`` and its arguments, without the environment additions and
    the interpreter's path (console.log keeps the whole line). Any other line comes back as it is."""
    if not line.startswith("$ "):
        return line
    words = line[2:].split(" ")
    while words and "=" in words[0] and not words[0].startswith("-"):
        words.pop(0)  # VAR=value
    if len(words) >= 3 and words[1:3] == ["-m", "torch.distributed.run"]:
        words = ["torchrun", *words[3:]]
    return "$ " + " ".join(words)
