"""``shardscope predict`` through the real command line, calibrated on one real smoke comparison (gloo on
CPU, a few steps), predicting other presets' runs: complete output, assumptions and fit error printed,
"not predicted: why" for what the calibration cannot support, the ``--json`` schema, the report's section.
No accuracy assertion: accuracy is benchmarks/predict_accuracy.py's."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from shardscope.core.rundir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # a module fixture of several runs counts against its first test
CLI = [sys.executable, "-m", "shardscope.cli"]
FIGURES = ("tokens_per_s", "step_time_s", "compute_s", "exposed_comm_s", "peak_mem_bytes")


def run_cli(*args, timeout=300, env=None):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    """One finished smoke comparison (DDP and FSDP2, 2 ranks, 10 steps, steps 4-5 profiled)."""
    out = tmp_path_factory.mktemp("predict") / "smoke"
    proc = run_cli("run", "--preset", "smoke", "--headless", "--out", str(out), "--set", "steps=10",
                   "--set", "profile.start_step=4", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_predicts_another_presets_runs_with_assumptions_and_fit_error(calibration):
    proc = run_cli("predict", "--calibrate", str(calibration), "--preset", "zero-stages", "--quick")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "predicted for this machine: zero-stages" in out
    for name in ("ddp", "zero1", "zero2", "zero3", "fsdp2"):
        assert f"│ {name}" in out
    assert "not predicted" not in out
    assert "assumptions" in out and "framework overhead" in out
    assert "predicted back" in out and "all_reduce" in out and "measured" in out
    assert "not calibrated for deepspeed-zero1" in out  # a strategy the calibration lacks says what it took
    assert "│ zero1 " in out and "≤ " in out  # ... and its tokens/s is shown as the upper bound it is
    assert "per-FLOP" in out  # the method beside each figure


def test_json_schema(calibration):
    proc = run_cli("predict", "--calibrate", str(calibration), "--preset", "smoke", "--world-size", "4", "--device",
                   "cpu", "--json", "--quick")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["preset"] == "smoke" and data["what_if"] is False
    assert [r["name"] for r in data["runs"]] == ["ddp", "fsdp2"]
    for r in data["runs"]:
        assert r["why"] is None and r["world_size"] == 4
        assert all(isinstance(r[k], (int, float)) and r[k] > 0 for k in FIGURES), r
        assert r["compute_s"] + r["exposed_comm_s"] + r["rest_s"] == pytest.approx(r["step_time_s"])
    assert isinstance(data["assumptions"], list) and data["assumptions"]
    assert set(data["fit_error"]["runs"]) == {"ddp", "fsdp2"}
    assert all(isinstance(v["error"], float) for v in data["fit_error"]["runs"].values())
    assert data["calibration"]["collectives"]["all_reduce"]["source"] == "measured"


def test_unsupported_runs_print_not_predicted_why_and_null_in_json(calibration):
    proc = run_cli("predict", "--calibrate", str(calibration), "--preset", "tp-verification", "--quick")
    assert proc.returncode == 0, proc.stderr
    assert "autotp: not predicted: the calibration has no tensor-parallel run" in " ".join(proc.stdout.split())
    data = json.loads(run_cli("predict", "--calibrate", str(calibration), "--preset", "tp-verification",
                              "--json", "--quick").stdout)
    rows = {r["name"]: r for r in data["runs"]}
    assert rows["ddp"]["why"] is None and rows["ddp"]["tokens_per_s"] > 0
    for name in ("autotp", "fsdp2-tp"):
        assert rows[name]["why"] and all(rows[name][k] is None for k in FIGURES[:-1])


def test_what_if_on_gpus(calibration):
    proc = run_cli("predict", "--calibrate", str(calibration), "--preset", "ddp-vs-fsdp", "--device", "H100",
                   "--world-size", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["what_if"] and data["device"] == "H100"
    assert any(a.startswith("WHAT-IF") for a in data["assumptions"])
    assert all(r["tokens_per_s"] > 0 and r["world_size"] == 8 for r in data["runs"])
    assert "WHAT-IF on H100" in run_cli("predict", "--calibrate", str(calibration), "--preset", "smoke",
                                        "--device", "h100").stdout


def test_bad_input_exits_2_in_one_line(calibration, tmp_path):
    for args, words in ((["--calibrate", str(tmp_path), "--preset", "smoke"], "not a finished"),
                        (["--calibrate", str(calibration), "--preset", "nope"], "nope"),
                        (["--calibrate", str(calibration), "--preset", "smoke", "--device", "TPU"], "known: A100"),
                        (["--calibrate", str(calibration), "--preset", "smoke", "--world-size", "0"], ">= 1"),
                        (["--calibrate", str(calibration), "--preset", "smoke", "--probe", "--device", "H100"],
                         "give one of them")):
        proc = run_cli("predict", *args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert words in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_the_report_sets_predictions_beside_measurements(calibration):
    summary = json.loads(open(RunDir(str(calibration)).summary).read())
    section = summary["prediction"]
    assert section["calibrated_on"].startswith("this comparison's other runs")  # never a run's own calibration
    ddp, fsdp2 = section["runs"]["ddp"], section["runs"]["fsdp2"]
    assert not ddp["calibration_run"] and not fsdp2["calibration_run"] and "ddp.again" not in section["runs"]
    for row in (ddp, fsdp2):
        assert row["tokens_per_s"] > 0 and row["measured_tokens_per_s"] > 0
        assert row["error"] == pytest.approx(row["tokens_per_s"] / row["measured_tokens_per_s"] - 1)
    # each predicted from the other alone: neither family's framework overhead is calibrated, so both are upper
    # bounds, and report.md says so in one line instead of a table of errors that are not the model's
    assert ddp["bound"] == fsdp2["bound"] == "upper"
    report = open(RunDir(str(calibration)).report).read()
    section_text = report.split("## Predicted beside measured")[1].split("\n## ")[0]
    assert "Not shown: only upper bounds" in section_text and "|" not in section_text
    # each run's own spread, recounted from rank 0's step records: half the IQR of the timed steps' tokens/s over
    # their median (step 0 and profiled steps left out, as the median throughput leaves them out)
    for name, row in (("ddp", ddp), ("fsdp2", fsdp2)):
        with open(os.path.join(str(calibration), name, "metrics", "rank0.jsonl"), encoding="utf-8") as fh:
            recs = [json.loads(line) for line in fh if line.strip()]
        rates = [r["tokens_per_s"] for r in recs if r.get("kind") == "step" and r["step"] > 0 and not r.get("profiled")]
        q1, _, q3 = statistics.quantiles(rates, n=4)
        assert row["measured_spread"] == pytest.approx((q3 - q1) / 2 / statistics.median(rates))


def test_recommend_at_a_world_size_not_run_ranks_the_predictions_with_their_error(calibration):
    """recommend DIR --world-size N ranks the runs as predict does at N (the same figures as predict --json), each
    ratio with the error the calibration showed here; a GPU what-if says no error was measured."""
    proc = run_cli("recommend", str(calibration), "--world-size", "4", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())  # rich wraps lines at the terminal's width
    predicted = json.loads(run_cli("predict", "--calibrate", str(calibration), "--preset", "smoke", "--set", "steps=10",
                                   "--set", "profile.start_step=4", "--world-size", "4", "--device", "cpu",
                                   "--json", "--quick").stdout)
    rates = {r["name"]: r["tokens_per_s"] for r in predicted["runs"]}
    fast, slow = sorted(rates, key=lambda n: -rates[n])
    assert f"at 4 ranks (this machine's calibration): fastest predicted {fast} ({rates[fast]:,.0f} tokens/s;" in out, out
    assert (f"{fast} is predicted {rates[fast] / rates[slow]:.2f}× {slow} ({rates[fast]:,.0f} vs "
            f"{rates[slow]:,.0f} tokens/s; fit error here: {fast} ") in out, out
    assert "caveat: the fit error is in-sample" in out and "assumptions:" in out
    what_if = run_cli("recommend", str(calibration), "-n", "8", "--device", "H100", "--device-memory", "80GiB")
    assert what_if.returncode == 0, what_if.stderr
    assert "at 8 ranks of H100 (what-if, not measured here): fastest predicted that fits" in " ".join(what_if.stdout.split())
    assert "what-if: error not measured" in what_if.stdout
    assert ".again" not in what_if.stdout and ".again" not in proc.stdout  # the A/A control is never a candidate
    for args, said in ((["--device", "H100"], "--device: give --world-size too"),
                       (["-n", "8", "--device", "TPU"], "--device 'TPU': known:"),
                       (["-n", str(2 * (os.cpu_count() or 1) + 1)], "name the what-if: --device A100"),
                       (["-n", "0"], "--world-size 0: must be >= 1")):
        bad = run_cli("recommend", str(calibration), *args)
        assert bad.returncode == 2 and said in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr


def test_probe_and_collectives_measure_every_strategy_at_its_own_world_size_and_leave_nothing_running(calibration):
    """Probing is predict's default; ``--collectives`` on parity (every strategy): each run's compute comes from its
    own one-rank probe
    at 2 ranks, the tensor-parallel runs' too (probed on their 2-D mesh); collectives are timed by a short
    torchrun job at 2 ranks and again at the tensor-parallel runs' own 4; no probe or job process is left."""
    import uuid

    import psutil

    # Processes of this command only (their environment carries the tag): another test running beside this one
    # (pytest-xdist, a second suite) may have probes of its own.
    tag = uuid.uuid4().hex
    proc = run_cli("predict", "--calibrate", str(calibration), "--preset", "parity", "--world-size", "2",
                   "--collectives", "--json", timeout=1200, env={**os.environ, "SHARDSCOPE_TEST_TAG": tag})
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    fits = data["calibration"]["collectives"]
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        assert fits[kind]["source"] == "measured" and fits[kind]["sizes"] >= 4, kind
    assert any("short torchrun job" in a for a in data["assumptions"])
    assert "timing collectives at 2 ranks" in proc.stderr and "timing collectives at 4 ranks" in proc.stderr
    rows = {r["name"]: r for r in data["runs"]}
    assert {r["strategy"] for r in rows.values()} >= {"ddp", "fsdp1", "fsdp2", "fsdp-handwritten", "deepspeed-zero1",
                                                        "deepspeed-zero2", "deepspeed-zero3"}
    assert {r["family"] for r in rows.values()} >= {"tensor-parallel"}
    for name, r in rows.items():
        assert f"probing {name} " in proc.stderr  # progress, one line per run
        # the tensor-parallel runs keep their own 4 ranks (dp 2 x tp 2: the preset names their world size)
        tp = r["family"] == "tensor-parallel"
        assert r["why"] is None and r["bound"] is None and r["world_size"] == (4 if tp else 2), r
        assert any(f"one-rank probe of this run at {r['world_size']} ranks" in n for n in r["notes"]), r
        assert ("collectives timed at its own 4 ranks" in r["notes"]) == tp, r
        assert 0 < r["compute_s"] <= r["step_time_s"] and r["tokens_per_s"] > 0
        assert r["method"] == "probed + timed collectives", r["method"]
    assert any("one-rank probe" in a for a in data["assumptions"])
    def tagged(p: psutil.Process) -> bool:
        try:
            return p.environ().get("SHARDSCOPE_TEST_TAG") == tag and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    left = [" ".join(p.cmdline()) for p in psutil.process_iter() if tagged(p)]
    assert left == []


