"""End to end: start the real ``smoke`` preset from the app (torchrun with gloo on CPU) and watch it finish."""

from __future__ import annotations

import os

import pytest

from shardscope.config import cpu_host
from shardscope.tui.app import build_app
from shardscope.tui.screens.report import ReportScreen
from shardscope.tui.widgets.run_card import RunCard
from tui_fakes import run_async

pytestmark = pytest.mark.slow


@run_async
async def test_smoke_preset_runs_from_the_app(tmp_path):
    out = tmp_path / "smoke"
    app = build_app(host=cpu_host(), out_dir=str(out))  # default source: a live Session
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause(0.3)
        assert app.screen.preset == "smoke"
        app.screen.query_one("#knob-steps").value = "12"
        await pilot.pause(0.2)
        await pilot.click("#launch")
        for _ in range(int(540 / 0.5)):
            if app.board.finished is not None:
                break
            await pilot.pause(0.5)
        assert app.board.finished is not None, {n: s.status for n, s in app.board.states.items()}
        await pilot.pause(0.5)
        states = app.board.states
        assert {n: s.status for n, s in states.items()} == {"ddp": "ok", "fsdp2": "ok"}
        assert all(s.steps_completed == 12 and s.loss is not None for s in states.values())
        assert [c.run for c in app.screen.query(RunCard)] == ["ddp", "fsdp2"]
        assert app.screen.loss_chart.redraws >= 1
        await pilot.press("o")
        await pilot.pause(0.3)
        assert isinstance(app.screen, ReportScreen)
        assert app.screen.query_one("#report-table").row_count == 2
        await pilot.press("q")
        await pilot.pause(0.3)
    assert os.path.isfile(out / "summary.json")
