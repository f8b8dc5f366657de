"""Reports regenerated from a run directory alone: summary sections, report.md, plots, merged
trace; the command line; no torch import; and a real tiny comparison end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardscope import config
from shardscope.core import events
from shardscope.config import ModelSpec, ProfileSpec, RunSpec
from shardscope.profiling import memory_model
from shardscope.analysis.report import write_reports
from tests.test_traces import ddp_like_events, write_trace

REPO = Path(__file__).resolve().parents[1]
MODEL = ModelSpec(vocab_size=128, d_model=32, n_layers=2, n_heads=4, d_ff=64, seq_len=16)


def make_run_dir(tmp_path: Path) -> Path:
    """A finished two-run comparison written the way ranks and the orchestrator write it."""
    c = config.Comparison(name="fake", runs=[RunSpec("ddp", "ddp"), RunSpec("fsdp2", "fsdp2")], model=MODEL,
                          steps=4, global_batch=4, parity=True, profile=ProfileSpec(start_step=1, steps=2))
    c = config.validate(c)
    out = tmp_path / "out"
    out.mkdir()
    config.dump_json(out / "comparison.json", c.to_dict())
    params = memory_model.model_params(MODEL)
    for run in c.runs:
        payload = config.run_spec_payload(c, run, out_dir=str(out), device="cpu")
        run_dir = Path(payload["run_dir"])
        (run_dir / "traces" / "tb").mkdir(parents=True)
        config.dump_json(run_dir / "spec.json", payload)
        layout = memory_model.layout_for(c, run)
        for rank in (0, 1):
            with events.RecordWriter(run_dir / "metrics" / f"rank{rank}.jsonl", run.name, rank) as w:
                w.write("start", world_size=2, device="cpu", backend="gloo", precision={"policy": "fp32"},
                        spec=payload["run"], dp=2, tp=1)
                for step in range(4):
                    loss = 5.0 - 0.2 * step + (0.01 * step if run.name == "fsdp2" and step >= 2 else 0.0)
                    w.write("step", step=step, loss=loss, tokens=64, tokens_per_s=1000.0 * (2 if run.name == "ddp" else 1),
                            step_time_s=0.05, mem_peak_bytes=300 * 2**20, profiled=step in (1, 2))
                    norms = {"tok_emb": 1.0, "layers.0": 2.0, "layers.1": 3.0 + (0.1 if loss != 5.0 - 0.2 * step else 0)}
                    w.write("layers", step=step, grad_norms=norms, param_norms={k: 10.0 for k in norms})
                states = memory_model.model_state_bytes(params, layout, rank)
                w.write("memory", step=3, when="end", **states, rss_bytes=290 * 2**20, mem_peak_bytes=300 * 2**20)
                w.write("end", status="ok", steps_completed=4)
            write_trace(run_dir / "traces" / f"rank{rank}.trace.json", ddp_like_events(), rank=rank)
        (run_dir / "traces" / "tb" / "rank0.123.pt.trace.json").write_text("{}")
    return out


def test_write_reports_from_files_alone(tmp_path):
    out = make_run_dir(tmp_path)
    paths = write_reports(str(out))
    assert set(paths) == {"summary", "report", "plots", "merged_trace"}
    s = json.loads(Path(paths["summary"]).read_text())
    assert s["preset"] == "fake" and s["baseline"] == "ddp"
    core = {"name", "strategy", "world_size", "status", "steps_completed", "final_loss", "median_tokens_per_s",
            "peak_mem_bytes", "loss_max_abs_diff", "loss_mean_abs_diff", "speedup", "mem_ratio"}
    assert all(core <= set(r) for r in s["runs"])
    assert s["runs"][1]["speedup"] == pytest.approx(0.5)
    mem = s["memory"]["runs"]
    assert mem["ddp"]["model_state_error"] == 0 and mem["fsdp2"]["model_state_error"] == 0
    assert s["memory"]["measured_peak_kind"] == "process RSS"
    comm = s["communication"]["runs"]["ddp"]
    assert comm["collectives"]["all_reduce"]["bytes_per_step"] == 4000 and comm["theory"]["bytes_per_step"] > 0
    assert comm["mfu"] is None and "peak FLOP/s unknown" in comm["mfu_note"]
    parity = s["parity"]["runs"]["fsdp2"]
    assert parity["first_loss_step"] == 2 and parity["first_grad_layer"]["layer"] == "layers.1"
    assert s["traces"]["ddp"]["tensorboard_files"] == ["rank0.123.pt.trace.json"]
    for name in ("loss", "throughput", "memory", "communication"):
        png = out / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    report = Path(paths["report"]).read_text()
    for heading in ("## Throughput and loss", "## Memory per rank", "## Communication", "## Parity against ddp",
                    "## Traces", "## Plots"):
        assert heading in report
    assert "loss first differs at step 2" in report and "tensorboard --logdir" in report
    merged = json.loads(Path(paths["merged_trace"]).read_text())
    assert {e["args"]["name"] for e in merged["traceEvents"] if e["name"] == "process_name"} == {"ddp", "fsdp2"}


def test_report_command_regenerates(tmp_path, shardscope_cmd):
    out = make_run_dir(tmp_path)
    proc = subprocess.run([*shardscope_cmd, "report", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (out / "report.md").is_file() and (out / "plots" / "loss.png").is_file()
    assert "communication" in json.loads((out / "summary.json").read_text())


def test_orchestrator_side_modules_do_not_import_torch():
    code = ("import sys\n"
            "import shardscope.analysis.report, shardscope.profiling.nvml, shardscope.profiling.traces\n"
            "import shardscope.profiling.memory_model, shardscope.analysis.divergence, shardscope.profiling.estimate\n"
            "import shardscope.analysis.plots\n"
            "bad = [m for m in ('torch', 'deepspeed', 'matplotlib') if m in sys.modules]\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_real_comparison_report(tmp_path):
    """DDP vs FSDP2 for real (gloo, 2 ranks, profiled window): exact model states within 3% of the
    model, observed bytes per step within 2% of theory, TensorBoard files the plugin can parse."""
    from tests._launch import assert_ok, launch, prepare, tiny_comparison

    comparison = tiny_comparison([RunSpec("ddp", "ddp"), RunSpec("fsdp2", "fsdp2")], steps=4, parity=True,
                                 profile=ProfileSpec(enabled=True, start_step=1, steps=2))
    out = prepare(tmp_path, comparison)
    for run in ("ddp", "fsdp2"):
        assert_ok(launch(out, comparison, run))
    paths = write_reports(str(out))
    s = json.loads(Path(paths["summary"]).read_text())
    for run in ("ddp", "fsdp2"):
        assert s["memory"]["runs"][run]["model_state_error"] < 0.03, s["memory"]["runs"][run]["per_rank"]
        ratio = s["communication"]["runs"][run]["theory"]["ratio"]
        assert ratio == pytest.approx(1.0, rel=0.02), s["communication"]["runs"][run]
    assert not s["parity"]["runs"]["fsdp2"]["diverged"]
    tb = s["traces"]["fsdp2"]["tensorboard_dir"]
    assert tb and os.path.isdir(tb)
    plugin = pytest.importorskip("torch_tb_profiler")
    from torch_tb_profiler import consts
    from torch_tb_profiler.profiler.data import RunProfileData
    from torch_tb_profiler.profiler.run_generator import RunGenerator

    assert plugin
    for name in s["traces"]["fsdp2"]["tensorboard_files"]:
        match = consts.WORKER_PATTERN.match(name)
        assert match, name
        data = RunProfileData.parse(match.group(1), (match.group(2) or ".")[1:], os.path.join(tb, name), str(tmp_path))
        profile = RunGenerator(match.group(1), (match.group(2) or ".")[1:], data).generate_run_profile()
        assert any(v.name == "trace" for v in profile.views)


def test_a_disk_that_fills_during_the_reports_keeps_the_summary(tmp_path, monkeypatch):
    """The merged trace fails with ENOSPC (the disk filled): summary.json is written whole before it, the
    failure is named on stderr, no partial file is left, and report/plots are not claimed as written."""
    import errno

    from shardscope.profiling import traces

    out = make_run_dir(tmp_path)

    def full_disk(runs, path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(traces, "write_merged_trace", full_disk)
    paths = write_reports(str(out))
    assert set(paths) == {"summary"}
    data = json.loads((out / "summary.json").read_text())
    assert {r["name"] for r in data["runs"]} == {"ddp", "fsdp2"} and "communication" in data
    assert not list(out.rglob("*.tmp"))
    assert not (out / "report.md").exists()


def test_a_comparison_whose_report_failed_exits_1(tmp_path, monkeypatch):
    """Every run ok but a part of the report failed (its summary written by the fallback): the command exits 1
    and says what failed, instead of 0."""
    from shardscope.orchestrator import session_ends
    from shardscope.orchestrator.session import Session
    from shardscope.profiling import state
    from shardscope.analysis.report import Reports

    c = config.validate(config.Comparison(name="fake", runs=[RunSpec("ddp", "ddp")], model=MODEL, steps=2,
                                          global_batch=4))
    session = Session(c, str(tmp_path / "out"), sample_devices=False)
    session._define(c.runs[0])
    session._emit(state.StatusChanged("ddp", state.OK))
    seen = []
    session.subscribe(seen.extend)
    made = Reports(summary=str(tmp_path / "out" / "summary.json"))
    made.failed = "full report failed (the communication section): TypeError('x')"
    monkeypatch.setattr(session_ends, "write_reports", lambda *a, **k: made)
    session._finish()
    assert session.exit_code == 1
    assert any(getattr(u, "text", "") == made.failed for u in seen)


def test_the_end_is_set_when_a_view_fails_and_stderr_is_a_broken_pipe(tmp_path, monkeypatch):
    """A subscriber that raises while stderr is a pipe whose reader is gone (a killed `| tee`, a killed test
    runner): the session still ends, so `shardscope run` waiting on it exits instead of hanging forever."""
    import sys

    from shardscope.orchestrator.session import Session
    from shardscope.profiling import state

    class BrokenPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    c = config.validate(config.Comparison(name="fake", runs=[RunSpec("ddp", "ddp")], model=MODEL, steps=2,
                                          global_batch=4))
    session = Session(c, str(tmp_path / "out"), sample_devices=False)
    session._define(c.runs[0])
    session._emit(state.StatusChanged("ddp", state.OK))

    def view(batch):
        raise RuntimeError("the view broke")

    session.subscribe(view)
    monkeypatch.setattr(sys, "stderr", BrokenPipe())
    session._finish()
    assert session.finished and session.wait(0) is not None  # ended, with its exit code
    # and when the end itself fails, the end is still set, with exit code 1
    session2 = Session(c, str(tmp_path / "out2"), sample_devices=False)
    session2._define(c.runs[0])
    monkeypatch.setattr(session2, "_flush", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError):
        session2._finish()
    assert session2.finished and session2.wait(0) == 1


def test_a_figure_that_is_not_zero_is_never_printed_as_zero():
    """148 B of an all-reduce per step is 0.000141 MiB: report.md says so instead of '0.000'."""
    from shardscope.analysis.markdown import _num

    assert _num(148 / 2**20, "{:,.3f}") == "1.41e-04"
    assert _num(0.4) == "0.4" and _num(0.0, "{:.3f}") == "0.000" and _num(None) == "-"
    assert _num(2.5e-5 * -1, "{:.3f}") == "-2.50e-05" and _num(1234.5) == "1,234"
