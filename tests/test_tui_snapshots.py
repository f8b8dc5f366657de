"""Snapshot tests of the app's screens at 160x48 (pytest-textual-snapshot; update with --snapshot-update).

The app runs from the repository root so paths on screen are the same on every machine, animations
are off, and the data comes from the recorded fixture under tests/data/replay-smoke.
"""

from __future__ import annotations

import pytest

from shardscope.config import cpu_host
from shardscope.tui.app import build_app
from tui_fakes import FIXTURE, FakeReplaySource, REPO_ROOT, click_until

SIZE = (160, 48)


@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)


def _app(**kwargs):
    app = build_app(host=cpu_host(), **kwargs)
    app.animation_level = "none"
    return app


async def _settle(pilot, finished: bool = True) -> None:
    """Until the replay finished and (when it should have) every run's trace analysis arrived: iterations, not a
    fixed time, so a loaded machine only waits longer."""
    app = pilot.app
    for _ in range(600):
        if not finished or (app.board.finished is not None and set(app.board.states) <= set(app.board.analyses)):
            break
        await pilot.pause(0.05)
    await pilot.pause(0.5)
    app.redraw(force=True)
    await pilot.pause(0.1)


def test_presets_screen(snap_compare, monkeypatch):
    # Only the first two built-ins, so adding a preset does not change this picture.
    from shardscope.config import list_presets
    from shardscope.tui.screens import presets

    two = [p for p in list_presets() if p[0] in ("ddp-vs-fsdp", "smoke")]
    monkeypatch.setattr(presets, "list_presets", lambda: two)
    assert snap_compare(_app(), terminal_size=SIZE, run_before=lambda pilot: pilot.pause(0.3))


def test_running_dashboard(snap_compare, tmp_path):
    fake = FakeReplaySource(fraction=0.5)
    app = _app(replay_dir=FIXTURE, source_factory=lambda c, out: fake)
    assert snap_compare(app, terminal_size=SIZE, run_before=lambda pilot: _settle(pilot, finished=False))


def test_failed_run_selected(snap_compare):
    async def select_failed(pilot):
        await _settle(pilot)
        await click_until(pilot, "#card-2", lambda: pilot.app.screen.selected == "fsdp2-fault")
        await pilot.pause(0.3)

    assert snap_compare(_app(replay_dir="tests/data/replay-smoke"), terminal_size=SIZE, run_before=select_failed)


def test_report_screen(snap_compare):
    async def open_report(pilot):
        await _settle(pilot)
        await pilot.press("o")
        await pilot.pause(0.3)

    assert snap_compare(_app(replay_dir="tests/data/replay-smoke"), terminal_size=SIZE, run_before=open_report)


SMALL = (100, 30)  # the smallest size the app promises to stay readable at


def test_presets_screen_small(snap_compare, monkeypatch):
    from shardscope.config import list_presets
    from shardscope.tui.screens import presets

    two = [p for p in list_presets() if p[0] in ("ddp-vs-fsdp", "smoke")]
    monkeypatch.setattr(presets, "list_presets", lambda: two)
    assert snap_compare(_app(), terminal_size=SMALL, run_before=lambda pilot: pilot.pause(0.3))


def test_finished_dashboard_small(snap_compare):
    assert snap_compare(_app(replay_dir="tests/data/replay-smoke"), terminal_size=SMALL, run_before=_settle)


async def _press(pilot, *keys: str) -> None:
    """Settle, then press ``keys`` one by one (each given time to open its screen)."""
    await _settle(pilot)
    for key in keys:
        await pilot.press(key)
        await pilot.pause(0.5)
    pilot.app.redraw(force=True)
    await pilot.pause(0.2)


# Every screen the dashboard opens, at the smallest promised size and at 160x48: the report, a strategy's
# explanation (i), the per-rank timing (t), why on the baseline (w: nothing to explain, said so). The keys panel
# (?) is Textual's, its rows in the order its focus walk finds them: tests/test_tui_app.py checks what it lists.
SCREENS = {"report": ("o",), "explain": ("i",), "ranks": ("t",), "why-baseline": ("w",)}


@pytest.mark.parametrize("size", [SMALL, SIZE], ids=["100x30", "160x48"])
@pytest.mark.parametrize("screen", list(SCREENS))
def test_every_screen(snap_compare, screen, size):
    keys = SCREENS[screen]
    assert snap_compare(_app(replay_dir="tests/data/replay-smoke"), terminal_size=size,
                        run_before=lambda pilot: _press(pilot, *keys))
