"""Stop and rerun after a comparison ended: the session refuses instead of queueing a request nobody takes, and
the app says what happened and what to do (it used to say "Restarting ddp…" and run nothing)."""

from __future__ import annotations

from shardscope import config
from shardscope.config import ModelSpec, RunSpec, cpu_host
from shardscope.profiling import state
from shardscope.tui.app import build_app
from tui_fakes import FakeReplaySource, run_async

MODEL = ModelSpec(vocab_size=64, d_model=32, n_layers=1, n_heads=2, seq_len=8)


def test_a_session_whose_loop_is_over_refuses_stop_and_restart(tmp_path):
    """A real session stopped before its first run: every run ends ``stopped`` without a torchrun, the summary is
    written, and a later stop or restart answers False (nothing queued) instead of True for nothing."""
    from shardscope.orchestrator.session import Session

    c = config.validate(config.Comparison(name="ended", runs=[RunSpec("ddp", "ddp"), RunSpec("fsdp2", "fsdp2")],
                                          model=MODEL, steps=2, global_batch=4))
    session = Session(c, str(tmp_path / "out"), sample_devices=False)
    assert session.restart_run("ddp") is True  # before the start: queued, taken by the loop
    session.stop_all()  # taken after it, so nothing starts
    seen: list[state.Update] = []
    session.subscribe(seen.extend)
    session.start()
    assert session.wait(120) is not None and session.finished
    assert {n: session.states[n].status for n in session.run_names} == {"ddp": state.STOPPED, "fsdp2": state.STOPPED}
    assert (tmp_path / "out" / "summary.json").exists()
    assert session.restart_run("ddp") is False and session.stop_run("fsdp2") is False
    assert not session._requests  # nothing left behind for a loop that will never run again


@run_async
async def test_r_and_x_after_the_end_say_the_comparison_finished_and_ask_nothing(tmp_path):
    fake = FakeReplaySource()  # plays every run to its end, then the comparison's end
    app = build_app(host=cpu_host(), source_factory=lambda c, out: fake, out_dir=str(tmp_path))
    notes: list[str] = []
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.click("#launch")
        for _ in range(1200):
            if app.board.finished is not None and app.dashboard is not None and app.dashboard.selected:
                break
            await pilot.pause(0.05)
        assert fake.finished and app.dashboard.selected
        app.notify = lambda message, **kw: notes.append(message)
        await pilot.press("r")
        await pilot.press("x")
        await pilot.pause()
    assert not [call for call in fake.calls if call[0] in ("restart_run", "stop_run")], fake.calls
    assert notes[0].startswith("The comparison has finished and its report is written (o opens it)"), notes
    assert "quit (q) and launch it anew" in notes[0]
    assert notes[1].startswith("Nothing to stop: the comparison has finished"), notes


def test_a_run_restarted_while_the_comparison_runs_runs_again_to_its_end(tmp_path):
    """A real session (torchrun, gloo, 2 ranks): ``r`` on a running ddp stops it and runs it again from step 0 to
    ``ok``; ``x`` on the queued fsdp2 skips it. Whether the first attempt was stopped or had already ended when the
    request was taken, ddp runs twice: nothing here depends on timing."""
    from shardscope.orchestrator.session import Session

    c = config.validate(config.Comparison(name="again", runs=[RunSpec("ddp", "ddp"), RunSpec("fsdp2", "fsdp2")],
                                          model=MODEL, steps=200, global_batch=4))
    session = Session(c, str(tmp_path / "out"), sample_devices=False)
    statuses: list[tuple[str, str]] = []
    asked: list[bool] = []

    def watch(batch: list[state.Update]) -> None:  # on the session thread
        for update in batch:
            if isinstance(update, state.StatusChanged):
                statuses.append((update.run, update.status))
            if isinstance(update, state.RecordsArrived) and update.run == "ddp" and not asked:
                asked.append(session.restart_run("ddp"))
                asked.append(session.stop_run("fsdp2"))

    session.subscribe(watch)
    session.start()
    assert session.wait(600) is not None
    assert asked == [True, True]
    ddp = [s for run, s in statuses if run == "ddp"]
    assert ddp == [state.STARTING, state.STOPPED, state.STARTING, state.OK] or ddp == [
        state.STARTING, state.OK, state.STARTING, state.OK], statuses  # stopped, or it had ended: twice either way
    assert [s for run, s in statuses if run == "fsdp2"] == [state.STOPPED], statuses
    steps = [step for step, _ in session.states["ddp"].step_times]
    assert steps[-1] == c.steps - 1 and steps.count(c.steps - 1) == 1, steps[-5:]
    first = tmp_path / "out" / "ddp.attempt1"  # the first attempt's files, kept beside the run's
    assert (first / "metrics" / "rank0.jsonl").is_file() and (tmp_path / "out" / "ddp" / "status.json").is_file()
