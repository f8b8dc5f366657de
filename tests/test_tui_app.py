"""Pilot tests of the app: presets and knobs, launching, live dashboard, failures, stop/restart/quit."""

from __future__ import annotations

import os

import pytest

from shardscope.config import cpu_host
from shardscope.orchestrator.replay import ReplaySource
from shardscope.tui.app import build_app
from shardscope.tui.screens.dashboard import DashboardScreen
from shardscope.tui.screens.dialogs import ConfirmQuit, TooSmall
from shardscope.tui.screens.presets import PresetsScreen
from shardscope.tui.screens.report import ReportScreen
from shardscope.tui.widgets.charts import StepChart
from shardscope.tui.widgets.log_pane import LogPane
from shardscope.tui.widgets.run_card import RunCard
from tui_fakes import FIXTURE, FakeReplaySource, click_until, run_async

SIZE = (160, 48)


def replay_factory(comparison, out_dir):
    """Launching from the presets screen replays the recorded fixture instead of starting torchrun."""
    return ReplaySource(FIXTURE)


async def wait_for(pilot, predicate, timeout: float = 60.0) -> None:
    """Let the app run until ``predicate()`` holds (or fail after ``timeout`` seconds: a bound for a hang, not a
    timing; a loaded machine only makes it wait longer)."""
    for _ in range(int(timeout / 0.05)):
        if predicate():
            return
        await pilot.pause(0.05)
    raise AssertionError("condition not reached in time")


def rich_text(renderable) -> str:
    """Return what a Rich renderable prints, as plain text."""
    from rich.console import Console

    console = Console(width=100, record=True, file=open(os.devnull, "w"))
    console.print(renderable)
    return console.export_text()


def log_text(app) -> str:
    return "\n".join(line.text for line in app.screen.query_one(LogPane).lines)


@run_async
async def test_presets_knobs_validation_and_launch(tmp_path):
    app = build_app(host=cpu_host(), source_factory=replay_factory, out_dir=str(tmp_path / "out"))
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        assert isinstance(screen, PresetsScreen)
        assert screen.preset == "smoke"  # the default on a machine without a GPU
        assert "No GPU here" not in str(screen.query_one("#preset-desc").render())  # smoke has no cpu_overrides
        assert screen.choose("ddp-vs-fsdp")  # its description gives the full sizes; the CPU run is shrunk
        desc = str(screen.query_one("#preset-desc").render())
        assert "No GPU here: its [cpu_overrides] shrink it (steps 20, d_model 256," in desc, desc
        assert screen.choose("smoke")
        steps = screen.query_one("#knob-steps")
        steps.value = "0"
        await pilot.pause()
        error = str(screen.query_one("#knob-steps-error").render())
        assert "--set steps=0: must be > 0" in error
        assert screen.query_one("#launch").disabled
        steps.value = "12"
        screen.query_one("#knob-world-size").value = "3"
        await pilot.pause()
        # The global batch follows a world size changed alone (8 at 2 ranks -> 12 at 3): no error.
        assert str(screen.query_one("#knob-world-size-error").render()) == ""
        assert screen.comparison is not None and screen.comparison.global_batch == 12
        screen.query_one("#knob-world-size").value = "0"
        await pilot.pause()
        assert "--set world_size=0: must be > 0" in str(screen.query_one("#knob-world-size-error").render())
        assert str(screen.query_one("#knob-steps-error").render()) == ""
        screen.query_one("#knob-world-size").value = "4"
        screen.query_one("#knob-model-d-model").value = "30"  # 4 heads do not divide 30
        await pilot.pause()
        assert "must divide model.d_model" in str(screen.query_one("#knob-model-d-model-error").render())
        screen.query_one("#knob-model-d-model").value = "64"
        await pilot.pause()
        assert screen.comparison is not None and screen.comparison.steps == 12
        assert screen.overrides == ["steps=12", "world_size=4"]
        assert "--set steps=12" in str(screen.query_one("#cli-line").render())
        await pilot.click("#launch")
        await wait_for(pilot, lambda: isinstance(app.screen, DashboardScreen) and app.board.finished is not None)
        loss = app.screen.query_one("#loss-chart", StepChart)
        # redraws are rate-limited by their own render time: wait for the last records to be drawn
        await wait_for(pilot, lambda: [len(s.xs) for s in loss._series] == [30, 30, 12]
                       and len(app.screen.query(RunCard)) == 3)
        assert [c.run for c in app.screen.query(RunCard)] == ["ddp", "fsdp2", "fsdp2-fault"]
        assert {n: s.status for n, s in app.board.states.items()} == {"ddp": "ok", "fsdp2": "ok", "fsdp2-fault": "failed"}
        loss = app.screen.query_one("#loss-chart", StepChart)
        assert loss.redraws >= 1 and [len(s.xs) for s in loss._series] == [30, 30, 12]


