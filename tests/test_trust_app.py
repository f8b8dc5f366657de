"""The app trusts no byte from outside (issue 43, items 4 and 6).

Markup in a run directory's records, console, notes and names (``[@click=app.quit]boom[/]``) is shown as the
characters it is on the dashboard, the console pane and the report screen, and clicking it does nothing; a
terminal control is shown spelled (``\\x1b``). A file that cannot be read (a comparison.json nested 100000 deep,
a summary.json cut short, a rank file's line of the wrong shape, a string where a summary's number belongs) is
said on screen ("… unreadable: why"), never an empty screen, a hang or a crash. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from _pilot import wait_for
from shardscope.config import cpu_host
from shardscope.profiling.state import Notice
from shardscope.tui.app import build_app
from shardscope.tui.screens.dashboard import DashboardScreen
from shardscope.tui.screens.report import ReportScreen
from shardscope.tui.widgets.log_pane import LogPane
from shardscope.tui.widgets.run_card import RunCard
from test_trust_text import CLICK, MARK, OSC_SPELLED, STYLE, craft
from tui_fakes import FIXTURE, run_async

SIZE = (160, 48)
SHOWN = f"{CLICK} {STYLE} {OSC_SPELLED}"  # MARK as the screen must show it


def shown(app, selector: str) -> str:
    """What a Static of the current screen shows, as plain text ("" while it is not there)."""
    found = app.screen.query(selector)
    return str(found.first().render()) if found else ""


def log_text(app) -> str:
    """The console pane's text, its wrapped lines joined again (words separated by one space)."""
    return " ".join(" ".join(line.text for line in app.screen.query_one(LogPane).lines).split())


async def click_on(pilot, app, selector: str, word: str) -> None:
    """Click where ``word`` is drawn in the one-line widget ``selector`` (a link there, were it markup, would act)."""
    text = shown(app, selector)
    assert word in text, text
    await pilot.click(selector, offset=(text.index(word) + 1, 0))
    await pilot.pause(0.1)


@run_async
async def test_marks_from_the_files_are_shown_as_text_and_never_act(tmp_path):
    run = craft(str(tmp_path / "trust"))
    app = build_app(replay_dir=run, host=cpu_host())
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.board.finished is not None and len(app.screen.query(RunCard)) == 3)
        await wait_for(pilot, lambda: "boom" in shown(app, "#title"))
        assert f"smoke {SHOWN} (recorded)" in shown(app, "#title"), shown(app, "#title")
        await click_on(pilot, app, "#title", "boom")
        assert app.is_running and isinstance(app.screen, DashboardScreen)
        # the console pane: a rank's line, the failure and its traceback, each as text
        await pilot.press("left")  # from ddp round to the last run, the failed one
        await wait_for(pilot, lambda: app.screen.selected == "fsdp2-fault"
                       and f"fsdp2-fault failed: RuntimeError: {SHOWN}" in log_text(app))
        text = log_text(app)
        assert f"[rank0] console {SHOWN}" in text and f"ValueError: {SHOWN}" in text, text
        assert "\x1b" not in text and "\x07" not in text
        # a notice (a toast and the status bar) quoting a file
        app.board.ingest([Notice(f"ddp: disk {MARK}", "warning")])
        await wait_for(pilot, lambda: f"ddp: disk {SHOWN}" in shown(app, "#status"))
        await pilot.press("right", "l", "l", "t", "t", "b")
        assert app.is_running and isinstance(app.screen, DashboardScreen)
        # the report screen: the summary's preset, answer and rows
        await pilot.press("o")
        await wait_for(pilot, lambda: isinstance(app.screen, ReportScreen) and "boom" in shown(app, "#title"))
        assert f"report · smoke {SHOWN} · baseline ddp" in shown(app, "#title"), shown(app, "#title")
        answer = shown(app, "#report-recommendation")
        assert f"fastest run: ddp {SHOWN}" in answer and f"left out of the recommendation ({SHOWN})" in answer, answer
        table = app.screen.query_one("#report-table")
        assert table.row_count == 3 and str(table.get_row_at(2)[0]) == "fsdp2-fault"
        await click_on(pilot, app, "#title", "boom")
        assert app.is_running and isinstance(app.screen, ReportScreen)
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, DashboardScreen))
        assert app.is_running
        await pilot.press("q")  # a finished replay quits without asking
        await wait_for(pilot, lambda: not app.is_running)


def _damage(run: str, how: str) -> None:
    if how == "comparison-deep":
        with open(os.path.join(run, "comparison.json"), "w") as fh:
            fh.write("[" * 100000 + "]" * 100000)
    elif how == "summary-cut":
        path = os.path.join(run, "summary.json")
        with open(path) as fh:
            text = fh.read()
        with open(path, "w") as fh:
            fh.write(text[: len(text) // 2])
    elif how == "records":
        with open(os.path.join(run, "ddp", "metrics", "rank0.jsonl"), "a") as fh:
            fh.write('{"kind":"step","t":"soon"}\n')  # not a record: counted, skipped
            fh.write('{"v":1,"kind":"step","run":"ddp","rank":0,"t":1700000100.0,"step":30,"loss":0.5,'
                     '"tokens_per_s":"fast"}\n')  # a record whose figure is no number
    else:
        path = os.path.join(run, "summary.json")
        with open(path) as fh:
            summary = json.load(fh)
        summary["runs"][0].update(median_tokens_per_s="fast", tokens_per_s="fast", peak_mem_bytes="big",
                                  final_loss="low", speedup=[1])
        if how == "summary-rows":
            summary["runs"].insert(0, "not a run")  # the replay reads the runs in order: it stops here
        with open(path, "w") as fh:
            json.dump(summary, fh)


# (how the directory is damaged, what the dashboard's status line says, what the report screen says)
DAMAGE = [
    ("comparison-deep", "comparison.json unreadable: nested too deeply", "From "),
    ("summary-cut", "summary.json unreadable: ", "summary.json unreadable: "),
    ("records", "unreadable", "From "),
    ("summary-numbers", "finished — press o for the report", "From "),
    ("summary-rows", "unreadable, the replay stopped: ", "From "),
]


@pytest.mark.parametrize("how,status,note", DAMAGE, ids=[d[0] for d in DAMAGE])
@run_async
async def test_an_unreadable_file_is_said_never_a_crash_or_an_empty_screen(tmp_path, how, status, note):
    run = str(tmp_path / "run")
    shutil.copytree(FIXTURE, run)
    _damage(run, how)
    app = build_app(replay_dir=run, host=cpu_host())
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, DashboardScreen) and app.source is not None
                       and app.source.finished and status in shown(app, "#status"))
        if how == "records":
            said = " ".join(n.text for n in app.board.notices)
            assert "ddp: 1 line(s) of its record files unreadable, skipped" in said, said
            assert "ddp: 1 record(s) unreadable, left out: ValueError" in said, said
        await pilot.press("o")
        await wait_for(pilot, lambda: isinstance(app.screen, ReportScreen) and note in shown(app, "#report-note"))
        if how.startswith("summary-") and how != "summary-cut":
            row = [str(c) for c in app.screen.query_one("#report-table").get_row_at(0)]
            assert row[0] == "ddp (baseline)" and row[5:8] == ["–", "–", "-"] and row[10] == "–", row
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, DashboardScreen))
        assert app.is_running
        await pilot.press("q")
        await wait_for(pilot, lambda: not app.is_running)
