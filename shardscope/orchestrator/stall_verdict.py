"""A stalled run's verdict, from what each rank said when asked (``stall`` records, engines/stall_dump.py).

"stalled at step 7: rank 1 never entered all_reduce #58 (group default_pg, size [7]); rank 0 waiting in it
for 20 s". Per process group, a rank whose newest flight-recorder entry is not done is waiting in that
collective; a rank whose newest entry in the same group has a smaller sequence number never entered it: that
rank is where the run stopped, and its Python stack (in the traceback) says what it does instead.
"""

from __future__ import annotations

import re

from typing import Any


def rank_list(ranks: list[int]) -> str:
    """``rank 1`` / ``ranks 0 and 2-3`` for a list of ranks."""
    ranks = sorted(set(ranks))
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    body = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return ("rank " if len(ranks) == 1 else "ranks ") + body


def _newest(entries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The newest entry of each process group (point-to-point entries left out: they pair, not gather)."""
    out: dict[str, dict[str, Any]] = {}
    for e in entries:
        if e.get("p2p"):
            continue
        group = str(e.get("group", "?"))
        if group not in out or int(e.get("seq", 0)) > int(out[group].get("seq", 0)):
            out[group] = e
    return out


def where(stalls: dict[int, dict[str, Any]]) -> str:
    """The part of the verdict after ``stalled at step S: ``: per process group with a rank waiting, who never
    entered the collective it waits in; "" when no rank is in a collective. Waits in several groups are a
    deadlock, said as such with every direction: which side took the wrong branch is a matter of program order,
    which the ranks' stacks (in the traceback) show and the entry times do not (ranks do not start a step
    together)."""
    newest = {rank: _newest(list(rec.get("collectives") or [])) for rank, rec in stalls.items()}
    found = []
    for group in sorted({g for per in newest.values() for g in per}):
        waiting = {r: per[group] for r, per in newest.items() if group in per and not per[group].get("done")}
        if not waiting:
            continue
        seq = max(int(e.get("seq", 0)) for e in waiting.values())
        entry = next(e for e in waiting.values() if int(e.get("seq", 0)) == seq)
        in_it = sorted(r for r, e in waiting.items() if int(e.get("seq", 0)) == seq)
        missing = sorted(r for r, per in newest.items() if int(per.get(group, {}).get("seq", -1)) < seq)
        since = min(float(waiting[r].get("entered_t", 0.0)) for r in in_it)
        waited = max(float(stalls[r].get("t", 0.0)) for r in in_it) - since
        what = f"{entry.get('op', '?')} #{seq} (group {group}, size {_sizes(entry)})"
        waits = f"{rank_list(in_it)} waiting in it for {waited:.0f} s"
        text = (f"{rank_list(missing)} never entered {what}; {waits}" if missing
                else f"every rank entered {what} and none finished it; {waits}")
        found.append((since, text))
    texts = [text for _, text in sorted(found)]
    return ("deadlock across process groups: " + "; and ".join(texts)) if len(texts) > 1 else "".join(texts)


def _sizes(entry: dict[str, Any]) -> str:
    sizes = entry.get("sizes") or []
    return "x".join(str(d) for d in sizes[0]) if sizes and isinstance(sizes[0], list) else "?"


def describe(stalls: dict[int, dict[str, Any]], limit_s: float, world_size: int) -> tuple[str, str]:
    """(one-line verdict, traceback with each rank's stacks) for a run that made no progress for ``limit_s``."""
    step = max((int(rec.get("step", 0)) for rec in stalls.values()), default=0)
    head = f"stalled at step {step} (no progress for {limit_s:g} s)"
    said = where(stalls)
    silent = [r for r in range(world_size) if r not in stalls]
    line = f"{head}: {said}" if said else head
    if not said and stalls:  # the verdict of the 2026-11-27 CI said only the head: say where the ranks are instead
        places = where_not_in_a_collective(stalls)
        line = f"{head}: no rank is in a collective" + (f"; {places}" if places else "")
    if silent and stalls:
        line += f"; {rank_list(silent)} did not answer"
    stack_text = "\n".join(f"--- rank {rank}: Python stacks\n{_without_dumper(str(rec.get('stack', '')))}"
                           for rank, rec in sorted(stalls.items()))
    return line, stack_text


def main_frame(stack: str) -> str:
    """The innermost frame of a rank's main thread (the thread whose stack reaches ``worker.main``), as
    ``function (file.py:line)``; "" when the stack has none."""
    for block in stack.strip().split("\n\n"):
        lines = block.splitlines()
        if block.startswith("Current thread") or not any(_ENTRY.search(x) for x in lines):
            continue
        frame = next((_FRAME.search(x) for x in lines if _FRAME.search(x)), None)
        if frame:
            return f"{frame.group(3)} ({frame.group(1).replace(chr(92), '/').rsplit('/', 1)[-1]}:{frame.group(2)})"
    return ""


def where_not_in_a_collective(stalls: dict[int, dict[str, Any]]) -> str:
    """Where the ranks' main threads are, grouped: ``ranks 0-3 in wait_for_previous_run (watchdog.py:98)``."""
    by_place: dict[str, list[int]] = {}
    for rank, rec in stalls.items():
        place = main_frame(str(rec.get("stack", "")))
        if place:
            by_place.setdefault(place, []).append(rank)
    return "; ".join(f"{rank_list(ranks)} in {place}" for place, ranks in sorted(by_place.items(), key=lambda x: min(x[1])))


def _without_dumper(stack: str) -> str:
    """faulthandler's dump without the block of the thread that made it, each thread's stack cut below the rank's
    entry (``worker.main``): what called it is the launch (torchrun, multiprocessing, runpy), 25 frames for a
    forked rank, which would push the frames that say where the rank is out of the summary's traceback tail."""
    blocks = stack.strip().split("\n\n")
    return "\n\n".join(_cut_at_entry(b) for b in blocks if not b.startswith("Current thread")).strip()


def _cut_at_entry(block: str) -> str:
    lines = block.splitlines()
    entry = next((k for k, line in enumerate(lines) if _ENTRY.search(line)), None)
    return "\n".join(lines if entry is None else lines[:entry + 1])


_ENTRY = re.compile(r'engines[/\\]worker\.py", line \d+ in main$')
_FRAME = re.compile(r'File "(.+)", line (\d+) in (\S+)')