@run_async
async def test_user_preset_file_errors_inline(tmp_path):
    bad = tmp_path / "mine.toml"
    bad.write_text('steps = "many"\n[[runs]]\nname = "a"\nstrategy = "ddp"\n')
    good = tmp_path / "good.toml"
    good.write_text('description = "mine"\nsteps = 3\n[[runs]]\nname = "a"\nstrategy = "ddp"\n')
    app = build_app(host=cpu_host())
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        await pilot.click("#preset-path")
        await pilot.press(*str(bad), "enter")
        await pilot.pause()
        assert "steps = 'many': expected an integer" in str(screen.query_one("#preset-path-error").render())
        assert screen.preset == "smoke"
        screen.query_one("#preset-path").value = str(good)
        await pilot.press("enter")
        await pilot.pause()
        assert screen.preset == str(good) and screen.comparison.steps == 3
        assert str(screen.query_one("#preset-path-error").render()) == ""
        # Out of the text box once the file is open, on its line in the list: `s` starts it, not types an "s"
        assert app.focused is screen.query_one("#preset-list") and screen.query_one("#preset-path").value == str(good)


@run_async
async def test_question_mark_lists_every_key_of_the_screen():
    """`?` shows the current screen's keys, each with what it does (Textual's HelpPanel), and hides them again; the
    footer says so on every screen."""
    from textual.widgets import HelpPanel

    app = build_app(replay_dir=FIXTURE, host=cpu_host())
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, DashboardScreen) and app.board.finished is not None)
        shown = {b.key for _, b, enabled, _ in app.screen.active_bindings.values() if b.show}
        assert {"t", "i", "w", "question_mark"} <= shown, shown  # every key of the dashboard in its footer
        await pilot.press("question_mark")
        await wait_for(pilot, lambda: bool(app.screen.query(HelpPanel)))
        await pilot.press("question_mark")
        await wait_for(pilot, lambda: not app.screen.query(HelpPanel))


@run_async
async def test_replay_dashboard_failed_run_traceback_and_report():
    app = build_app(replay_dir=FIXTURE, host=cpu_host())
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.board.finished is not None)
        await pilot.pause(0.3)
        assert isinstance(app.screen, DashboardScreen)
        assert app.screen.selected == "ddp"
        await click_until(pilot, "#card-2", lambda: app.screen.selected == "fsdp2-fault")  # the failed run
        text = log_text(app)
        assert "fsdp2-fault failed: RuntimeError: injected fault at step 12 on rank 1" in text
        assert 'raise RuntimeError(f"injected fault' in text
        await pilot.press("right")
        assert app.screen.selected == "ddp"
        await pilot.press("l")
        assert not app.screen.query_one(LogPane).display
        await pilot.press("o")
        await pilot.pause()
        assert isinstance(app.screen, ReportScreen)
        table = app.screen.query_one("#report-table")
        assert table.row_count == 3
        assert "summary.json" in str(app.screen.query_one("#report-paths").render())
        await pilot.press("escape")
        assert isinstance(app.screen, DashboardScreen)
        await pilot.press("q")  # a finished replay quits without asking
        await pilot.pause()
    assert app.return_code in (0, None)


@run_async
async def test_baseline_switch_redraws_difference_chart():
    app = build_app(replay_dir=FIXTURE, host=cpu_host())
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.board.finished is not None)
        await pilot.press("right", "b")
        diff = app.screen.query_one("#diff-chart", StepChart)
        await wait_for(pilot, lambda: app.board.baseline == "fsdp2" and diff.title == "loss − fsdp2"
                       and [s.label for s in diff._series] == ["ddp", "fsdp2-fault"])


