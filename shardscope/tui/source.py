"""Where run updates come from: a live ``Session``, a ``ReplaySource`` of a run directory, or a fake.

The app only needs the small interface below; the orchestrator's classes are imported lazily so
opening the app costs nothing until a comparison starts.
"""

from __future__ import annotations

from typing import Callable, Protocol

from shardscope.config import Comparison, HostInfo
from shardscope.profiling.state import Update


class Source(Protocol):
    """What the app needs from a source of updates (``Session`` and ``ReplaySource`` fit)."""

    finished: bool

    def subscribe(self, callback: Callable[[list[Update]], None]) -> None: ...
    def start(self) -> None: ...
    def stop_run(self, name: str) -> None: ...
    def restart_run(self, name: str) -> None: ...
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


def replay_source(out_dir: str, speed: float | None = None) -> Source:
    """Return a ``ReplaySource`` replaying the run directory ``out_dir``."""
    from shardscope.orchestrator.replay import ReplaySource

    return ReplaySource(out_dir, speed=speed)


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
