"""A real two-node SLURM cluster on this machine, for tests of the sbatch script ``shardscope slurm`` writes.

Debian's ``slurm-wlm`` is built with multiple-slurmd support, so two ``slurmd`` daemons on one host act as two
nodes. Everything lives under one fresh directory: a munge key and socket, ``slurm.conf``, ``gres.conf``, state,
spool and logs. No cgroups (``proctrack/linuxproc``, ``task/none``), no accounting, no MPI. Node names do not
resolve (``ssnode0``, ``ssnode1``; ``NodeAddr=127.0.0.1``), as on clusters where only ``NodeAddr`` is an address,
and each node offers one fake GPU (``File=/dev/null``) so a GPU-shaped script can be scheduled on CPU nodes.

``LocalSlurm.start(root)`` returns a running cluster or raises ``SlurmUnavailable`` with the reason.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

NODE_NAMES = ("ssnode0", "ssnode1")
CPUS_PER_NODE = 2  # two jobs of one CPU per node fit at once (the machine's cores are shared, as on a real node)


class SlurmUnavailable(RuntimeError):
    """The cluster cannot run here (binaries missing, a daemon did not come up); the message says why."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _conf(root: Path, ctld_port: int, node_ports: list[int]) -> str:
    nodes = "\n".join(
        f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs={CPUS_PER_NODE} "
        f"RealMemory=1000 Gres=gpu:1 State=UNKNOWN" for name, port in zip(NODE_NAMES, node_ports))
    return f"""ClusterName=shardscope-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
ReturnToService=2
# SLURM's default: scancel's SIGTERM, then SIGKILL 30 s later; node 0 writes the summary in between
KillWait=30
GresTypes=gpu
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class LocalSlurm:
    """A running local cluster: its config, environment for clients, and the daemons to stop."""

    root: Path
    conf: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """The environment for SLURM clients (sbatch, squeue, scancel) of this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    @classmethod
    def start(cls, root: Path, timeout_s: float = 30.0) -> "LocalSlurm":
        """Start munged, slurmctld and one slurmd per node under ``root``; raise SlurmUnavailable if it cannot."""
        for tool in ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "sinfo"):
            if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
                raise SlurmUnavailable(f"{tool} is not installed (apt-get install slurm-wlm munge)")
        if os.geteuid() != 0:
            raise SlurmUnavailable("the local SLURM cluster runs its daemons as root (SlurmUser=root)")
        root.mkdir(parents=True, exist_ok=True)
        for sub in ("state", *(f"spool/{n}" for n in NODE_NAMES)):
            (root / sub).mkdir(parents=True, exist_ok=True)
        cluster = cls(root, root / "slurm.conf")
        cluster.conf.write_text(_conf(root, _free_port(), [_free_port() for _ in NODE_NAMES]))
        (root / "gres.conf").write_text("AutoDetect=off\n" + "".join(
            f"NodeName={n} Name=gpu Count=1 File=/dev/null\n" for n in NODE_NAMES))
        key = root / "munge.key"
        try:
            subprocess.run([_sbin("mungekey"), "-c", "-k", str(key)], check=True, capture_output=True, timeout=30)
            os.chmod(key, 0o600)
            cluster._spawn([_sbin("munged"), "-F", "-f", "-S", str(root / "munge.sock"), f"--key-file={key}",
                            f"--log-file={root}/munged.log", f"--pid-file={root}/munged.pid",
                            f"--seed-file={root}/munged.seed"], "munged")
            cluster._wait(lambda: (root / "munge.sock").exists(), "munged socket", timeout_s)
            cluster._spawn([_sbin("slurmctld"), "-D", "-i", "-f", str(cluster.conf)], "slurmctld")
            for name in NODE_NAMES:
                cluster._spawn([_sbin("slurmd"), "-D", "-N", name, "-f", str(cluster.conf)], f"slurmd.{name}")
            cluster._wait(cluster._nodes_idle, "both nodes idle in sinfo", timeout_s)
        except BaseException as err:
            logs = cluster.logs()
            cluster.stop()
            if isinstance(err, SlurmUnavailable):
                raise SlurmUnavailable(f"{err}\n{logs}") from None
            raise
        return cluster

    def _spawn(self, argv: list[str], name: str) -> None:
        log = open(self.root / f"{name}.out", "wb")
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           env=self.env, start_new_session=True))
        log.close()

    def _wait(self, ready, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready():
                return
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead:
                raise SlurmUnavailable(f"{', '.join(map(str, dead))} exited while waiting for {what}")
            time.sleep(0.2)
        raise SlurmUnavailable(f"timed out after {timeout_s:g} s waiting for {what}")

    def _nodes_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True,
                             timeout=10)
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in NODE_NAMES)

    def run(self, *argv: str, cwd: str | os.PathLike[str] | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run a SLURM client command against this cluster; return the completed process (text output)."""
        return subprocess.run(list(argv), env={**self.env, **(env or {})}, cwd=cwd, capture_output=True, text=True,
                              timeout=60)

    def job_state(self, job_id: str) -> str:
        """Return the job's state from squeue (PENDING, RUNNING, COMPLETING, ...), or "" once it has left."""
        out = self.run("squeue", "-h", "-j", job_id, "-o", "%T")
        return out.stdout.strip()

    def job_end(self, job_id: str) -> tuple[str, str]:
        """Return (JobState, ExitCode) of a finished job from ``scontrol show job`` (kept MinJobAge seconds)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        fields = dict(part.split("=", 1) for part in out.split() if "=" in part)
        return fields.get("JobState", ""), fields.get("ExitCode", "")

    def wait_job(self, job_id: str, timeout_s: float) -> None:
        """Wait until the job has left the queue; raise TimeoutError (after scancel) if it has not."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.job_state(job_id):
                return
            time.sleep(0.5)
        self.run("scancel", job_id)
        raise TimeoutError(f"job {job_id} still queued after {timeout_s:g} s; cancelled\n{self.logs()}")

    def logs(self, lines: int = 15) -> str:
        """Return the last lines of every daemon log (for failure messages)."""
        parts = []
        for path in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts)

    def stop(self) -> None:
        """Stop every daemon (SIGTERM, then SIGKILL) in reverse start order."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


def _sbin(tool: str) -> str:
    return shutil.which(tool) or f"/usr/sbin/{tool}"