@run_async
async def test_stop_restart_and_quit_with_active_runs(tmp_path):
    fake = FakeReplaySource(fraction=0.5)
    app = build_app(host=cpu_host(), source_factory=lambda c, out: fake, out_dir=str(tmp_path))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.click("#launch")
        await wait_for(pilot, lambda: app.board.active == ["ddp", "fsdp2", "fsdp2-fault"])
        await pilot.pause(0.2)
        await pilot.press("x")
        await wait_for(pilot, lambda: fake.calls)
        assert fake.calls == [("stop_run", "ddp")]
        await pilot.press("r")
        assert fake.calls[-1] == ("restart_run", "ddp")
        await pilot.press("q")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmQuit)
        await pilot.press("n")
        await pilot.pause()
        assert isinstance(app.screen, DashboardScreen) and app.is_running
        await pilot.press("q")
        await pilot.pause()
        await pilot.press("y")
        await wait_for(pilot, lambda: not app.is_running)
    assert ("stop_all", "") in fake.calls


@run_async
async def test_threaded_source_posts_batches_to_the_ui_thread():
    fake = FakeReplaySource(threaded=True, batch=5, delay_s=0.005)
    app = build_app(replay_dir=FIXTURE, source_factory=lambda c, out: fake, host=cpu_host())
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.board.finished is not None)
        await pilot.pause(0.3)
        assert app.board.records == sum(1 for _ in _all_records())
        charts = app.screen.query(StepChart)
        assert all(c.redraws >= 1 for c in charts)


def _all_records():
    from shardscope.core.events import read_records

    for run in ("ddp", "fsdp2", "fsdp2-fault"):
        for rank in (0, 1):
            yield from read_records(os.path.join(FIXTURE, run, "metrics", f"rank{rank}.jsonl"))[0]


@pytest.mark.parametrize("size", [(80, 24), (100, 30)])
@run_async
async def test_small_terminals_work(size):
    app = build_app(replay_dir=FIXTURE, host=cpu_host())
    async with app.run_test(size=size) as pilot:
        await wait_for(pilot, lambda: app.board.finished is not None)
        await pilot.pause(0.3)
        assert isinstance(app.screen, DashboardScreen)


def _text_of(widget) -> str:
    """What a widget shows on screen (border and all), as plain lines."""
    from textual.geometry import Region

    return "\n".join(strip.text for strip in widget.render_lines(Region(0, 0, *widget.size)))


@run_async
async def test_readable_at_100_by_30_and_s_in_a_replay_says_why_nothing_starts():
    """At 100x30 a card shows its loss, labelled median throughput and peak RSS whole; the communication panel
    abbreviates collective names by rule with their legend whole and scrolls to every run's rows; `s` in a replay explains itself."""
    from shardscope.tui.widgets.comm_panel import CommPanel

    app = build_app(replay_dir=FIXTURE, host=cpu_host())
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.board.finished is not None)
        await wait_for(pilot, lambda: app.screen.query("#card-0") and "peak RSS" in str(app.screen.query_one("#card-0").render()))
        card = app.screen.query_one("#card-0")
        text = str(card.render())
        assert "0.8694" in text and "median tokens/s" in text and "5.2k" in text and "…" not in text, text
        # A run's options take a line of their own (its bar gives way) rather than being cut.
        text = str(app.screen.query_one("#card-2").render())
        assert "reshard_after_forward=False" in text and "peak RSS" in text and "…" not in text, text
        comm = app.screen.query_one(CommPanel)
        # Every run's rows are there, the panel scrolls to them; the abbreviations' legend is whole, on the
        # border where it fits, else as the panel's last line.
        # The panel redraws on the app's refresh tick after the replay is folded: wait until every run's rows
        # are drawn (CI under load once read it after the first two runs' rows only).
        await wait_for(pilot, lambda: "RS reduce-scatter" in _text_of(comm.body) + str(comm.border_subtitle)
                       and "fsdp2-fault not measured" in _text_of(comm.body))
        body = _text_of(comm.body)
        # Its size follows the new rows on the next layout pass: wait for it (fails if the rows never overflow).
        await wait_for(pilot, lambda: comm.body.size.height > comm.scrollable_content_region.height)
        assert comm.allow_vertical_scroll, body
        assert "reduce-scatter" not in str(comm.border_subtitle) or "…" not in str(comm.border_subtitle)
        assert " RS " in body and "fsdp2-fault not measured" in body and "AR all-reduce" in body, body
        # Run names are whole in the communication panel (each run heads its own rows) and the column
        # header is not cut; the status bar does not repeat the launch command.
        # A replay without device samples says none were recorded, not that they will arrive.
        await wait_for(pilot, lambda: "No device samples were recorded" in rich_text(app.screen.devices.content))
        # Figures as a live run has them: exposed time and the theory ratio beside each run's name.
        board = app.board
        for n in board.names:
            analysis = board.analyses.setdefault(n, {})
            analysis["theory"] = {"ratio": 1.0}
            st = board.states[n]
            if st.comm:
                st.comm = {r: {**rec, "per_step": {"exposed_comm_s": 0.0307}} for r, rec in st.comm.items()}
            else:
                analysis["per_step"] = {"exposed_comm_s": 0.0307}
        app.redraw(force=True)
        await wait_for(pilot, lambda: "30.7ms" in _text_of(comm.body))
        shown = _text_of(comm.body)
        for run in ("ddp", "fsdp2"):
            assert f"■ {run} 30.7ms" in shown and "1.00×" in shown, shown
        assert "…" not in "".join(shown.splitlines()[1:3]), shown
        from shardscope.profiling.state import Notice

        board.notices += [Notice("ddp: disk is filling", "warning"),
                          Notice("fsdp2: OMP_NUM_THREADS=1 python -m torch.distributed.run --nnodes 1")]
        app.screen._draw_status(board, True)
        await pilot.pause(0.1)
        status = str(app.screen.query_one("#status").render())
        assert "torch.distributed.run" not in status and "ddp: disk is filling" in status, status
        notes = []
        app.notify = lambda message, **kw: notes.append(message)
        await pilot.press("s")
        await wait_for(pilot, lambda: notes)
        assert notes[0].startswith("This is a recorded comparison (shardscope open): it replays")


