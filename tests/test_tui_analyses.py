"""The app's trace analyses of one run run side by side on worker threads: the newest one asked for is the
one kept, whatever order they finish in."""

from __future__ import annotations

from _pilot import wait_for
from shardscope.config import cpu_host
from shardscope.tui.app import build_app
from shardscope.tui.messages import CommAnalysed
from tui_fakes import FIXTURE, run_async


@run_async
async def test_an_older_analysis_finishing_last_does_not_replace_a_newer_one():
    app = build_app(replay_dir=FIXTURE, host=cpu_host())
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: app.board.finished is not None
                       and all(w.is_finished for w in app.workers if w.group == "comm")
                       and app.board.analysis_applied == app.board.analysis_seq)
        newest = {"steps_profiled": 2, "marker": "newest"}
        app.post_message(CommAnalysed("ddp", newest, seq=11))
        app.post_message(CommAnalysed("ddp", {"steps_profiled": 1, "marker": "older"}, seq=10))
        # Messages are handled in order: once this one is in, the older one above was handled (and dropped).
        app.post_message(CommAnalysed("fsdp2", {"marker": "after"}))
        await wait_for(pilot, lambda: app.board.analyses.get("fsdp2", {}).get("marker") == "after")
        assert app.board.analyses["ddp"]["marker"] == "newest"
        # A later one is applied (and one posted without a sequence, as a test or a tool would, always is).
        app.post_message(CommAnalysed("ddp", {"marker": "later"}, seq=12))
        app.post_message(CommAnalysed("ddp", {"marker": "outside"}))
        await wait_for(pilot, lambda: app.board.analyses["ddp"].get("marker") == "outside")
        assert app.board.analysis_applied["ddp"] == 12
