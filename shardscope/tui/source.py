"""Where run updates come from: a live ``Session``, a ``ReplaySource`` of a run directory, or a fake.

The app only needs the small interface below; the orchestrator's classes are imported lazily so
opening the app costs nothing until a comparison starts.
"""

from __future__ import annotations

import os
from typing import Callable, Protocol

from shardscope.config import Comparison, HostInfo
from shardscope.core.rundir import COMPARISON
from shardscope.profiling.state import Notice, Update


class Source(Protocol):
    """What the app needs from a source of updates (``Session`` and ``ReplaySource`` fit)."""

    finished: bool

    def subscribe(self, callback: Callable[[list[Update]], None]) -> None: ...
    def start(self) -> None: ...
    def stop_run(self, name: str) -> bool | None: ...  # False: the comparison had ended; nothing was asked
    def restart_run(self, name: str) -> bool | None: ...
    def stop_all(self) -> None: ...
    def wait(self, timeout: float | None = None) -> int | None: ...


SourceFactory = Callable[[Comparison, str], Source]


def session_source(comparison: Comparison, out_dir: str) -> Source:
    """Return a live ``Session`` running ``comparison`` into ``out_dir`` (torchrun jobs).

    Raises ConfigError when the comparison asks for a device this machine lacks.
    """
    from shardscope.orchestrator import devices
    from shardscope.orchestrator.session import Session

    return Session(comparison, out_dir, device=devices.resolve_device(comparison.launch.device))


def unreadable(path: str, err: BaseException) -> str:
    """One line naming a file that cannot be read and why (``comparison.json unreadable: nested too deeply``)."""
    why = str(err) or type(err).__name__
    for prefix in (path, os.path.abspath(path)):
        why = why.removeprefix(prefix + ": ")
    return f"{os.path.basename(path)} unreadable: {why}"


def unreadable_summary(out_dir: str) -> str:
    """"summary.json unreadable: why" when ``<out>/summary.json`` is there but cannot be read, else "" (a replay
    reads it as absent: the dashboard says so instead of waiting for a finish that never comes)."""
    from shardscope.core.rundir import RunDir, load_summary

    path = RunDir(out_dir).summary
    if not os.path.lexists(path):
        return ""
    try:
        load_summary(out_dir)
    except (OSError, ValueError) as err:
        return unreadable(path, err)
    return ""


class Unreadable:
    """A run directory that cannot be replayed (its comparison.json cannot be read): starting it publishes one error
    notice saying why, which the dashboard shows; there is nothing to stop, and it is finished from the start."""

    finished = True

    def __init__(self, why: str) -> None:
        self.why = why
        self._callbacks: list[Callable[[list[Update]], None]] = []

    def subscribe(self, callback: Callable[[list[Update]], None]) -> None:
        """Receive the notice when started."""
        self._callbacks.append(callback)

    def start(self) -> None:
        """Publish why nothing can be shown."""
        for callback in self._callbacks:
            callback([Notice(self.why, "error")])

    def stop_run(self, name: str) -> None:
        """Nothing runs."""

    def restart_run(self, name: str) -> None:
        """Nothing runs."""

    def stop_all(self) -> None:
        """Nothing runs."""

    def wait(self, timeout: float | None = None) -> int | None:
        """Finished already, as failed."""
        return 1


def replay_source(out_dir: str, speed: float | None = None) -> Source:
    """Return a ``ReplaySource`` replaying the run directory ``out_dir``, or an ``Unreadable`` source saying why when
    its comparison.json cannot be read. A file that breaks the replay later (a damaged summary.json or run file)
    ends it with an error notice naming it, never a silent thread: the dashboard shows what was read and why not
    the rest."""
    from shardscope.orchestrator.replay import ReplaySource

    class GuardedReplay(ReplaySource):
        def _main(self) -> None:
            try:
                super()._main()
            except Exception as err:  # noqa: BLE001 - files from outside: said on screen, never lost in a thread
                self._publish([Notice(f"{out_dir}: unreadable, the replay stopped: {type(err).__name__}: {err}",
                                      "error")])
                self.exit_code = 1
                self._done.set()

    try:
        return GuardedReplay(out_dir, speed=speed)
    except (OSError, ValueError, TypeError, RecursionError) as err:
        return Unreadable(unreadable(os.path.join(out_dir, COMPARISON), err))


def default_out_dir(preset_name: str) -> str:
    """Return the orchestrator's default output directory for a preset."""
    from shardscope.orchestrator.session import default_out_dir as orchestrator_default

    return orchestrator_default(preset_name)


def host_info() -> HostInfo:
    """Return what this machine can host (GPUs through NVML, else CPU ranks), to validate presets."""
    from shardscope.orchestrator import devices

    return devices.host_info(devices.resolve_device("auto"))


def read_comparison(out_dir: str) -> Comparison | None:
    """Return the Comparison recorded in ``<out>/comparison.json``, or None if it cannot be read."""
    from shardscope.analysis.fold import load_comparison

    try:
        return load_comparison(out_dir)
    except (OSError, ValueError, TypeError):
        return None
