"""Small formatting helpers shared by the widgets (numbers, sizes, durations, paths, run colours), and the two
ways text from outside reaches the screen as text (``literal`` inside markup, ``plain`` as a ``Text``).

Every figure formatter takes what a file gave: a string where a number belongs is shown as missing, never raised.
"""

from __future__ import annotations

import os
from typing import Any

from rich.markup import escape
from rich.text import Text

from shardscope.core.numbers import fmt_bytes as human_bytes  # noqa: F401  (one byte formatter for the project)
from shardscope.core.text import clean
from shardscope.profiling.state import STATUS_STYLE  # noqa: F401  (one style per status, in state.py)


def literal(value: Any) -> str:
    """``value`` as text to put inside markup (a Static's string, a border title, a toast): markup escaped and
    control characters spelled ``\\xNN``, so a run name, a path or an error message is shown, never obeyed."""
    return escape(clean(str(value)))


def plain(value: Any, style: str = "") -> Text:
    """``value`` as a ``Text`` (a table cell, a line of a pane): never parsed as markup, control characters spelled."""
    return Text(clean(str(value)), style)


def is_number(x: Any) -> bool:
    """True for an int or float (not a bool): what a figure read from a file must be before it is formatted."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def number(x: Any) -> Any:
    """``x`` when it is a number, else None (what the formatters show as missing): a file's ``"fast"`` for a figure."""
    return x if is_number(x) else None


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
    """Return a throughput as ``12.3k``; ``–`` for None or what is not a number."""
    if not is_number(x):
        return "–"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.1f}{suffix}"
    return f"{x:.1f}"


def human_duration(seconds: float | None) -> str:
    """Return seconds as ``1:05`` or ``1:02:03``; ``–`` for None or what is not a finite number."""
    if not is_number(seconds) or seconds != seconds or abs(seconds) == float("inf"):
        return "–"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def fmt_loss(x: float | None) -> str:
    """Return a loss with four decimals; ``–`` for None or what is not a number."""
    return f"{x:.4f}" if is_number(x) else "–"


def fmt_float(x: float | None, spec: str = ".3g") -> str:
    """Return ``format(x, spec)``; ``–`` for None or a non-number."""
    return format(x, spec) if is_number(x) else "–"


def display_path(path: str) -> str:
    """Return ``path`` relative to the current directory when inside it, else with ``~`` for home (as it is: a
    view puts it through ``literal`` or ``plain``)."""
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
