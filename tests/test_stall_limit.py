"""Which limit a stalled run's verdict names: ``launch.startup_timeout_s`` before its first record,
``stall_timeout_s`` after; the one in force when it was found stalled, not the one that would apply later."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

from shardscope.orchestrator import supervision
from shardscope.profiling import state


class _Proc:
    """A torchrun job that never ends on its own and records that it was stopped."""

    def __init__(self) -> None:
        self.stopped = False
        self.plan = SimpleNamespace(console_path="/nonexistent/console.log")

    def poll(self):
        return 0 if self.stopped else None

    def refresh_descendants(self):
        return {}

    def rank_processes(self, expected):
        return {}

    def stop(self, grace_s):
        self.stopped = True

    def kill(self):
        self.stopped = True


class _Quiet:
    """A metrics or console tailer with nothing new."""

    invalid_lines = 0

    def poll(self):
        return []


class _Supervisor(supervision.RunSupervision):
    """The session state ``RunSupervision`` reads, no more."""

    def __init__(self, tmp_path, stall_s: float, startup_s: float) -> None:
        self.comparison = SimpleNamespace(stall_timeout_s=stall_s,
                                          launch=SimpleNamespace(startup_timeout_s=startup_s, nnodes=1,
                                                                 node_rank=0, grace_period_s=0.0))
        self.states = {"r": SimpleNamespace(world_size=2, start={})}
        self.rundir = SimpleNamespace(run=lambda name: SimpleNamespace(
            rank_spares=lambda: [], trace_partials=lambda: [], stall_request=str(tmp_path / "req")))
        self._active: dict = {}
        self.emitted: list = []

    def _emit(self, update) -> None:
        self.emitted.append(update)

    def _ask_where(self, active, wait_s: float = 0.0) -> None:  # no rank answers: the plain verdict
        return None


def _stall(tmp_path, started: bool, silent_s: float):
    sup = _Supervisor(tmp_path, stall_s=240.0, startup_s=300.0)
    active = supervision._Active("r", _Proc(), _Quiet(), _Quiet(), last_progress=time.monotonic() - silent_s,
                                 started=started)
    sup._active["r"] = active
    sup._poll(active)
    return sup, active


def test_a_run_silent_since_launch_is_judged_by_the_startup_limit(tmp_path):
    sup, active = _stall(tmp_path, started=False, silent_s=250.0)
    assert not active.stop_reason and not sup.emitted  # 250 s < 300 s: still starting
    sup, active = _stall(tmp_path, started=False, silent_s=310.0)
    assert active.stalled_before_start and active.stalled_after == 300.0
    (update,) = sup.emitted
    assert update.status == state.FAILED
    assert update.error == "stalled: no progress for 300 s (launch.startup_timeout_s: no record since launch)"


@pytest.mark.parametrize("silent_s, stalled", [(200.0, False), (250.0, True)])
def test_a_run_that_recorded_is_judged_by_the_stall_limit(tmp_path, silent_s, stalled):
    sup, active = _stall(tmp_path, started=True, silent_s=silent_s)
    assert bool(sup.emitted) == stalled
    if stalled:
        assert not active.stalled_before_start and active.stalled_after == 240.0
        assert sup.emitted[0].error == "stalled: no progress for 240 s (stall_timeout_s)"


def test_the_verdict_keeps_the_limit_found_even_once_a_late_record_arrives(tmp_path):
    """A first record read while the run is stopped flips ``started``; the verdict still names 300 s."""
    sup = _Supervisor(tmp_path, stall_s=240.0, startup_s=300.0)
    active = supervision._Active("r", _Proc(), _Quiet(), _Quiet(), last_progress=time.monotonic() - 310.0)
    sup._active["r"] = active
    late = [{"kind": "start", "rank": 0, "run": "r"}]
    active.metrics = SimpleNamespace(invalid_lines=0, poll=lambda: late if active.stop_reason else [])
    sup._poll(active)
    assert active.started  # the late record was read after the stall was found
    assert sup.emitted[-1].error.startswith("stalled: no progress for 300 s (launch.startup_timeout_s")


def test_a_settled_run_leaves_no_spare_and_no_half_written_trace_of_a_killed_rank(tmp_path):
    """A rank killed while torch's handler wrote its trace (its peer failed first: a full disk) leaves
    ``traces/tb/<file>.tmp``; settling the run removes it with the ranks' spares (CI, 2026-11-28)."""
    from shardscope.core.rundir import RunFiles

    files = RunFiles(str(tmp_path / "r"))
    os.makedirs(files.tb)
    os.makedirs(files.metrics)
    partial = os.path.join(files.tb, "rank0.1795827580636920948.pt.trace.json.tmp")
    kept = os.path.join(files.tb, "rank1.17958.pt.trace.json")
    spare = files.rank_file(1) + ".spare"
    for path in (partial, kept, spare):
        open(path, "w").close()
    assert files.trace_partials() == [partial] and files.rank_spares() == [spare]
    sup = _Supervisor(tmp_path, stall_s=240.0, startup_s=300.0)
    sup.rundir = SimpleNamespace(run=lambda name: files)
    active = supervision._Active("r", _Proc(), _Quiet(), _Quiet(), last_progress=time.monotonic())
    sup._active["r"] = active
    active.stop_reason = "stopped"
    sup._settle(active, 0)
    assert not os.path.exists(partial) and not os.path.exists(spare) and os.path.exists(kept)
    assert sup.emitted[-1].status == state.STOPPED
