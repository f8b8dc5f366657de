"""End to end: start the real ``smoke`` preset from the app (torchrun with gloo on CPU) and watch it finish."""

from __future__ import annotations

import os

import pytest

from shardscope.config import cpu_host
from shardscope.tui.app import build_app
from shardscope.tui.screens.report import ReportScreen
from shardscope.tui.widgets.run_card import RunCard
from tui_fakes import run_async
from _pilot import wait_for

pytestmark = pytest.mark.slow


@run_async
async def test_smoke_preset_runs_from_the_app(tmp_path):
    out = tmp_path / "smoke"
    app = build_app(host=cpu_host(), out_dir=str(out))  # default source: a live Session
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: getattr(app.screen, "preset", None) == "smoke" and app.screen.query("#knob-steps"))
        app.screen.query_one("#knob-steps").value = "12"
        await wait_for(pilot, lambda: app.screen.comparison.steps == 12)
        await pilot.click("#launch")
        await wait_for(pilot, lambda: app.board.finished is not None, timeout=540)
        states = app.board.states
        await wait_for(pilot, lambda: {n: s.status for n, s in states.items()}
                       == {"ddp": "ok", "fsdp2": "ok", "ddp.again": "ok"}, timeout=30)  # and the A/A control
        assert all(s.steps_completed == (10 if n == "ddp.again" else 12) and s.loss is not None for n, s in states.items())
        await wait_for(pilot, lambda: [c.run for c in app.screen.query(RunCard)] == ["ddp", "fsdp2", "ddp.again"]
                       and app.screen.loss_chart.redraws >= 1)
        await pilot.press("o")
        await wait_for(pilot, lambda: isinstance(app.screen, ReportScreen)
                       and app.screen.query_one("#report-table").row_count == 3)
        await pilot.press("q")
        await pilot.pause(0.3)
    assert os.path.isfile(out / "summary.json")