@run_async
async def test_too_small_notice_comes_and_goes():
    app = build_app(replay_dir=FIXTURE, host=cpu_host())
    async with app.run_test(size=(70, 20)) as pilot:
        def says_too_small() -> bool:
            # The notice may be pushed but not composed yet: its text widget is then still missing.
            found = app.screen.query("#too-small-text") if isinstance(app.screen, TooSmall) else []
            return any("Terminal too small: 70×20" in str(w.render()) for w in found)
        await wait_for(pilot, says_too_small)
        await pilot.resize_terminal(120, 40)
        await wait_for(pilot, lambda: isinstance(app.screen, DashboardScreen))
        # The redraw timer can update a notice pushed but not composed yet (CI's floor suite crashed the app
        # that way: NoMatches for its text): then there is nothing to update, and mounting shows the size.
        notice = TooSmall((200, 60))
        notice.show_size()
        assert not notice.query("#too-small-text")


@run_async
async def test_command_palette_lists_the_app_actions():
    app = build_app(replay_dir=FIXTURE, host=cpu_host())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        titles = {c.title for c in app.get_system_commands(app.screen)}
        assert {"Start", "Stop run", "Restart run", "Set baseline", "Toggle log", "Report", "Export", "Quit"} <= titles


@run_async
async def test_export_writes_screenshot_and_copies_paths(tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE, run_dir)
    app = build_app(replay_dir=str(run_dir), host=cpu_host())
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.board.finished is not None)
        await pilot.press("e")
        await pilot.pause()
        assert (run_dir / "shardscope-dashboard.svg").is_file()
        assert str(run_dir / "summary.json") in app.clipboard


