"""Why a run failed, when its ranks could not say so themselves.

A rank that raises writes an ``error`` record (its message already names out of memory or a full
disk: ``engines/failure.py``). A rank that is killed writes nothing; then the orchestrator looks:

- torchrun's root-cause entry in the console (``rank : R``, ``exitcode : -9 (pid: P)``) gives the rank,
  its pid and the signal; the kernel log (``/dev/kmsg``, readable by root) says whether the OOM
  killer killed that pid (``Killed process P``) — a SIGKILL from anyone else is named as such, and
  where the kernel log cannot be read the message says the OOM killer could not be confirmed;
- the output directory's filesystem (read-only, or full): a rank that died on a full disk may not
  have been able to write even its error;
- torchrun's rendezvous store could not listen (its port taken): no rank ever started.
"""

from __future__ import annotations

import errno
import os
import re
import signal
from dataclasses import dataclass

from shardscope.core import outspace, rank_process

OOM, DISK, ERROR = "oom", "disk", "error"  # the same causes a rank's error record carries
RENDEZVOUS = "rendezvous"  # this node's torchrun could not host the rendezvous: a local cause, no rank started

_PORT_IN_USE = re.compile(r"server socket has failed to listen[^\n]*?port: (\d+)[^\n]*EADDRINUSE")
_FAILURE_ROW = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank[^\n]*\n\s*exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)")


@dataclass(frozen=True)
class Verdict:
    """A failed run's one-line error, its traceback or console tail, and its cause."""

    error: str
    traceback: str
    cause: str = ERROR


def cause_of(errors: list[dict], message: str) -> str:
    """The ``cause`` (oom | disk | error) of the error record whose message is ``message`` (the root cause)."""
    return next((str(e.get("cause", "")) for e in errors if str(e.get("message", "")) == message), "")


def killed_ranks(console: str) -> list[tuple[int, int, int]]:
    """Return (rank, signal number, pid) of the ranks torchrun's failure table shows killed by a signal,
    its root cause (first observed failure) first. Under load torchrun may observe a peer whose collective
    broke (exit code 1) before the killed rank, so the other failures of the table count too."""
    block = console[console.rfind("Failures:"):] if "Failures:" in console else console
    _, found, root = block.rpartition("Root Cause (first observed failure)")
    # forked ranks: how each ended, said by their agent in the order they ended (torchrun lists one failure only)
    rows = [(r, c, p, True) for r, c, p in rank_process.exit_rows(console)]
    rows += [(r, c, p, True) for r, c, p in _FAILURE_ROW.findall(root if found else "")]
    rows += [(r, c, p, False) for r, c, p in _FAILURE_ROW.findall(block)]
    out: list[tuple[int, int, int]] = []
    for rank, code, pid, is_root in rows:
        entry = (int(rank), -int(code), int(pid))
        # Beyond the root cause only SIGKILL counts: torchrun itself ends the other ranks with SIGTERM.
        if int(code) < 0 and (is_root or -int(code) == 9) and entry not in out:
            out.append(entry)
    return out


FORKED_MARK = "(start_method: fork)"  # torchrun's log line for a failed rank it forked


def exit_codes(console: str) -> dict[int, int]:
    """{rank: exit code} of the ranks in torchrun's failure table (ranks that ended with code 0 are not there)."""
    block = console[console.rfind("Failures:"):] if "Failures:" in console else console
    codes = {int(r): int(c) for r, c, _ in _FAILURE_ROW.findall(block)}
    codes.update({rank: code for rank, code, _ in rank_process.exit_rows(console)})  # forked ranks: every one
    return codes


def from_exit(console: str, silent: list[int], last_steps: dict[int, int]) -> Verdict | None:
    """A verdict naming a rank that left without a record (``os._exit``, a crash in C, ``sys.exit`` from a
    library) while its peers reported: that rank is the root cause, their broken connections its consequence.
    ``silent``: ranks of this node with neither an ``end`` nor an ``error`` record. Its exit code comes from
    torchrun's failure table or, for forked ranks, their agent's lines; a rank missing from a table that lists
    others left with code 0 (a new interpreter per rank: torchrun lists every failure), else its code is unknown."""
    if not silent:
        return None
    codes = exit_codes(console)
    rank = next((r for r in silent if codes.get(r, 0) >= 0), None)
    if rank is None:  # killed by signals: from_kill names them
        return None
    step = last_steps.get(rank, -1) + 1
    code = codes.get(rank)
    # Forked ranks: torchrun's table lists one failure, and the agent's lines miss a rank reaped before it looked.
    complete = codes and not rank_process.exit_rows(console) and FORKED_MARK not in console
    said = f"code {code}" if code is not None else ("code 0" if complete else "an unknown code")
    return Verdict(f"rank {rank} exited with {said} at step {step} without an error record; the other ranks' "
                   "errors follow from it", console)


def kernel_oom_kills() -> set[int] | None:
    """Return the pids the kernel's OOM killer killed (from ``/dev/kmsg``), or None when it cannot be read."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    pids: set[int] = set()
    try:
        while True:
            try:
                line = os.read(fd, 8192).decode("utf-8", "replace")
            except BlockingIOError:
                break
            except OSError as err:
                if err.errno == errno.EPIPE:  # a record was overwritten while reading: go on
                    continue
                break
            if not line:
                break
            match = re.search(r"Killed process (\d+)", line)
            if match:
                pids.add(int(match.group(1)))
    finally:
        os.close(fd)
    return pids


def from_kill(console: str, last_steps: dict[int, int]) -> Verdict | None:
    """A verdict naming the first rank killed by a signal (out of memory when the OOM killer did it)."""
    killed = killed_ranks(console)
    if not killed:
        return None
    oom_pids = kernel_oom_kills()
    rank, sig, pid = killed[0]
    step = last_steps.get(rank, -1) + 1
    name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"
    if oom_pids is not None and pid in oom_pids:
        return Verdict(f"out of memory on rank {rank} at step {step}: killed by the kernel's OOM killer (pid {pid})",
                       console, OOM)
    if sig == signal.SIGKILL:
        why = ("not by the OOM killer, says the kernel log" if oom_pids is not None
               else "the kernel log is unreadable, so an OOM kill cannot be confirmed")
        return Verdict(f"rank {rank} killed by SIGKILL at step {step} ({why})", console)
    return Verdict(f"rank {rank} killed by {name} at step {step}", console)


def from_output(run_dir: str, console: str) -> Verdict | None:
    """A verdict naming a full or read-only output filesystem, or None when it looks writable."""
    problem = outspace.filesystem_problem(run_dir)
    if problem is None:
        return None
    return Verdict(outspace.describe(problem), console, DISK)


def from_rendezvous(console: str, nnodes: int) -> Verdict | None:
    """A verdict naming the rendezvous port torchrun found taken, or None."""
    found = _PORT_IN_USE.search(console)
    if found is None:
        return None
    hint = ("; each run of a multi-node comparison rendezvouses on --rdzv-endpoint's port + the run's index: choose "
            "a port with a free one for every run after it, below the kernel's ephemeral range "
            "(/proc/sys/net/ipv4/ip_local_port_range), where outgoing connections take ports" if nnodes > 1 else "")
    return Verdict(f"rendezvous port {found.group(1)} already in use on this node{hint}", console, RENDEZVOUS)
