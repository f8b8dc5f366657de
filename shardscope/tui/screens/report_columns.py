"""The report table's headers and each one's abbreviation, in one place, and the rule that lays the table out for
a width so that no header and no value is cut.

The rule: one table, its headers abbreviated (``ABBREVIATIONS``) one at a time, the one that takes the most off
what is too wide first, until it fits; the run's role counts as one header: "(baseline)" → "(base)",
"(A/A control)" → "(A/A)". Where even the fully abbreviated table does not fit, two tables (the runs and their
loss, ``LOSS_TABLE``; their speed and memory, ``SPEED_TABLE``; each with the run column), abbreviated the same way
as far as needed. Only a run name too long for those makes the table scroll sideways. ``help_markdown`` is what
`?` shows on the report screen: every abbreviation of its columns, whichever are on screen (docs/app.md lists
them all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rich.cells import cell_len

# full header (or run role) -> its abbreviation: the one place a report header is shortened (`?` lists them)
ABBREVIATIONS: dict[str, str] = {
    "strategy": "strat",
    "ranks": "rk",
    "final loss": "loss",
    "tokens/s (median)": "tok/s",
    "samples/s (median)": "smp/s",
    "samples/s or tokens/s (median)": "rate",
    "peak RSS (process)": "RSS",
    "peak mem (allocator)": "alloc",
    "peak mem": "mem",
    "Δloss max": "Δmax",
    "Δloss mean": "Δmean",
    "speedup": "speed",
    "model-state ratio": "state×",
    "peak-mem ratio": "mem×",
    "mem ratio": "mem×",
    "(baseline)": "(base)",
    "(A/A control)": "(A/A)",
}
ROLES = ("(baseline)", "(A/A control)")  # the run cell's suffixes

LOSS_TABLE = (0, 1, 2, 3, 4, 5, 8, 9)  # run, strategy, ranks, status, steps, final loss, Δloss max, Δloss mean
SPEED_TABLE = (0, 6, 7, 10, 11)  # run, rate (median), peak memory, speedup, memory ratio
PADDING = 1  # DataTable's cell padding, each side
MAX_ROWS = 19  # rows a table shows before its own scrollbar (its max-height 20, less the header)


def short(text: str) -> str:
    """The abbreviation of a header (itself when it has none)."""
    return ABBREVIATIONS.get(text, text)


def short_cell(cell: str, abbreviated: frozenset[str] = frozenset(ROLES)) -> str:
    """A run cell with its role abbreviated when that role is in ``abbreviated``: "ddp.again (A/A control)" →
    "ddp.again (A/A)"."""
    for role in ROLES:
        if role in abbreviated and cell.endswith(" " + role):
            return cell[: -len(role)] + short(role)
    return cell


@dataclass(frozen=True)
class Layout:
    """How the table is shown: the column indices of each table, and which full headers (and run roles) are
    abbreviated."""

    tables: tuple[tuple[int, ...], ...]
    abbreviated: frozenset[str] = frozenset()

    def headers(self, full: Sequence[str], table: int) -> list[str]:
        """The headers of one of the tables, as shown."""
        return [short(full[i]) if full[i] in self.abbreviated else full[i] for i in self.tables[table]]

    def cells(self, row: Sequence[str], table: int) -> list[str]:
        """One row's cells in one of the tables, as shown (the run's role abbreviated when it is)."""
        return [short_cell(row[i], self.abbreviated) if i == 0 else row[i] for i in self.tables[table]]

    def widths(self, full: Sequence[str], rows: Sequence[Sequence[str]], table: int) -> list[int]:
        """Each column's width in one of the tables: its widest header or cell, as shown (padding apart)."""
        shown = [self.cells(r, table) for r in rows]
        return [max([cell_len(h), *(cell_len(r[k]) for r in shown)]) for k, h in enumerate(self.headers(full, table))]

    def width(self, full: Sequence[str], rows: Sequence[Sequence[str]], table: int) -> int:
        """The cells one of the tables needs across, its padding and (more rows than it shows) its scrollbar."""
        widths = self.widths(full, rows, table)
        return sum(widths) + 2 * PADDING * len(widths) + (2 if len(rows) > MAX_ROWS else 0)

    def over(self, full: Sequence[str], rows: Sequence[Sequence[str]], width: int) -> int:
        """How many cells the tables need beyond ``width``, all together (0 when each fits)."""
        return sum(max(0, self.width(full, rows, t) - width) for t in range(len(self.tables)))


ONE_TABLE = (tuple(range(12)),)
TWO_TABLES = (LOSS_TABLE, SPEED_TABLE)


def abbreviate(tables: tuple[tuple[int, ...], ...], full: Sequence[str], rows: Sequence[Sequence[str]],
               width: int) -> Layout:
    """``tables`` with as few headers abbreviated as it takes to fit ``width``: each time the one that takes the
    most off what is over, then back to its full name any a later one made needless (as many as there are when
    even all of them do not fit)."""
    chosen = Layout(tables)
    candidates = [h for h in (*full, *ROLES) if h in ABBREVIATIONS]
    while (over := chosen.over(full, rows, width)) > 0:
        tries = [Layout(tables, chosen.abbreviated | {h}) for h in candidates if h not in chosen.abbreviated]
        best = min(tries, key=lambda t: t.over(full, rows, width), default=None)
        if best is None or best.over(full, rows, width) >= over:
            break
        chosen = best
    for h in sorted(chosen.abbreviated, key=candidates.index):  # then put back any a later one made needless
        kept = Layout(tables, chosen.abbreviated - {h})
        if not kept.over(full, rows, width):
            chosen = kept
    return chosen


def layout(full: Sequence[str], rows: Sequence[Sequence[str]], width: int) -> Layout:
    """One table when it fits ``width`` cells, with as few abbreviations as it takes; else the two."""
    one = abbreviate(ONE_TABLE, full, rows, width)
    return one if not one.over(full, rows, width) else abbreviate(TWO_TABLES, full, rows, width)


def help_markdown(full: Sequence[str]) -> str:
    """The report screen's `?` text: each abbreviation of these headers and of the run roles, and what it stands
    for, one a line (the panel is narrow; what each figure means is in docs/report.md and docs/glossary.md)."""
    lines = [f"`{short(h)}` = {h}" for h in (*full, *ROLES) if h in ABBREVIATIONS]
    return ("**Column abbreviations** (when the full names do not fit)\\\n" + "\\\n".join(lines)
            + "\n\nWhat each means: docs/glossary.md and the docs page on reading a report")