@run_async
async def test_export_never_writes_through_a_link(tmp_path):
    """A symlink planted where the screenshot goes is replaced, never written through (Textual's own writer
    followed it out of the directory)."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE, run_dir)
    outside = tmp_path / "not-yours.svg"
    outside.write_text("keep me")
    (run_dir / "shardscope-dashboard.svg").symlink_to(outside)
    app = build_app(replay_dir=str(run_dir), host=cpu_host())
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.board.finished is not None)
        await pilot.press("e")
        await wait_for(pilot, lambda: not (run_dir / "shardscope-dashboard.svg").is_symlink())
    assert outside.read_text() == "keep me"
    assert (run_dir / "shardscope-dashboard.svg").read_text().startswith("<svg")


@run_async
async def test_device_panel_labels_gpus_with_run_and_ranks():
    from shardscope.profiling import state as st
    from shardscope.tui.messages import UpdatesArrived

    app = build_app(replay_dir=FIXTURE, host=cpu_host())
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.board.finished is not None)
        sample = st.DeviceSample((
            st.DeviceReading("GPU0 NVIDIA H100", "gpu", 40 * 2**30, 80 * 2**30, 97.0, 512.0, run="ddp", ranks=(0, 1)),
            st.DeviceReading("GPU1 NVIDIA H100", "gpu", 1 * 2**30, 80 * 2**30, 0.0, 70.0),
        ), "nvml")
        app.post_message(UpdatesArrived([sample]))
        await wait_for(pilot, lambda: "ddp ranks 0,1" in rich_text(app.screen.devices.content))
        text = rich_text(app.screen.devices.content)
        assert "GPU0 NVIDIA H100" in text and "ddp ranks 0,1" in text and "idle" in text
        assert "40.0 GiB/80.0 GiB" in text and "97%" in text


@run_async
async def test_report_screen_sets_each_runs_prediction_beside_its_measurement(tmp_path):
    import json
    import shutil

    out = tmp_path / "replay"
    shutil.copytree(FIXTURE, out)
    summary = json.loads((out / "summary.json").read_text())
    summary["prediction"] = {
        "calibrated_on": "this comparison's other runs (each run predicted from all the others, never from itself)",
        "runs": {"ddp": {"tokens_per_s": 5200.0, "measured_tokens_per_s": 5210.0, "error": -0.002,
                         "calibration_run": False, "bound": None, "measured_spread": 0.031},
                 "fsdp2": {"tokens_per_s": 6000.0, "measured_tokens_per_s": 4700.0, "error": 6000 / 4700 - 1,
                           "calibration_run": False, "bound": "upper"},
                 "fsdp2-fault": {"why": "no fully-sharded run calibrated"}}}
    (out / "summary.json").write_text(json.dumps(summary))
    app = build_app(replay_dir=str(out), host=cpu_host())
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.board.finished is not None)
        await pilot.press("o")
        await wait_for(pilot, lambda: isinstance(app.screen, ReportScreen))
        text = str(app.screen.query_one("#report-prediction").render())
        assert "Predicted beside measured" in text
        assert "ddp: predicted 5,200 tokens/s, measured 5,210 (-0.2%; its own spread ±3.1%)" in text
        # a bound is shown as the bound it is, held or broken, never as an error
        assert "fsdp2: predicted ≤ 6,000 tokens/s, measured 4,700 (upper bound, held: measured 22% below it)" in text
        assert "fsdp2-fault: not predicted: no fully-sharded run calibrated" in text


@run_async
async def test_console_says_when_the_ranks_printed_nothing():
    """The console pane promises the ranks' output after the launch line; a run that ended without printing
    says so instead of leaving the promise open, and one that printed does not."""
    from textual.app import App

    from shardscope.profiling.state import RunState
    from shardscope.tui.board import Console

    class One(App):
        def compose(self):
            yield LogPane()

    app = One()
    async with app.run_test(size=(100, 20)) as pilot:
        pane = app.query_one(LogPane)
        console = Console()
        console.add("$ OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc-per-node 2 -m shardscope.engines.worker x\n")
        run = RunState(name="ddp", strategy="ddp", status="running")
        pane.follow("ddp", console, run)
        run.status = "ok"
        pane.show(console, run)
        pane.show(console, run)
        await pilot.pause()
        text = "\n".join(line.text for line in pane.lines)
        assert text.count("(no output from the ranks; ddp ended ok)") == 1, text
        console.add("[rank0] hello\n")
        pane.follow("ddp", console, run)
        await pilot.pause()
        assert "no output from the ranks" not in "\n".join(line.text for line in pane.lines)


def test_a_card_lists_only_the_options_a_run_changed():
    """A live run's start record lists every option with its default; the card shows what differs."""
    from shardscope.core import registry
    from shardscope.tui.widgets.run_card import chosen_options

    defaults = {k: spec.default for k, spec in registry.STRATEGIES["fsdp2"].options.items()}
    assert chosen_options("fsdp2", defaults) == {}
    assert chosen_options("fsdp2", {**defaults, "reshard_after_forward": False}) == {"reshard_after_forward": False}
    assert chosen_options("no-such-strategy", {"x": 1}) == {"x": 1}


@run_async
async def test_an_empty_chart_says_what_it_waits_for_even_when_narrow():
    """plotext drops a title wider than its chart; an empty chart says its title and what it waits for."""
    from textual.app import App

    class One(App):
        def compose(self):
            yield StepChart("loss − ddp", empty="waiting for steps of two runs")

    app = One()
    async with app.run_test(size=(32, 12)) as pilot:
        await pilot.pause()
        shown = _text_of(app.query_one(StepChart))
        assert "loss − ddp by step" in shown and "waiting for steps of two runs" in shown, shown
