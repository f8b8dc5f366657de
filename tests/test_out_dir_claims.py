"""The run directory is the comparison's alone: a user's non-empty directory is refused, two commands
started into one directory at the same instant cannot both run, and the lock goes with its process."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from _launch import smoke_preset
from shardscope.orchestrator.preflight import claim_out_dir

CLI = [sys.executable, "-m", "shardscope.cli"]


def test_a_users_directory_is_refused_and_left_untouched(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "x.txt").write_text("hi")
    (mine / "report.md").write_text("my notes")
    proc = subprocess.run([*CLI, "run", "--preset", "smoke", "--headless", "--out", str(mine)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "not empty and not a shardscope run directory (holds report.md, x.txt)" in lines[0]
    assert sorted(os.listdir(mine)) == ["report.md", "x.txt"] and (mine / "report.md").read_text() == "my notes"


def test_the_lock_refuses_a_second_holder_and_goes_with_its_process(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom shardscope.orchestrator.preflight import claim_out_dir\n"
         f"print(claim_out_dir({str(out)!r}) or 'held', flush=True)\ntime.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        message = claim_out_dir(str(out))
        assert "in use by another shardscope command (pid " in message and str(holder.pid) in message
    finally:
        holder.kill()
        holder.wait()
    assert claim_out_dir(str(out)) == ""  # the kernel released it with the process
    assert claim_out_dir(str(out)) == ""  # held here already: the app claiming after the command line


def test_two_commands_into_one_directory_at_the_same_instant(tmp_path):
    """Both start together (a barrier of threads launching them); exactly one runs, the other exits 2 in one
    line, and the comparison that ran is whole (one start and one end record per rank)."""
    out = tmp_path / "together"
    preset = smoke_preset(tmp_path / "one.toml", '[[runs]]\nname = "ddp"\nstrategy = "ddp"\n')  # only ddp is read
    args = [*CLI, "run", "--preset", str(preset), "--headless", "--out", str(out), "--set", "steps=3",
            "--set", "profile.enabled=false"]
    barrier, results = threading.Barrier(2), []

    def start():
        barrier.wait()
        results.append(subprocess.run(args, capture_output=True, text=True, timeout=600))

    threads = [threading.Thread(target=start) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.returncode for r in results)
    assert codes == [0, 2], [(r.returncode, r.stderr[-500:]) for r in results]
    refused = next(r for r in results if r.returncode == 2)
    assert len(refused.stderr.strip().splitlines()) == 1 and "Traceback" not in refused.stderr
    for rank in (0, 1):
        lines = (out / "ddp" / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()
        assert sum('"kind":"start"' in ln for ln in lines) == 1 and sum('"kind":"end"' in ln for ln in lines) == 1


def _report(out):
    return subprocess.run([*CLI, "report", str(out)], capture_output=True, text=True, timeout=300)


def test_report_writes_through_no_symlink_leaving_the_directory(tmp_path):
    from tests.test_report_regenerate import make_run_dir

    out = make_run_dir(tmp_path)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "target.md").write_text("precious")
    (out / "report.md").symlink_to(victim / "target.md")
    (out / "plots").symlink_to(victim)
    proc = _report(out)
    assert proc.returncode == 0, proc.stderr
    assert (victim / "target.md").read_text() == "precious" and os.listdir(victim) == ["target.md"]
    assert not (out / "report.md").is_symlink() and "# " in (out / "report.md").read_text()
    assert "plots not written" in proc.stderr


def test_report_never_replaces_a_richer_summary(tmp_path):
    """A run whose records became unreadable (emptied metrics/) is named "no records"; summary.json, which
    holds its steps, is kept and the command exits 1."""
    import json

    from tests.test_report_regenerate import make_run_dir

    out = make_run_dir(tmp_path)
    assert _report(out).returncode == 0
    before = (out / "summary.json").read_text()
    for f in (out / "fsdp2" / "metrics").iterdir():
        f.unlink()
    proc = _report(out)
    assert proc.returncode == 1
    assert "fsdp2: no records" in proc.stderr and "summary.json kept" in proc.stderr
    assert (out / "summary.json").read_text() == before
    assert {r["name"]: r["steps_completed"] for r in json.loads(before)["runs"]}["fsdp2"] == 4


def test_report_refuses_a_directory_a_command_still_holds(tmp_path):
    from tests.test_report_regenerate import make_run_dir

    out = make_run_dir(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom shardscope.core.rundir import RunDir\n"
         f"print(RunDir({str(out)!r}).lock() or 'held', flush=True)\ntime.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = _report(out)
        assert proc.returncode == 2 and "in use by another shardscope command" in proc.stderr
        assert not (out / "summary.json").exists()
    finally:
        holder.kill()
        holder.wait()
