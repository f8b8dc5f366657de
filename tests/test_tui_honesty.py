"""The app, honestly: it refuses an output directory that holds a comparison, keeps each run's last
device readings and peaks after the run ends, and labels tiny differences in scientific notation."""

from __future__ import annotations

import os
import re

from shardscope import config
from shardscope.config import cpu_host
from shardscope.profiling import state as st
from shardscope.tui.app import build_app
from shardscope.tui.messages import UpdatesArrived
from shardscope.tui.screens.presets import PresetsScreen
from shardscope.tui.widgets.charts import step_ticks, y_ticks
from shardscope.core.numbers import fmt_sig
from tui_fakes import FIXTURE, run_async
from _pilot import wait_for

SIZE = (160, 48)


def rich_text(renderable) -> str:
    from rich.console import Console

    console = Console(width=120, record=True, file=open(os.devnull, "w"))
    console.print(renderable)
    return console.export_text()


@run_async
async def test_app_refuses_an_output_directory_that_holds_a_comparison(tmp_path):
    out = tmp_path / "used"
    out.mkdir()
    config.dump_json(out / "comparison.json", {"name": "earlier"})
    started = []

    def factory(comparison, out_dir):
        started.append(out_dir)
        raise AssertionError("no source may start in a used directory")

    app = build_app(host=cpu_host(), source_factory=factory, out_dir=str(out))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.screen.query("#launch"))
        await pilot.click("#launch")
        await wait_for(pilot, lambda: "already holds" in str(app.screen.query_one("#preset-error").render()))
        assert isinstance(app.screen, PresetsScreen) and started == []
        message = str(app.screen.query_one("#preset-error").render())
        assert f"{out}: already holds a comparison; choose a new directory" in message
        assert (out / "comparison.json").read_text().count("earlier") == 1  # untouched
        assert not (out / "init.safetensors").exists()


@run_async
async def test_device_panel_keeps_last_readings_and_peaks_after_runs_end():
    app = build_app(replay_dir=FIXTURE, host=cpu_host())
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.board.finished is not None)
        rss = [st.DeviceSample((st.DeviceReading("ddp rank 0 (process RSS)", "process", used, run="ddp", ranks=(0,)),),
                               "process-rss") for used in (300 * 2**20, 500 * 2**20, 400 * 2**20)]
        later = st.DeviceSample((st.DeviceReading("fsdp2 rank 0 (process RSS)", "process", 200 * 2**20, run="fsdp2",
                                                  ranks=(0,)),), "process-rss")
        app.post_message(UpdatesArrived([*rss, later]))
        # "rank 0" or, by rule where the whole label does not fit, "r0"
        await wait_for(pilot, lambda: re.search(r"fsdp2 r(ank )?0", rich_text(app.screen.devices.content)))
        text = rich_text(app.screen.devices.content)
        assert "No device samples yet" not in text
        assert re.search(r"fsdp2 r(ank )?0 +200\.0 MiB ↑200\.0 MiB", text), text
        assert re.search(r"ddp r(ank )?0 ended +400\.0 MiB ↑500\.0 MiB", text), text  # last reading, peak


def test_chart_axis_labels_tiny_differences_in_scientific_notation():
    ticks = y_ticks([0.0, 1.1920929e-7, 5.96e-8])
    labels = [fmt_sig(t) for t in ticks]
    assert labels[0] == "0" and labels[-1] == "1.19e-07" and len(labels) == 5
    assert all("0.0000" not in label for label in labels)
    assert y_ticks([]) == [] and y_ticks([2.0, 2.0]) == [2.0]
    # steps are whole numbers: a 3-step run's axis reads 0 1 2, not 0.00 0.50 ... 2.00
    assert step_ticks([0, 1, 2]) == [0, 1, 2] and step_ticks([]) == [] and step_ticks([5]) == [5]
    assert step_ticks(list(range(0, 100))) == [0, 25, 50, 75] and step_ticks([3, 10]) == [3, 5, 7, 9]


