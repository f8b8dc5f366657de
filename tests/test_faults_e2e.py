"""End to end through the real command line: the orchestrator dies, the disk fills, a rank runs out
of memory. Each case: the right status, exit code, no traceback on the console, nothing left running,
and the records written before the fault kept."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from shardscope.core import events, outspace

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "shardscope.cli"]
TINY = ["--set", "model.d_model=32", "--set", "model.n_heads=4", "--set", "model.d_ff=64", "--set", "model.seq_len=16",
        "--set", "model.vocab_size=128", "--set", "global_batch=4"]
NOPROF = ["--set", "profile.enabled=false"]


def run_cli(args, timeout=300):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def leftovers(marker: str) -> list[str]:
    """Live processes whose command line mentions ``marker`` (the run directory)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(proc.info["cmdline"] or []):
                found.append(f"{proc.pid}: {' '.join(proc.info['cmdline'])}")
        except psutil.Error:
            continue
    return found


def records(out, run, rank=0):
    recs, _ = events.read_records(os.path.join(out, run, "metrics", f"rank{rank}.jsonl"))
    return recs


def summary_runs(out):
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as fh:
        return {r["name"]: r for r in json.load(fh)["runs"]}


def assert_clean(proc, out):
    text = proc.stdout + proc.stderr
    assert "Traceback" not in text, text[-3000:]
    assert not leftovers(str(out))
    assert not glob.glob(os.path.join(out, "**", "*.tmp"), recursive=True)


def wait_for_steps(path, n, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path) and sum(r["kind"] == "step" for r in events.read_records(path)[0]) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"no {n} step records in {path}")


