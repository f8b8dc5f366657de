"""The app opens the selected run's explainer with its numbers (key i, and the command palette)."""

from __future__ import annotations

from tui_fakes import FIXTURE, run_async

from shardscope.config import cpu_host
from shardscope.tui.app import build_app
from shardscope.tui.screens.dashboard import DashboardScreen
from shardscope.tui.screens.explainer import ExplainScreen
from _pilot import wait_for


@run_async
async def test_key_i_opens_the_selected_runs_explainer():
    app = build_app(replay_dir=FIXTURE, host=cpu_host())
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: app.board.finished is not None and isinstance(app.screen, DashboardScreen)
                       and app.screen.selected == "ddp")
        await pilot.press("right")
        assert app.screen.selected == "fsdp2"
        await pilot.press("i")
        await wait_for(pilot, lambda: isinstance(app.screen, ExplainScreen) and app.screen.text)
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

    from shardscope.analysis.report import write_reports
    from shardscope.tui.screens.report import ReportScreen

    out = tmp_path / "run"
    shutil.copytree(FIXTURE, out)
    write_reports(str(out))
    rec = json.loads((out / "summary.json").read_text())["recommendation"]
    app = build_app(replay_dir=str(out), host=cpu_host())
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: app.board.finished is not None and isinstance(app.screen, DashboardScreen))
        await pilot.press("o")
        await wait_for(pilot, lambda: isinstance(app.screen, ReportScreen)
                       and "Answer" in str(app.screen.query_one("#report-recommendation").render()))
        shown = str(app.screen.query_one("#report-recommendation").render())
        assert shown.lstrip().startswith("Answer")  # the answer leads, as in report.md and the headless output
        for line in rec["lines"] + rec["caveats"]:  # every line of the recommendation is shown, in the answer or after
            assert line[:60] in " ".join(shown.split()), line
