"""Text from outside shown as text: a rank's console, an error record, a file's name or a preset's description can
hold terminal control sequences (``\\x1b]0;title\\x07`` sets a terminal's title) or Rich markup (``[@click=...]``).

``clean`` replaces every C0 and C1 control character but newline and tab (and DEL) by its ``\\xNN`` spelling, so no
byte that reached shardscope from a file, a record or a rank's output reaches a terminal as a control; the views
that render Rich markup escape such text as well (``rich.markup.escape`` or a ``Text``), never format it into markup.
"""

from __future__ import annotations

import re

_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def clean(text: str) -> str:
    """``text`` with its control characters (all of C0 and C1 but ``\\n`` and ``\\t``, and DEL) spelled ``\\xNN``."""
    return _CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}", text) if text else text


def code_block(code: str, lang: str = "python") -> str:
    """``code`` (which may come from a record) as a markdown fenced block that no backtick run inside can close."""
    longest = max((len(run) for run in re.findall("`+", code)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{clean(code).rstrip()}\n{fence}"
