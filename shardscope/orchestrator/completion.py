"""The end of a source's work, shared by the live ``Session`` and the ``ReplaySource``."""

from __future__ import annotations

import threading


class Completion:
    """The end of a source's work: ``wait`` and ``finished`` (shared by Session and ReplaySource)."""

    exit_code: int | None
    _done: threading.Event

    def wait(self, timeout: float | None = None) -> int | None:
        """Block until the work ends (or ``timeout``); return the exit code, or None if not ended."""
        self._done.wait(timeout)
        return self.exit_code if self._done.is_set() else None

    @property
    def finished(self) -> bool:
        """True once everything ended (a session: every run ended and the reports were written)."""
        return self._done.is_set()
