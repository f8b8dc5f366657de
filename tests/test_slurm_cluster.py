"""The sbatch script ``shardscope slurm`` writes, submitted unmodified to a real two-node SLURM cluster.

The cluster (``slurm_cluster.LocalSlurm``) runs on this machine when slurm-wlm and munge are installed
(``.ci/run`` installs them); elsewhere these tests skip with the reason. Jobs are tiny (smoke preset,
3 steps, one rank per node) so the whole module costs a few torchrun launches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardscope.core import events

sys.path.insert(0, os.path.dirname(__file__))
from slurm_cluster import LocalSlurm, SlurmUnavailable  # noqa: E402
from test_cli_e2e import leftover_processes  # noqa: E402

CLI = [sys.executable, "-m", "shardscope.cli"]
TINY = ["--set", "steps=3", "--set", "profile.enabled=false"]
JOB_TIMEOUT_S = 240
# Real SLURM daemons and torchrun jobs: the newest torch's suite (slow); the floor runs the unit tests and every
# strategy once end to end (.ci/run).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A running two-node SLURM cluster for this module (skips when it cannot run here)."""
    try:
        slurm = LocalSlurm.start(tmp_path_factory.mktemp("slurm"))
    except SlurmUnavailable as err:
        pytest.skip(f"no local SLURM cluster: {err}")
    yield slurm
    slurm.stop()


def write_script(directory: Path, *args: str) -> Path:
    """Write ``shardscope slurm ARGS`` into ``directory/job.sbatch`` and return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([*CLI, "slurm", "--preset", "smoke", "--nodes", "2", *args], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    path = directory / "job.sbatch"
    path.write_text(proc.stdout)
    return path


def submit(cluster: LocalSlurm, script: Path) -> str:
    """sbatch the script from its own directory; return the job id."""
    proc = cluster.run("sbatch", "--parsable", script.name, cwd=script.parent)
    assert proc.returncode == 0, proc.stderr + cluster.logs()
    return proc.stdout.strip().split(";")[0]


def job_out(script: Path, job: str) -> Path:
    """The run directory the script chose (its default, under the submission directory)."""
    return script.parent / "shardscope-runs" / f"slurm-{job}-smoke"


def job_log(script: Path, job: str) -> str:
    """The job's output file."""
    path = script.parent / f"shardscope-{job}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def runs_of(out: Path) -> dict[str, dict]:
    """The summary's runs by name."""
    return {r["name"]: r for r in json.loads((out / "summary.json").read_text())["runs"]}


def assert_clean_finish(log: str) -> None:
    """Both orchestrators finished by themselves: none was killed by srun or the scheduler."""
    assert "0: shardscope: node 0 finished" in log and "1: shardscope: node 1 finished" in log, log[-4000:]
    for bad in ("CANCELLED", "srun: error", "Terminating"):
        assert bad not in log, log[-4000:]


