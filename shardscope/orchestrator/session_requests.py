"""What other threads ask of a running session: stop a run, run it again, stop everything.

``Requests`` is a mixin of ``Session``. The asking side (the app's thread, a signal handler) only queues a request;
the session thread takes them between polls (``_handle_requests``). Once the session's loop is over, ``stop_run``
and ``restart_run`` answer False instead of queueing a request nobody would take: the summary and report are
written (or being written), so the caller says so (the app's ``r`` after the end).
"""

from __future__ import annotations

from shardscope.profiling import state


class Requests:
    """Mixin of ``Session``: requests from other threads, and their handling on the session thread."""

    def stop_run(self, name: str) -> bool:
        """Ask for one run to be stopped (status ``stopped``); a queued run is skipped. False: the comparison had
        ended (its summary is written or being written), so nothing is asked."""
        return self._ask("stop", name)

    def restart_run(self, name: str) -> bool:
        """Ask for a run to be run again from scratch (stopped first if active). False: the comparison had ended,
        so nothing restarts (a restart now would leave its summary and report behind the runs)."""
        return self._ask("restart", name)

    def _ask(self, what: str, name: str) -> bool:
        with self._lock:  # the session thread closes the requests under the same lock: none is taken and dropped
            if self._ended:
                return False
            self._requests.append((what, name))
            return True

    def stop_all(self) -> None:
        """Stop every run; queued runs are marked ``stopped``. The summary is still written."""
        self._requests.append(("stop_all", ""))

    def _handle_requests(self) -> None:
        while self._requests:
            what, name = self._requests.popleft()
            if what == "stop_all":
                self._stopping = True
                for active in self._active.values():
                    active.stop_reason = active.stop_reason or "stopped"
            elif name not in self.run_names:
                self._emit(state.Notice(f"no run named {name!r}", "warning"))
            elif what == "stop":
                if name in self._active:
                    self._active[name].stop_reason = "stopped"
                elif name in self._queue:
                    self._queue.remove(name)
                    self._emit(state.StatusChanged(name, state.STOPPED, "stopped before it started"))
            elif what == "restart":
                if name in self._active:
                    self._active[name].stop_reason = "stopped"
                if name not in self._queue:
                    self._queue.append(name)
                    self._stopping = False