def test_sigkilled_orchestrator_leaves_nothing_running(tmp_path):
    out = tmp_path / "killed"
    proc = subprocess.Popen([*CLI, "run", "--preset", "smoke", "--headless", "--out", str(out), "--set", "steps=5000",
                             *TINY, *NOPROF], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_steps(str(out / "ddp" / "metrics" / "rank0.jsonl"), 3)
        assert leftovers(str(out))  # torchrun and both ranks are running
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 180  # the ranks' watchdog notices the lost orchestrator: slower under load
        while leftovers(str(out)) and time.monotonic() < deadline:
            time.sleep(1)
        assert not leftovers(str(out)), leftovers(str(out))
    finally:
        for line in leftovers(str(out)):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
    report = run_cli(["report", str(out)])
    assert report.returncode == 0 and "Traceback" not in report.stderr, report.stderr
    runs = summary_runs(out)
    assert runs["ddp"]["status"] == "stopped" and runs["ddp"]["error"] == "orchestrator lost"
    assert runs["fsdp2"]["status"] == "stopped" and runs["fsdp2"]["error"].startswith("orchestrator lost")
    steps = [r for r in records(out, "ddp") if r["kind"] == "step"]
    assert len(steps) >= 3 and runs["ddp"]["steps_completed"] >= 3  # records written before the kill stay
    ends = [r for rank in (0, 1) for r in records(out, "ddp", rank) if r["kind"] == "end"]
    assert all(e["status"] == "stopped" and e.get("reason") == "orchestrator lost" for e in ends), ends


def test_injected_write_error_fails_the_run_and_starts_no_other(tmp_path):
    """ENOSPC from rank 1's record writer at step 4, after a profiled window at steps 1-2."""
    out = tmp_path / "nospace"
    proc = run_cli(["run", "--preset", "smoke", "--headless", "--out", str(out), "--set", "steps=6", *TINY,
                    "--set", "profile.start_step=1", "--set", "profile.steps=2",
                    "--set", "runs.ddp.fault='rank=1,step=4,kind=nospace'"])
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert_clean(proc, out)
    runs = summary_runs(out)
    path = os.path.join(out, "ddp", "metrics", "rank1.jsonl")
    assert runs["ddp"]["status"] == "failed"
    assert runs["ddp"]["error"] == f"no space left on device writing {path} (rank 1, step 4)"
    assert runs["fsdp2"]["status"] == "stopped" and runs["fsdp2"]["error"].startswith("not started: no space left")
    assert not os.path.exists(os.path.join(out, "fsdp2", "metrics"))
    assert [r["step"] for r in records(out, "ddp", 1) if r["kind"] == "step"] == [0, 1, 2, 3]
    assert not glob.glob(os.path.join(out, "**", "*.spare"), recursive=True)
    # The trace constants bound a real trace: bytes per profiled step of this model (2 layers).
    per_step = outspace.TRACE_BYTES_FLOOR_PER_STEP + 2 * outspace.TRACE_BYTES_PER_STEP_PER_LAYER
    for trace in glob.glob(os.path.join(out, "ddp", "traces", "tb", "rank*.pt.trace.json")):
        assert 0 < os.path.getsize(trace) / 2 <= per_step


@pytest.fixture
def tmpfs(tmp_path):
    """A mount point for a tmpfs the test mounts; skipped where mounting is refused (not root)."""
    point = tmp_path / "tmpfs"
    point.mkdir()
    mounted = []

    def mount(size: str) -> str:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
        mounted.append(point)
        return str(point)

    yield mount
    for p in mounted:
        subprocess.run(["umount", "-l", str(p)], capture_output=True)


def test_tiny_tmpfs_is_refused_before_launch(tmpfs):
    out = os.path.join(tmpfs("3m"), "out")
    proc = run_cli(["run", "--preset", "smoke", "--headless", "--out", out])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and " free, the comparison needs about" in lines[0], proc.stderr
    assert not os.path.exists(out)


def test_tmpfs_filling_mid_run(tmpfs):
    """The disk fills after launch (a filler file takes every free byte): the run fails on its next write (a
    record or the trace export), the next run is not started, and the summary is still written whole. The run
    is far longer than the fill takes, so whatever the machine's load it cannot end before the disk is full."""
    point = tmpfs("48m")
    out = os.path.join(point, "out")
    proc = subprocess.Popen([*CLI, "run", "--preset", "smoke", "--headless", "--out", out, "--set", "steps=5000",
                             "--set", "profile.start_step=4", "--set", "profile.steps=2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_steps(os.path.join(out, "ddp", "metrics", "rank0.jsonl"), 1)
    # unbuffered: nothing is left to flush at close, which would raise ENOSPC there (a run beside it had taken
    # the last bytes the buffered writer still held: seen under load)
    fd = os.open(os.path.join(point, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * (1 << 16))
    except OSError:
        pass
    finally:
        os.close(fd)
    stdout, stderr = proc.communicate(timeout=300)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert done.returncode == 1, stdout[-3000:]
    assert_clean(done, out)
    runs = summary_runs(out)
    assert runs["ddp"]["status"] == "failed" and runs["ddp"]["error"].startswith("no space left on device writing "), runs
    assert runs["fsdp2"]["status"] == "stopped" and runs["fsdp2"]["error"].startswith("not started: no space left")
    assert [r["step"] for r in records(out, "ddp") if r["kind"] == "step"][:1] == [0]


def _cgroup_possible() -> bool:
    for root in ("/sys/fs/cgroup/memory", "/sys/fs/cgroup"):
        probe = os.path.join(root, f"shardscope-probe-{os.getpid()}")
        try:
            os.mkdir(probe)
            os.rmdir(probe)
            return os.path.exists(os.path.join(root, "memory.limit_in_bytes")) or os.path.exists(
                os.path.join(root, "cgroup.controllers"))
        except OSError:
            continue
    return False


@pytest.fixture(scope="module")
def oom_runs(tmp_path_factory):
    """One comparison: a rank raising torch's OutOfMemoryError, one over RLIMIT_AS, one OOM-killed."""
    kinds = ["oom", "memlimit"] + (["oomkill"] if _cgroup_possible() else [])
    preset = tmp_path_factory.mktemp("oom") / "oom.toml"
    preset.write_text("steps = 5\nworld_size = 2\nglobal_batch = 4\n[model]\nvocab_size = 128\nd_model = 32\n"
                      "n_layers = 2\nn_heads = 4\nd_ff = 64\nseq_len = 16\n[profile]\nenabled = false\n" + "".join(
                          f'[[runs]]\nname = "{k}"\nstrategy = "ddp"\nfault = "rank=1,step=2,kind={k}"\n' for k in kinds))
    out = preset.parent / "out"
    proc = run_cli(["run", "--preset", str(preset), "--headless", "--out", str(out)])
    for path in glob.glob("/sys/fs/cgroup/memory/shardscope-oomkill-*") + glob.glob("/sys/fs/cgroup/shardscope-oomkill-*"):
        os.rmdir(path)
    return proc, str(out), kinds


@pytest.mark.parametrize("kind", ["oom", "memlimit", "oomkill"])
def test_out_of_memory_is_named(oom_runs, kind):
    proc, out, kinds = oom_runs
    if kind not in kinds:
        pytest.skip("no memory cgroup can be made here (needs root and a cgroup memory controller)")
    assert proc.returncode == 1
    assert_clean(proc, out)
    run = summary_runs(out)[kind]
    assert run["status"] == "failed" and run["error"].startswith("out of memory on rank 1 at step 2"), run["error"]
    if kind == "oomkill":
        assert "killed by the kernel's OOM killer" in run["error"]
    assert [r["step"] for r in records(out, kind, 1) if r["kind"] == "step"] == [0, 1]