def test_two_jobs_at_once_cpu_and_gpu_variants_odd_set_values_and_a_space_in_the_path(cluster, tmp_path):
    """Two jobs share both nodes at once and both end ok: the CPU variant submitted from a directory with
    a space with a --set value full of quotes, and the GPU variant on the cluster's fake GPU gres."""
    tricky = 'two words, "quoted" & \'single\' $HOME `x`'
    cpu = write_script(tmp_path / "with space", "--cpus-per-node", "1", *TINY, "--set", f"description={json.dumps(tricky)}")
    gpu = write_script(tmp_path / "gpu", "--gpus-per-node", "1", "--cpus-per-rank", "1", *TINY,
                       "--set", 'launch.device="cpu"')
    assert "#SBATCH --gpus-per-node" not in cpu.read_text() and "#SBATCH --gpus-per-node=1" in gpu.read_text()
    jobs = [(cpu, submit(cluster, cpu)), (gpu, submit(cluster, gpu))]
    for script, job in jobs:
        cluster.wait_job(job, JOB_TIMEOUT_S)
    for script, job in jobs:
        out, log = job_out(script, job), job_log(script, job)
        assert_clean_finish(log)
        assert cluster.job_end(job) == ("COMPLETED", "0:0")  # every run ok: the job completed
        assert {n: r["status"] for n, r in runs_of(out).items()} == {"ddp": "ok", "fsdp2": "ok"}, log[-4000:]
        for run in ("ddp", "fsdp2"):
            # node 0 owns the run's console and verdict; node 1 keeps its own console beside it
            assert (out / run / "console.log").exists() and (out / run / "console.node1.log").exists()
            assert json.loads((out / run / "status.json").read_text())["status"] == "ok"
            assert sorted(p.name for p in (out / run / "metrics").iterdir()) == ["rank0.jsonl", "rank1.jsonl"]
        labels = {r["label"] for line in (out / "devices.node1.jsonl").read_text().splitlines()
                  for r in json.loads(line)["readings"]}
        assert labels and all(lb.startswith("node 1 (") and "rank 1" in lb for lb in labels), labels
    assert json.loads((job_out(cpu, jobs[0][1]) / "comparison.json").read_text())["description"] == tricky


def test_fault_on_a_rank_of_node_1_fails_that_run_with_its_own_error_and_the_next_run_goes_on(cluster, tmp_path):
    """Rank 1 (node 1) raises at step 2 of the ddp run: ddp is failed with rank 1's own error (rank 0's
    broken connection shown as a consequence), fsdp2 then runs ok, and no node is cancelled."""
    script = write_script(tmp_path, "--cpus-per-node", "1", *TINY, "--set", "runs.ddp.fault='rank=1,step=2,kind=raise'")
    job = submit(cluster, script)
    cluster.wait_job(job, JOB_TIMEOUT_S)
    out, log = job_out(script, job), job_log(script, job)
    assert_clean_finish(log)
    runs = runs_of(out)
    assert runs["ddp"]["status"] == "failed", log[-4000:]
    assert runs["ddp"]["error"] == "RuntimeError: injected fault at step 2 on rank 1"
    assert runs["fsdp2"]["status"] == "ok"
    # No node was cancelled, yet the job's own state says a run failed (after every node finished).
    assert cluster.job_end(job) == ("FAILED", "1:0") and "shardscope: runs not ok: ddp failed" in log
    verdict = json.loads((out / "ddp" / "status.json").read_text())
    assert verdict["error"] == runs["ddp"]["error"] and verdict["traceback"].startswith("root cause on rank 1")
    rank1, _ = events.read_records(out / "ddp" / "metrics" / "rank1.jsonl")
    assert [r["message"] for r in rank1 if r["kind"] == "error"] == [runs["ddp"]["error"]]


def test_scancel_mid_run_stops_the_runs_writes_the_summary_and_leaves_nothing(cluster, tmp_path):
    """scancel while ddp trains: every run ends `stopped`, node 0 still writes the summary, no process is left."""
    script = write_script(tmp_path, "--cpus-per-node", "1", "--set", "steps=100000", "--set", "profile.enabled=false")
    job = submit(cluster, script)
    out = job_out(script, job)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    rank1 = out / "ddp" / "metrics" / "rank1.jsonl"
    while not (rank1.exists() and b'"kind":"step"' in rank1.read_bytes()):
        assert time.monotonic() < deadline and cluster.job_state(job), job_log(script, job)[-4000:]
        time.sleep(0.5)
    assert cluster.run("scancel", job).returncode == 0
    cluster.wait_job(job, JOB_TIMEOUT_S)
    deadline = time.monotonic() + 30  # the job left the queue; its last processes may take a moment
    while leftover_processes(str(out)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert leftover_processes(str(out)) == []
    runs = runs_of(out)
    assert runs["ddp"]["status"] == "stopped" and runs["ddp"]["steps_completed"] >= 1, job_log(script, job)[-4000:]
    assert runs["fsdp2"]["status"] == "stopped" and runs["fsdp2"]["steps_completed"] == 0
