"""The first hour in the app (issue 45): the report screen's table at 100 and 160 columns has no header or value
cut, every header its full name or the abbreviation ``report_columns.ABBREVIATIONS`` gives it, and `?` lists those
abbreviations; the preset list offers ``first-look`` (a minute to watch) right under the quick default."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from textual.widgets import DataTable, HelpPanel

from shardscope.config import cpu_host
from shardscope.tui.app import build_app
from shardscope.tui.screens import report_columns
from shardscope.tui.screens import presets
from shardscope.tui.screens.presets import PresetsScreen
from shardscope.tui.screens.report import ReportScreen
from _pilot import wait_for
from tui_fakes import FIXTURE, run_async

FULL = ("run", "strategy", "ranks", "status", "steps", "final loss", "tokens/s (median)", "peak RSS (process)",
        "Δloss max", "Δloss mean", "speedup", "model-state ratio")


def _long_names(tmp_path) -> str:
    """The recorded smoke comparison with fsdp-impls' long names, an A/A control and process RSS in its summary:
    the widest table a built-in preset makes."""
    run = str(tmp_path / "run")
    shutil.copytree(FIXTURE, run)
    with open(f"{run}/summary.json", encoding="utf-8") as fh:
        summary = json.load(fh)
    first = summary["runs"][0]
    names = [("ddp-fp32", "ddp"), ("handwritten-bf16", "fsdp-handwritten"), ("fsdp1-ac-no-limit", "fsdp1")]
    for entry, (name, strategy) in zip(summary["runs"], names):
        entry.update(name=name, strategy=strategy, peak_mem_kind="process RSS")
    summary["runs"].append({**first, "name": "ddp-fp32.again", "control_of": "ddp-fp32", "steps_completed": 10})
    summary["baseline"] = "ddp-fp32"
    with open(f"{run}/summary.json", "w", encoding="utf-8") as fh:
        json.dump(summary, fh)
    return run


async def _open_report(pilot) -> ReportScreen:
    app = pilot.app
    await wait_for(pilot, lambda: app.board.finished is not None)
    await pilot.press("o")
    await wait_for(pilot, lambda: isinstance(app.screen, ReportScreen) and app.screen.query_one(DataTable).row_count)
    await pilot.pause(0.3)
    return app.screen


def _shown_tables(screen: ReportScreen) -> list[DataTable]:
    return [t for t in screen.query(DataTable).results(DataTable) if t.display]


def _assert_nothing_cut(screen: ReportScreen) -> list[str]:
    """Every table fits its width, and its rendered header and rows hold each label and value whole; return the
    headers shown."""
    full = screen.headers
    shown = []
    for table in _shown_tables(screen):
        assert table.virtual_size.width <= table.scrollable_content_region.width, (table.id, table.virtual_size)
        labels = [str(c.label) for c in table.columns.values()]
        header = table.render_line(0).text
        at = 0
        for label in labels:
            assert label in {h for f in full for h in (f, report_columns.short(f))}, label
            at = header.index(f" {label} ", at) + len(label)  # whole, in order, a space either side
        for y in range(table.row_count):
            line = table.render_line(1 + y).text
            assert all(str(cell) in line for cell in table.get_row_at(y)), (line, table.get_row_at(y))
        shown += labels
    return shown


@pytest.mark.parametrize("size", [(100, 30), (160, 48)], ids=["100x30", "160x48"])
@pytest.mark.parametrize("long_names", [False, True], ids=["smoke", "long-names"])
@run_async
async def test_no_header_or_value_cut(size, long_names, tmp_path):
    app = build_app(replay_dir=_long_names(tmp_path) if long_names else FIXTURE, host=cpu_host())
    async with app.run_test(size=size) as pilot:
        screen = await _open_report(pilot)
        shown = _assert_nothing_cut(screen)
        assert len(shown) == 12 + (len(_shown_tables(screen)) - 1), shown  # each column once, the run one per table
        if long_names:
            assert screen.headers == FULL
            rows = [str(t.get_row_at(3)[0]) for t in _shown_tables(screen)]
            assert rows and all(r in ("ddp-fp32.again (A/A control)", "ddp-fp32.again (A/A)") for r in rows), rows


@run_async
async def test_laid_out_again_when_the_terminal_is_resized(tmp_path):
    app = build_app(replay_dir=_long_names(tmp_path), host=cpu_host())
    async with app.run_test(size=(100, 30)) as pilot:
        screen = await _open_report(pilot)
        assert len(_shown_tables(screen)) == 2
        for size, tables in (((160, 48), 1), ((100, 30), 2), ((160, 48), 1)):
            await pilot.resize_terminal(*size)
            await wait_for(pilot, lambda: len(_shown_tables(screen)) == tables)
            await pilot.pause(0.3)
            _assert_nothing_cut(screen)
            assert [str(t.get_row_at(1)[0]) for t in _shown_tables(screen)] == ["handwritten-bf16"] * tables


@run_async
async def test_question_mark_lists_the_abbreviations(tmp_path):
    app = build_app(replay_dir=_long_names(tmp_path), host=cpu_host())
    async with app.run_test(size=(100, 30)) as pilot:
        screen = await _open_report(pilot)
        await pilot.press("question_mark")
        await wait_for(pilot, lambda: screen.query(HelpPanel) and screen.query_one(HelpPanel).has_class("-show-help"))
        await pilot.pause(0.3)
        said = screen.query_one(HelpPanel).query_one("#widget-help").source
        for full in (*FULL, "(baseline)", "(A/A control)"):
            if full in report_columns.ABBREVIATIONS:
                assert f"`{report_columns.short(full)}` = {full}" in said, (full, said)
        # the panel narrows the table: laid out again, abbreviated, every abbreviation on screen among those listed
        shown = [str(c.label) for t in _shown_tables(screen) for c in t.columns.values()]
        assert any(label != full for label, full in zip(shown, FULL)) or len(_shown_tables(screen)) == 2
        assert all(label in said or label in FULL for label in shown), shown


def test_the_rule_abbreviates_no_more_than_it_takes():
    def row(name, strategy, status="ok"):
        return [name, strategy, "2", status, "20", "4.0360", "12.3k", "301.3 MiB", "2.38e-07", "9.93e-08", "0.18×",
                "0.50×"]

    rows = [row("ddp-fp32 (baseline)", "ddp"), row("handwritten-bf16", "fsdp-handwritten"),
            row("fsdp1-ac-no-limit", "fsdp1", "failed"), row("ddp-fp32.again (A/A control)", "ddp")]
    wide = report_columns.layout(FULL, rows, 200)
    assert wide.tables == report_columns.ONE_TABLE and not wide.abbreviated
    for width in (154, 94):  # the table's room at 160 and 100 columns
        chosen = report_columns.layout(FULL, rows, width)
        assert not chosen.over(FULL, rows, width), (width, chosen)
        for dropped in chosen.abbreviated:  # each abbreviation was needed: without it the table is too wide
            assert report_columns.Layout(chosen.tables, chosen.abbreviated - {dropped}).over(FULL, rows, width)
    assert report_columns.layout(FULL, rows, 94).tables == report_columns.TWO_TABLES
    assert report_columns.short_cell("ddp-fp32.again (A/A control)") == "ddp-fp32.again (A/A)"
    app_md = (Path(__file__).resolve().parent.parent / "docs" / "app.md").read_text(encoding="utf-8")
    assert all(f"`{short}`" in app_md for short in report_columns.ABBREVIATIONS.values())  # the docs list them all


@run_async
async def test_first_look_is_offered_right_under_the_default():
    from textual.widgets import OptionList

    app = build_app(host=cpu_host())
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, PresetsScreen) and app.screen.preset)
        listed = app.screen.query_one("#preset-list", OptionList)
        ids = [listed.get_option_at_index(i).id for i in range(listed.option_count)]
        assert app.screen.preset == "smoke" and ids[listed.highlighted] == "smoke"  # the default is unchanged
        assert ids[listed.highlighted + 1] == presets.WATCHABLE == "first-look", ids
        await pilot.press("down")
        await wait_for(pilot, lambda: app.screen.preset == "first-look")
        assert "About a minute on 2 CPU cores" in str(app.screen.query_one("#preset-desc").render())
        assert app.screen.comparison.steps == 300 and [r.name for r in app.screen.comparison.runs] == ["ddp", "fsdp2"]
    gpu = [("ddp-vs-fsdp", ""), ("first-look", ""), ("smoke", "")]
    assert presets.listed(gpu, "ddp-vs-fsdp") == gpu and presets.listed(gpu[:1] + gpu[2:], "smoke") == gpu[:1] + gpu[2:]
    assert [n for n, _ in presets.listed(gpu, "smoke")] == ["ddp-vs-fsdp", "smoke", "first-look"]