def test_difference_chart_never_calls_nan_identical():
    from shardscope.tui.widgets.charts import diff_note

    nan = float("nan")
    assert diff_note({"fsdp2": [(0, 0.0), (1, 0.0), (2, nan)]}) == " (non-finite from step 2)"
    assert diff_note({"fsdp2": [(0, 0.0), (1, 0.0)]}) == " (identical)"
    assert diff_note({"fsdp2": [(0, 0.0), (1, 1e-7)]}) == ""


@run_async
async def test_app_refuses_a_directory_short_of_space(tmp_path):
    """Started from the app, a comparison whose traces cannot fit is refused as the headless command does."""
    import subprocess

    import pytest

    point = tmp_path / "small"
    point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(point)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        started = []

        def factory(comparison, out_dir):
            started.append(out_dir)
            raise AssertionError("no source may start without room for its files")

        app = build_app(host=cpu_host(), source_factory=factory, out_dir=str(point / "out"))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.screen.query("#launch"))
            await pilot.click("#launch")
            await wait_for(pilot, lambda: " free, " in str(app.screen.query_one("#preset-error").render()))
            assert isinstance(app.screen, PresetsScreen) and started == []
            message = str(app.screen.query_one("#preset-error").render())
            assert " free, the comparison needs about" in message, message
    finally:
        subprocess.run(["umount", str(point)], check=False)


@run_async
async def test_device_rows_keep_every_rank_and_scroll_at_100_by_30():
    """Four ranks of a long-named run and two of another at 100x30: each row keeps its rank (the run's name
    gives way), and the panel scrolls to the rows that do not fit."""
    app = build_app(replay_dir=FIXTURE, host=cpu_host())
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.board.finished is not None)
        readings = tuple(st.DeviceReading(f"fsdp2-hybrid-sharded rank {r} (process RSS)", "process", (300 + r) * 2**20,
                                          run="fsdp2-hybrid-sharded", ranks=(r,)) for r in range(4))
        readings += tuple(st.DeviceReading(f"ddp rank {r} (process RSS)", "process", 250 * 2**20, run="ddp",
                                           ranks=(r,)) for r in range(2))
        app.post_message(UpdatesArrived([st.DeviceSample(readings, "process-rss")]))
        await wait_for(pilot, lambda: "ddp r1" in rich_text(app.screen.devices.content))
        lines = rich_text(app.screen.devices.content).splitlines()
        for r in range(4):
            row = next(line for line in lines if f"… r{r} " in line or f"fsdp2-hybrid-sharded r{r} " in line)
            assert f"{300 + r}.0 MiB" in row, row
        panel = app.screen.devices
        # The body's size follows its new content on the next layout pass, not at once (CI under load once read
        # the old two-line size): wait for the layout, which fails the test if the rows never overflow.
        await wait_for(pilot, lambda: panel.body.size.height > panel.scrollable_content_region.height)
        assert panel.allow_vertical_scroll


@run_async
async def test_a_panel_updated_before_its_body_is_mounted_or_after_it_is_gone_keeps_the_content():
    """A redraw timer can reach a panel while its screen composes or tears down (CI, loaded machine: NoMatches
    '.panel-body' killed the app). The content is kept, shown once the body exists, and never an error."""
    from textual.app import App

    from shardscope.tui.widgets.scroll_panel import ScrollPanel

    panel = ScrollPanel()
    panel.update("early")  # not mounted: no body yet
    assert panel.content == "early"

    class Host(App):
        def compose(self):
            yield panel

    app = Host()
    async with app.run_test(size=(40, 10)) as pilot:
        await pilot.pause()
        assert str(panel.body.content) == "early"
        panel.update("later")
        assert str(panel.body.content) == "later"
        await panel.remove()
        panel.update("gone")  # removed: kept, no error
        assert panel.content == "gone"
