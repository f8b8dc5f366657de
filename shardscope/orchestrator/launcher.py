"""Build and start one run's ``torchrun`` job, and stop it without leaving a process behind.

torchrun starts each worker in a session of its own (``start_new_session=True`` in
torch.distributed.elastic), so signalling torchrun's process group does not reach the ranks.
``RunProcess`` therefore remembers every descendant it has seen (psutil) and, on stop, sends
SIGTERM to torchrun's group (torchrun forwards it to the ranks), then SIGKILL after the grace
period to the group and to every remembered descendant still alive. Nothing outlives the
orchestrator either: see ``lifeline`` (torchrun's parent-death signal, the ranks' watchdog).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import dataclasses
from dataclasses import dataclass, field

import psutil

from shardscope.core import rank_process
from shardscope.core.bounded import child_env
from shardscope.core.events import FLIGHT_RECORDER_ENTRIES, FLIGHT_RECORDER_ENV, PREVIOUS_RUN_ENV
from shardscope.orchestrator import lifeline


@dataclass(frozen=True)
class LaunchPlan:
    """Everything needed to start one run: the command, its environment additions and log file."""

    run: str
    argv: tuple[str, ...]
    env: dict[str, str]
    console_path: str
    cwd: str

    def with_env(self, extra: dict[str, str]) -> "LaunchPlan":
        """Return this plan with ``extra`` added to its environment."""
        return dataclasses.replace(self, env={**self.env, **extra})

    def shell_line(self) -> str:
        """Return the command as one copy-pasteable shell line (env additions first)."""
        import shlex

        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + " ".join(shlex.quote(a) for a in self.argv)


def torchrun_argv(
    spec_path: str,
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str = "",
    rdzv_id: str = "shardscope",
    python: str = sys.executable,
    fork: bool = False,
) -> tuple[str, ...]:
    """Return the exact torchrun command for one run.

    ``fork``: torchrun forks each rank from its own agent (``--start-method fork``) and runs
    ``engines/rank.py`` in it (``--run-path``), so ranks inherit what the agent imported (``engines/agent.py``
    preloads torch and the worker); otherwise each rank is a new interpreter running ``-m shardscope.engines.worker``.

    One node: c10d rendezvous on the given endpoint, or on port 0 of 127.0.0.1 (torchrun's store binds a
    port the kernel picks, as ``--standalone`` does: no window in which a port chosen beforehand could be
    taken by another process). Several nodes: torchrun's
    static rendezvous hosted by node 0 at ``rdzv_endpoint``, with ``--node-rank``: global ranks are then
    ``node_rank * nproc_per_node + local_rank``, so node N's ranks are known before launch (a fault, a
    label, a lost node can be tied to a node). c10d would order nodes by host name and process id, and
    ignores ``--node-rank`` with a warning. The rendezvous id keeps jobs' store keys apart.
    """
    endpoint = rdzv_endpoint or "127.0.0.1:0"
    argv = [
        python, "-m", "torch.distributed.run",
        "--nnodes", str(nnodes),
        "--nproc-per-node", str(nproc_per_node),
        "--rdzv-backend", "c10d" if nnodes == 1 else "static",
        "--rdzv-endpoint", endpoint,
        "--rdzv-id", rdzv_id,
        "--max-restarts", "0",
    ]
    if nnodes > 1:
        argv += ["--node-rank", str(node_rank)]
    if fork:
        argv += ["--start-method", "fork", "--run-path", RANK_SCRIPT, spec_path]
    else:
        argv += ["-m", "shardscope.engines.worker", spec_path]
    return tuple(argv)


# engines/rank.py by its path (torchrun's --run-path wants one): found without importing the rank side (torch)
RANK_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engines", "rank.py")


def endpoint_for_run(endpoint: str, index: int) -> str:
    """Return ``host:port+index``: each run of a multi-node comparison its own rendezvous port.

    A node that finishes a run first starts the next one at once; on the same port it could reach the
    store node 0's previous run still holds, and fail when that store closes.
    """
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        return endpoint
    return f"{host}:{int(port) + index}"


def after_env(previous: list["RunProcess"]) -> dict[str, str]:
    """Environment that makes a run's ranks wait, before their first step, until ``previous`` (torchrun
    jobs still tearing down) are gone (``engines.watchdog.wait_for_previous_run``)."""
    named = []
    for proc in previous:
        try:
            named.append(f"{proc.pid}:{psutil.Process(proc.pid).create_time():.3f}")
        except psutil.Error:  # already gone: nothing to wait for
            continue
    return {PREVIOUS_RUN_ENV: ",".join(named)} if named else {}


KINETO_QUIET = "6"  # above kineto's highest severity (ERROR = 4, USDT = 5): nothing is printed


NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"


def worker_env(device: str) -> dict[str, str]:
    """Return environment additions for ranks: thread counts that do not oversubscribe CPUs."""
    env = {"PYTHONUNBUFFERED": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    # A stalled run's ranks say which collective each one last entered (engines/stall_dump.py).
    env[FLIGHT_RECORDER_ENV] = os.environ.get(FLIGHT_RECORDER_ENV, FLIGHT_RECORDER_ENTRIES)
    # torchrun asks torch.cuda.is_available() before it starts the ranks (LaunchConfig's NUMA default); through
    # the CUDA runtime that marks every process forked afterwards as unable to use CUDA ("Cannot re-initialize
    # CUDA in forked subprocess"), so ranks forked by the agent (launch.start_method = fork) could not train on a
    # GPU. torch's documented remedy: answer it from NVML instead, which leaves forks usable (seen on an H200).
    env[NVML_CHECK_ENV] = os.environ.get(NVML_CHECK_ENV, "1")
    if device == "cpu":
        # Several ranks share the cores; one intra-op thread each keeps them from thrashing.
        env.setdefault("OMP_NUM_THREADS", "1")
        # A CUDA build of torch on a machine without a GPU: kineto (the profiler's backend) logs its
        # failed device probe as an ERROR and a line per profiler window on every run. Level 6 keeps
        # kineto quiet at the source (profiler failures still raise in Python); a user's own
        # KINETO_LOG_LEVEL wins, and the console pane filters what is left (core/console_noise.py).
        if "KINETO_LOG_LEVEL" not in os.environ:
            env["KINETO_LOG_LEVEL"] = KINETO_QUIET
    return env


RESCAN_S = 2.0  # how stale the rank processes' pids may be once every rank was seen (``RunProcess.rank_processes``)


@dataclass
class RunProcess:
    """A started torchrun job: its Popen, and every descendant pid ever seen."""

    plan: LaunchPlan
    popen: subprocess.Popen
    seen: dict[int, float] = field(default_factory=dict)  # pid -> create_time
    _log: object = None
    _ranks: dict[int, int] = field(default_factory=dict)  # the last scan's {pid: global rank}
    _scanned: float = float("-inf")  # time.monotonic() of that scan

    @property
    def pid(self) -> int:
        """The torchrun process id (also its process-group id)."""
        return self.popen.pid

    def poll(self) -> int | None:
        """Return torchrun's exit code, or None while it runs."""
        return self.popen.poll()

    def refresh_descendants(self) -> dict[int, int]:
        """Remember torchrun's current descendants; return {pid: global rank} for worker processes."""
        ranks: dict[int, int] = {}
        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return ranks
        for child in children:
            try:
                self.seen.setdefault(child.pid, child.create_time())
                rank = rank_process.rank_of(child)  # global: several nodes label ranks alike
                if rank is not None:
                    ranks[child.pid] = rank
            except (psutil.Error, ValueError):
                continue
        return ranks

    def rank_processes(self, expected: int, every_s: float = RESCAN_S) -> dict[int, int]:
        """{pid: global rank} of this job's rank processes, rescanned while fewer than ``expected`` are known and
        otherwise at most every ``every_s``. A scan walks every process on the machine (psutil builds its parent map
        from each ``/proc/<pid>/stat``): 4.6 ms with 80 processes on a 2-core VM, five times a second, was half of
        the orchestrator's CPU while the ranks trained, and a preempted rank holds its peers in the next collective
        (2026-11-29). ``stop`` scans again itself; ``kill`` (torchrun already gone, its descendants no longer under
        it) signals what was remembered: between scans each call also walks torchrun's own subtree through
        ``/proc/<pid>/task/<tid>/children`` (a few reads, no scan of the machine), so a process a rank started is
        remembered from the next call on, as it was when every call scanned."""
        now = time.monotonic()
        if len(self._ranks) < expected or now - self._scanned >= every_s:
            self._ranks, self._scanned = self.refresh_descendants(), now
        else:
            self.remember_subtree()
        return self._ranks

    def remember_subtree(self) -> None:
        """Remember every process now under torchrun, read from the kernel's per-thread ``children`` lists (Linux
        with CONFIG_PROC_CHILDREN; elsewhere nothing is added and the scans alone keep ``seen``). psutil has no
        subtree walk of its own: its ``children()`` reads every process on the machine."""
        todo = [self.pid]
        while todo:
            pid = todo.pop()
            for child in _children_of(pid):
                if child not in self.seen:
                    try:
                        self.seen[child] = psutil.Process(child).create_time()
                    except psutil.Error:
                        continue
                todo.append(child)

    def alive_pids(self) -> list[int]:
        """Return the pids of torchrun and of remembered descendants that are still alive (not zombies)."""
        alive = []
        for pid, created in [(self.pid, None), *self.seen.items()]:
            try:
                proc = psutil.Process(pid)
                if created is not None and abs(proc.create_time() - created) > 0.01:
                    continue  # the pid was reused by an unrelated process
                if proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.Error:
                continue
        return alive

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the job, wait up to ``grace_s``, then SIGKILL whatever is left; reap torchrun."""
        self.refresh_descendants()
        _signal_group(self.pid, signal.SIGTERM)
        for pid in self.alive_pids():
            _signal_pid(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and self.alive_pids():
            self.poll()
            time.sleep(0.05)
        self.kill()

    def kill(self, settle_s: float = 10.0) -> None:
        """SIGKILL torchrun's group and every remembered descendant still alive; reap torchrun; wait up to
        ``settle_s`` for the killed descendants to be gone (a killed process needs CPU time to finish exiting,
        so on a loaded machine they outlive the signal for a while: whoever returns after this finds none)."""
        _signal_group(self.pid, signal.SIGKILL)
        for pid in self.alive_pids():
            _signal_pid(pid, signal.SIGKILL)
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + settle_s
        while self.alive_pids() and time.monotonic() < deadline:
            time.sleep(0.02)
        self.close_log()

    def close_log(self) -> None:
        """Close the console log file handle."""
        if self._log is not None:
            self._log.close()  # type: ignore[attr-defined]
            self._log = None


def _children_of(pid: int) -> list[int]:
    """The pids of ``pid``'s children, from ``/proc/<pid>/task/*/children``; [] when unreadable."""
    children: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return children
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as fh:
                children.extend(int(c) for c in fh.read().split())
        except (OSError, ValueError):
            continue
    return children


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_pid(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def launch_env(plan: LaunchPlan) -> dict[str, str]:
    """The whole environment ``plan``'s torchrun gets: this process's, the plan's additions, the lifeline's.

    Call it from the thread that launches runs (the lifeline names it)."""
    return child_env({**os.environ, **plan.env, **lifeline.rank_env()})


def start(plan: LaunchPlan) -> RunProcess:
    """Start the plan's command in a new process group, stdout and stderr appended to its console log.

    Call it from a thread that outlives the job: torchrun gets SIGTERM when that thread ends
    (``lifeline.die_with_parent``), and its ranks stop when this process is gone. Raises OSError
    when the console log cannot be written.
    """
    os.makedirs(os.path.dirname(plan.console_path), exist_ok=True)
    log = open(plan.console_path, "ab", buffering=0)
    try:
        log.write(f"$ {plan.shell_line()}\n".encode())
    except OSError:
        log.close()
        raise
    popen = subprocess.Popen(
        plan.argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        cwd=plan.cwd,
        env=launch_env(plan),
        start_new_session=True,  # its own process group, so the whole job can be signalled
        preexec_fn=lifeline.die_with_parent(),  # torchrun ends when this thread or process does
    )
    return RunProcess(plan=plan, popen=popen, _log=log)
