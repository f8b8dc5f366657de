"""The run-state fold, the core summary and replaying a run directory from its files alone."""

from __future__ import annotations

import json

from shardscope import config
from shardscope.core import events
from shardscope.config import HostInfo
from shardscope.orchestrator import replay
from shardscope.analysis import fold
from shardscope.profiling import state
from shardscope.analysis import summary

HOST = HostInfo("cpu", 4, "2 CPU cores", True)


def _write_run(out, name, losses, rate, peak, *, fail_at=None, precision="fp32"):
    run_dir = out / name
    for rank in (0, 1):
        with events.RecordWriter(run_dir / "metrics" / f"rank{rank}.jsonl", name, rank) as w:
            w.write("start", world_size=2, precision={"policy": precision})
            for step, loss in enumerate(losses):
                if fail_at is not None and step == fail_at:
                    w.write("error", message="RuntimeError: boom", traceback="Traceback...\nRuntimeError: boom")
                    w.write("end", status="failed", steps_completed=step)
                    break
                w.write("step", step=step, loss=loss, tokens=512, tokens_per_s=rate, mem_peak_bytes=peak + rank,
                        profiled=(step == 2))
            else:
                w.write("end", status="ok", steps_completed=len(losses))
    (run_dir / "console.log").write_text("$ torchrun ...\nhello\n")
    (run_dir / "spec.json").write_text(json.dumps({"run": {"world_size": 2, "precision": precision, "options": {}}}))


def make_dir(tmp_path):
    c = config.load_preset("smoke", ["steps=4", "runs.fsdp2.precision='bf16-autocast'"], host=HOST)
    out = tmp_path / "cmp"
    out.mkdir()
    config.dump_json(out / "comparison.json", c.to_dict())
    _write_run(out, "ddp", [5.0, 4.0, 3.0, 2.0], 1000.0, 100)
    _write_run(out, "fsdp2", [5.0, 4.1, 3.0, 2.5], 500.0, 60, fail_at=3, precision="bf16-autocast")
    return c, out


def test_fold_and_summary(tmp_path):
    c, out = make_dir(tmp_path)
    states = fold.replay_states(str(out))
    ddp, fsdp = states["ddp"], states["fsdp2"]
    assert ddp.status == "ok" and ddp.steps_completed == 4 and ddp.loss == 2.0
    assert ddp.peak_mem_bytes == 101  # max over ranks
    assert [s for s, _ in ddp.throughput] == [0, 1, 3]  # the profiled step is left out
    assert fsdp.status == "failed" and fsdp.error == "RuntimeError: boom" and "Traceback" in fsdp.traceback
    s = summary.build_summary(c, states, str(out))
    assert s["preset"] == "smoke" and s["baseline"] == "ddp" and s["all_ok"] is False
    by = {r["name"]: r for r in s["runs"]}
    for key in ("name", "strategy", "world_size", "status", "steps_completed", "final_loss", "median_tokens_per_s",
                "peak_mem_bytes", "loss_max_abs_diff", "loss_mean_abs_diff", "speedup", "mem_ratio"):
        assert key in by["ddp"] and key in by["fsdp2"]
    f = by["fsdp2"]
    assert f["status"] == "failed" and f["steps_completed"] == 3 and f["final_loss"] == 3.0
    assert abs(f["loss_max_abs_diff"] - 0.1) < 1e-9 and abs(f["loss_mean_abs_diff"] - 0.1 / 3) < 1e-9
    # CPU: the peaks are process RSS, not comparable; the ratio is of model states, which these records lack
    assert f["speedup"] == 0.5 and f["peak_mem_kind"] == "process RSS" and f["mem_ratio_of"] == "model states"
    assert f["mem_ratio"] is None
    assert any("precision" in flag for flag in f["fairness_flags"])
    assert (f["initial_loss"], f["min_loss"]) == (5.0, 3.0) and abs(f["mean_loss"] - 12.1 / 3) < 1e-9
    assert abs(f["loss_final_abs_diff"] - 0.0) < 1e-12  # step 2: both 3.0
    assert by["ddp"]["loss_final_abs_diff"] == 0.0 and by["ddp"]["mean_loss"] == 3.5
    assert by["ddp"]["speedup"] == 1.0 and by["ddp"]["fairness_flags"] == []


def test_interrupted_run_replays_as_stopped(tmp_path):
    c, out = make_dir(tmp_path)
    path = out / "ddp" / "metrics" / "rank0.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n" + "garbage\n" + lines[-1][:5])  # no end record, torn line
    states = fold.replay_states(str(out))
    assert states["ddp"].status == "stopped" and states["ddp"].invalid_lines >= 1


def test_replay_source_publishes_like_a_session(tmp_path):
    c, out = make_dir(tmp_path)
    config.dump_json(out / "summary.json", summary.build_summary(c, fold.replay_states(str(out)), str(out)))
    src = replay.ReplaySource(str(out), speed=1000.0)
    got: list = []
    src.subscribe(got.extend)
    src.start()
    assert src.wait(10) == 1
    assert isinstance(got[-1], state.ComparisonFinished)
    states: dict = {}
    state.fold(got, states)
    assert states["ddp"].status == "ok" and states["fsdp2"].status == "failed"


def test_restart_resets_state():
    states: dict = {}
    d = state.RunDefined("a", "ddp", 2, 10, "fp32", {}, "/x")
    state.fold([d, state.RecordsArrived("a", ({"kind": "step", "rank": 0, "step": 0, "loss": 1.0, "t": 1.0},))], states)
    assert states["a"].losses == [(0, 1.0)]
    state.fold([d], states)
    assert states["a"].losses == []


def test_eta_and_progress():
    st = state.RunState("a", steps_total=10)
    for i in range(3):
        st.apply_record({"kind": "step", "rank": 0, "step": i, "loss": 1.0, "t": 100.0 + i})
    assert st.steps_completed == 3 and abs(st.progress - 0.3) < 1e-9 and abs(st.eta_s - 7.0) < 1e-9


def test_replay_publishes_last_device_sample(tmp_path):
    c, out = make_dir(tmp_path)
    sample = {"readings": [{"label": "ddp rank 0 (process RSS)", "kind": "process", "used_bytes": 5, "total_bytes": 10,
                            "util_pct": 1.0, "power_w": None, "run": "ddp", "ranks": [0]}], "source": "process-rss", "t": 1.0}
    (out / "devices.jsonl").write_text(json.dumps(sample) + "\n")
    got = [u for u in fold.replay_updates(str(out)) if isinstance(u, state.DeviceSample)]
    assert len(got) == 1 and got[0].readings[0].used_bytes == 5 and got[0].readings[0].ranks == (0,)
