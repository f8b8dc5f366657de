"""The app opens the selected run's explainer with its numbers (key i, and the command palette)."""

from __future__ import annotations

from tui_fakes import FIXTURE, run_async

from shardscope.config import cpu_host
from shardscope.tui.app import build_app
from shardscope.tui.screens.dashboard import DashboardScreen
from shardscope.tui.screens.explainer import ExplainScreen


@run_async
async def test_key_i_opens_the_selected_runs_explainer():
    app = build_app(replay_dir=FIXTURE, host=cpu_host())
    async with app.run_test(size=(160, 48)) as pilot:
        for _ in range(100):
            if app.board.finished is not None and isinstance(app.screen, DashboardScreen):
                break
            await pilot.pause(0.05)
        await pilot.pause(0.3)
        assert app.screen.selected == "ddp"
        await pilot.press("right")
        assert app.screen.selected == "fsdp2"
        await pilot.press("i")
        await pilot.pause(0.2)
        assert isinstance(app.screen, ExplainScreen)
        assert app.screen.text.startswith("# FSDP2")
        assert "run `fsdp2`" in app.screen.text and "predicted" in app.screen.text
        await pilot.press("escape")
        assert isinstance(app.screen, DashboardScreen)
        commands = [c.title for c in app.get_system_commands(app.screen)]
        assert "Explain run" in commands


@run_async
async def test_report_screen_shows_the_recommendation_of_the_summary(tmp_path):
    import json
    import shutil

    from shardscope.profiling.report import write_reports
    from shardscope.tui.screens.report import ReportScreen

    out = tmp_path / "run"
    shutil.copytree(FIXTURE, out)
    write_reports(str(out))
    rec = json.loads((out / "summary.json").read_text())["recommendation"]
    app = build_app(replay_dir=str(out), host=cpu_host())
    async with app.run_test(size=(160, 48)) as pilot:
        for _ in range(100):
            if app.board.finished is not None and isinstance(app.screen, DashboardScreen):
                break
            await pilot.pause(0.05)
        await pilot.press("o")
        await pilot.pause(0.2)
        assert isinstance(app.screen, ReportScreen)
        shown = str(app.screen.query_one("#report-recommendation").render())
        assert "Recommendation" in shown
        for line in rec["lines"] + rec["caveats"]:
            assert line[:60] in " ".join(shown.split()), line
