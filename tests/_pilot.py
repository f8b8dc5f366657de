"""Driving the app in tests: wait for a condition, never for a fixed time (a loaded machine only waits longer)."""

from __future__ import annotations


async def wait_for(pilot, predicate, timeout: float = 60.0) -> None:
    """Let the app run until ``predicate()`` holds; fail after ``timeout`` seconds (a bound for a hang)."""
    for _ in range(int(timeout / 0.05)):
        try:
            if predicate():
                return
        except Exception:  # noqa: BLE001 - a widget not mounted yet: keep waiting
            pass
        await pilot.pause(0.05)
    raise AssertionError("condition not reached in time")