def test_a_world_size_this_machine_cannot_host_names_its_what_if(calibration):
    """More ranks than this machine has cores is a scenario the user must name: --device cpu (ranks sharing these
    cores, said in the first line) or a GPU of the table, whose output leaves this machine's collective fits out."""
    many = str(2 * (os.cpu_count() or 1) + 1)
    bad = run_cli("predict", "--calibrate", str(calibration), "--preset", "smoke", "--world-size", many, "--quick")
    assert bad.returncode == 2 and "name the what-if: --device A100" in bad.stderr and "--device cpu" in bad.stderr
    cpu = run_cli("predict", "--calibrate", str(calibration), "--preset", "smoke", "--world-size", many, "--device", "cpu",
                  "--quick")
    assert cpu.returncode == 0, cpu.stderr
    assert cpu.stdout.splitlines()[0].startswith(f"what-if: {many} ranks sharing this machine's {os.cpu_count()} cores")
    gpu = run_cli("predict", "--calibrate", str(calibration), "--preset", "smoke", "--world-size", many, "--device", "H100")
    assert gpu.returncode == 0 and gpu.stdout.splitlines()[0].startswith(f"what-if: {many} ranks on H100 GPUs")
    assert "collectives: time = latency" not in gpu.stdout and "collectives: time = latency" in cpu.stdout
