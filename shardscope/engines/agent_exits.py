"""How each rank a torchrun agent forked ended, seen from the agent without reaping it.

With forked ranks (``launch.start_method = fork``) torchrun's multiprocessing start reports one failure only: the
first failed rank its poll observes, in rank order. When rank 1 is killed (the OOM killer, a crash) and rank 0's
collective breaks a moment later, both are dead by the next poll and the table names rank 0 with exit code 1;
rank 1's signal is lost. A cold ``torchrun`` (a process per rank) lists every failed rank, which the verdict
(``orchestrator/verdict.py``) relies on.

So the agent, the ranks' parent, watches them: a thread reads the agent's children from
``/proc/self/task/<pid>/children`` every 0.1 s (one small read) and, for each child that named itself a rank
(``core/rank_process``), a thread waits in ``waitid(..., WEXITED | WNOWAIT)``: it learns how the rank ended and
leaves it to torchrun to reap. Those threads can lose a race on a loaded machine: torchrun may reap a rank before
its waiter ran (or before the poll saw the rank at all). So the watch also taps ``os.waitpid`` in the agent, the
call through which torchrun's multiprocessing start reaps (``multiprocessing.popen_fork``): a status it reaps for a
pid that named itself a rank (read while the rank is still a zombie, before the real call) is kept too. When
torchrun returns, ``ExitWatch.lines`` gives one console line per rank, in the order they ended, which the agent
prints last.

Written by hand: neither torchrun nor psutil says how another process's child ended without reaping it.
"""

from __future__ import annotations

import os
import threading
import time

from shardscope.core import rank_process


def _read(path: str) -> bytes:
    """A small /proc file's bytes by system calls only. This thread runs while torchrun forks the ranks, and a
    lock it held then stays held in every rank: ``open()`` with an encoding can import a codec and hold that
    module's import lock (a rank that imports it later would wait forever), ``os.read`` holds none."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 65536)
    finally:
        os.close(fd)


def _children() -> list[int]:
    try:
        return [int(p) for p in _read(f"/proc/self/task/{os.getpid()}/children").split()]  # the main thread forks
    except (OSError, ValueError):  # no such file on this kernel: nothing is watched (torchrun's table stands)
        return []


def _rank_of(pid: int) -> int | None:
    try:  # ASCII decoding is built in (no codec is looked up or imported)
        return rank_process.rank_from_name(_read(f"/proc/{pid}/comm").decode("ascii", "replace").strip())
    except OSError:
        return None


class ExitWatch:
    """Daemon threads that learn how each forked rank ended (see the module docstring)."""

    def __init__(self, poll_s: float = 0.1) -> None:
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._ended: list[tuple[int, int, int]] = []  # (rank, pid, code) in the order they ended
        self._waiting: dict[int, threading.Thread] = {}  # pid -> its waiter
        self._stop = threading.Event()
        self._named: dict[int, int] = {}  # pid -> rank, as the waitpid tap saw it (single dict writes: no lock)
        self._reaped: dict[int, int] = {}  # pid -> the wait status torchrun reaped, insertion order = end order
        self._real_waitpid = os.waitpid

    def start(self, poll: bool = True) -> "ExitWatch":
        """Tap ``os.waitpid`` and start watching this process's children (``poll`` False: the tap alone); return
        self."""
        os.waitpid = self._tap(os.getpid())
        if poll:
            threading.Thread(target=self._discover, name="rank-exit-watch", daemon=True).start()
        return self

    def _tap(self, agent: int):  # type: ignore[no-untyped-def]
        real = self._real_waitpid

        def waitpid(pid: int, options: int) -> tuple[int, int]:
            """``os.waitpid``, which also keeps the status of a rank it reaps. In a forked rank (which inherits the
            tap) and for other children it is the real call alone: no lock, nothing kept."""
            if pid <= 0 or os.getpid() != agent:
                return real(pid, options)
            if pid not in self._named:
                rank = _rank_of(pid)  # a zombie's name is still there; just forked and not named yet: next call
                if rank is not None:
                    self._named[pid] = rank
            got, status = real(pid, options)
            if got == pid and pid in self._named:
                self._reaped[pid] = status
            return got, status

        return waitpid

    def _discover(self) -> None:
        while not self._stop.is_set():
            for pid in _children():
                if pid not in self._waiting:
                    rank = _rank_of(pid)
                    if rank is not None:  # not yet named (just forked), or not a rank: looked at again next poll
                        waiter = threading.Thread(target=self._await, args=(pid, rank), daemon=True)
                        self._waiting[pid] = waiter
                        waiter.start()
            self._stop.wait(self.poll_s)

    def watched(self) -> set[int]:
        """The pids of the ranks being watched so far."""
        return set(self._waiting)

    def ended(self) -> set[int]:
        """The pids of the watched ranks whose end was seen."""
        with self._lock:
            return {pid for _, pid, _ in self._ended}

    def _await(self, pid: int, rank: int) -> None:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # reaped before this thread waited: the waitpid tap kept its status
            return
        if info is None:
            return
        code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        with self._lock:
            self._ended.append((rank, pid, code))

    def lines(self, wait_s: float = 2.0) -> list[str]:
        """Stop watching (and untap ``os.waitpid``); a console line for each rank whose end was seen, code 0
        included (waiting up to ``wait_s`` for the waiters of ranks that are gone to say so), then for each rank
        torchrun reaped that no waiter saw. A rank that ended before it named itself has none: the verdict then
        calls its code unknown."""
        self._stop.set()
        if os.waitpid is not self._real_waitpid:
            os.waitpid = self._real_waitpid
        deadline = time.monotonic() + wait_s
        for waiter in list(self._waiting.values()):
            waiter.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._lock:
            ended = list(self._ended)
        seen = {pid for _, pid, _ in ended}
        ended += [(self._named[pid], pid, os.waitstatus_to_exitcode(status))
                  for pid, status in list(self._reaped.items()) if pid not in seen]
        return [rank_process.exit_line(rank, pid, code) for rank, pid, code in ended]
