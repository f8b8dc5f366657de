"""The run directory: the one module that knows the names of the files under ``<out>``.

Layout (DESIGN.md "run directory")::

    <out>/comparison.json        the validated Comparison, written before any run starts
    <out>/init.safetensors       the shared initial weights (written by the first run's ranks)
    <out>/orchestrator.json      the orchestrator's identity (host, pid, start time; liveness reads it)
    <out>/devices.jsonl          device samples (devices.node<N>.jsonl from other nodes)
    <out>/nodes/node<N>.json     heartbeats of nodes other than 0
    <out>/summary.json  report.md  plots/<name>.png  diff/  merged_trace.json (every run's traces in one
                                 Perfetto timeline)  shardscope-dashboard.svg (the app's export)
    <out>/.shardscope-spare      disk space held back for the verdicts, freed when the disk fills
    <out>/.shardscope-lock       the exclusive lock of the command writing here (.node<N>: other nodes)
    <out>/<run>/spec.json        what the ranks run (<out>/<run>.attempt<k>/: a restarted run's earlier attempt)
    <out>/<run>/status.json      the orchestrator's verdict (stall-request: made when the run stalled)
    <out>/<run>/console.log      torchrun's output (console.node<N>.log from other nodes)
    <out>/<run>/metrics/rank<R>.jsonl   records, one file per global rank
    <out>/<run>/traces/rank<R>.trace.json   profiler traces (traces/tb: the TensorBoard plugin's layout,
                                 rank<R>.*.pt.trace.json, named by torch's handler)
    <out>/why/<run>/why.json     shardscope why's result for <run>; why/<run>/round<k>/: each round of its
                                 controlled re-runs, a comparison directory of its own

Everything else reads and writes these through ``RunDir`` / ``RunFiles`` and the readers here.
Torch-free and psutil-free: the app, ``report`` and ``open`` use it.
"""

from __future__ import annotations

import fcntl
import glob
import os
import re
import socket
from dataclasses import dataclass
from typing import Any

from shardscope.core.console_noise import clean
from shardscope.core.text import clean as text_clean
from shardscope.core.numbers import read_json

COMPARISON = "comparison.json"
SUMMARY = "summary.json"
REPORT = "report.md"
PLOTS = "plots"
DIFF = "diff"
INIT_WEIGHTS = "init.safetensors"
SPEC = "spec.json"
STALL_REQUEST = "stall-request"
STATUS = "status.json"
METRICS = "metrics"
TRACES = "traces"
TB = "tb"
MERGED_TRACE = "merged_trace.json"
IDENTITY = "orchestrator.json"
NODES = "nodes"
SCREENSHOT = "shardscope-dashboard.svg"
SPARE = ".shardscope-spare"
# a torchrun agent started ahead of its run finished its imports (one name per node: nodes may share <out>)
AGENT_READY = ".shardscope-agent{seq}.node{node}.ready"
LOCK = ".shardscope-lock"  # held (flock) by the command that owns the directory; .shardscope-lock.node<N> per node
RANK_SPARE_SUFFIX = ".spare"  # metrics/rank<R>.jsonl.spare: room a rank keeps for its last records
PARTIAL_SUFFIX = ".tmp"  # a file being written (torch's trace handler, the initial weights' atomic write)
PLOT_SUFFIX = ".png"
RECORDS_SUFFIX = ".jsonl"
CHROME_SUFFIX = ".trace.json"
TB_SUFFIX = ".pt.trace.json"
WHY = "why"  # <out>/why/<run>/: shardscope why's re-runs of <run>
WHY_RESULT = "why.json"
TUNE_RESULT = "tune.json"  # a tune's proving comparison: the search's answer and every candidate (report.md's section)
_WHY_ROUND = "round"  # why/<run>/round<k>  # torch.profiler.tensorboard_trace_handler's files: <worker>.<id>.pt.trace.json


def console_name(node_rank: int = 0) -> str:
    """The file name of node ``node_rank``'s torchrun console log in a run directory (``console.log`` on node 0)."""
    return "console.log" if node_rank == 0 else f"console.node{node_rank}.log"


_DEVICES_STEM = "devices"


def devices_name(node_rank: int = 0) -> str:
    """The file name of node ``node_rank``'s device samples in ``<out>`` (``devices.jsonl`` on node 0)."""
    return _DEVICES_STEM + RECORDS_SUFFIX if node_rank == 0 else f"{_DEVICES_STEM}.node{node_rank}{RECORDS_SUFFIX}"


_RANK_FILE = re.compile(r"rank(\d+)" + re.escape(RECORDS_SUFFIX) + "$")


def record_file_rank(path: str) -> int | None:
    """The global rank of a record file (``.../rank3.jsonl`` -> 3), None when it is not one."""
    match = _RANK_FILE.search(path)
    return int(match.group(1)) if match else None


def rank_record_files(metrics_dir: str) -> list[str]:
    """Every rank's record file (``rank<R>.jsonl``) present in a ``metrics`` directory, in rank order."""
    found = [p for p in glob.glob(os.path.join(glob.escape(metrics_dir), "rank*" + RECORDS_SUFFIX))
             if record_file_rank(p) is not None]
    return sorted(found, key=lambda p: record_file_rank(p) or 0)


def plot_file(plots_dir: str, name: str) -> str:
    """The PNG file of plot ``name`` in ``plots_dir``."""
    return os.path.join(plots_dir, name + PLOT_SUFFIX)


def tb_worker(rank: int) -> str:
    """The worker name a rank gives torch's TensorBoard trace handler (its files start with it)."""
    return f"rank{rank}"


@dataclass(frozen=True)
class RunFiles:
    """The files of one run: ``<out>/<name>``."""

    path: str

    @property
    def name(self) -> str:
        """The run's name (its directory's name)."""
        return os.path.basename(self.path.rstrip(os.sep))

    @property
    def spec(self) -> str:
        """``spec.json``: what the ranks run."""
        return os.path.join(self.path, SPEC)

    @property
    def status(self) -> str:
        """``status.json``: the orchestrator's verdict."""
        return os.path.join(self.path, STATUS)

    def console(self, node_rank: int = 0) -> str:
        """torchrun's output on node ``node_rank`` (``console.log`` on node 0)."""
        return os.path.join(self.path, console_name(node_rank))

    @property
    def stall_request(self) -> str:
        """``stall-request``: made by the orchestrator of a stalled run; each rank then writes a ``stall`` record."""
        return os.path.join(self.path, STALL_REQUEST)

    @property
    def metrics(self) -> str:
        """The directory of per-rank record files."""
        return os.path.join(self.path, METRICS)

    def rank_file(self, rank: int) -> str:
        """``metrics/rank<R>.jsonl``."""
        return os.path.join(self.metrics, f"rank{rank}{RECORDS_SUFFIX}")

    def rank_files(self) -> list[str]:
        """Every rank's record file present, in rank order."""
        return rank_record_files(self.metrics)

    def rank_spares(self) -> list[str]:
        """Spare files ranks keep beside their record files (``rank<R>.jsonl.spare``) that still exist."""
        return sorted(glob.glob(os.path.join(glob.escape(self.metrics), "rank*.jsonl" + RANK_SPARE_SUFFIX)))

    @property
    def traces(self) -> str:
        """The directory of profiler traces."""
        return os.path.join(self.path, TRACES)

    @property
    def tb(self) -> str:
        """``traces/tb``: the TensorBoard profiler plugin's layout."""
        return os.path.join(self.traces, TB)

    def chrome_trace(self, rank: int) -> str:
        """``traces/rank<R>.trace.json``: rank R's Chrome/Perfetto trace."""
        return os.path.join(self.traces, f"rank{rank}{CHROME_SUFFIX}")

    def chrome_traces(self) -> list[str]:
        """Every rank's Chrome trace present (``.trace.json`` or ``.trace.json.gz``), unsorted."""
        pattern = os.path.join(glob.escape(self.traces), "rank*" + CHROME_SUFFIX)
        return glob.glob(pattern) + glob.glob(pattern + ".gz")

    def tb_files(self, rank: int | None = None) -> list[str]:
        """The TensorBoard plugin's trace files (of ``rank`` only, when given), sorted by name."""
        worker = "*" if rank is None else tb_worker(rank) + ".*"
        return sorted(glob.glob(os.path.join(glob.escape(self.tb), worker + TB_SUFFIX)))

    def tb_partials(self, rank: int) -> list[str]:
        """Half-written temporary traces torch's handler left for ``rank`` (``<file>.tmp``)."""
        return glob.glob(os.path.join(glob.escape(self.tb), tb_worker(rank) + ".*" + PARTIAL_SUFFIX))

    def trace_partials(self) -> list[str]:
        """Every rank's half-written temporary traces (``traces/tb/*.tmp``): a rank killed while torch's handler
        wrote its trace (its peer failed first) leaves one that no one else removes."""
        return sorted(glob.glob(os.path.join(glob.escape(self.tb), "*" + PARTIAL_SUFFIX)))

    def trace_files(self) -> list[str]:
        """Every file under ``traces/`` (TensorBoard's included), sorted."""
        return sorted(glob.glob(os.path.join(glob.escape(self.traces), "**", "*.*"), recursive=True))


@dataclass(frozen=True)
class RunDir:
    """A comparison's output directory ``<out>``."""

    path: str

    def run(self, name: str) -> RunFiles:
        """The files of run ``name``."""
        return RunFiles(os.path.join(self.path, name))

    def attempt(self, name: str, k: int) -> str:
        """``<name>.attempt<k>``: where a restarted run's earlier attempt ``k`` is kept."""
        return os.path.join(self.path, f"{name}.attempt{k}")

    @property
    def comparison(self) -> str:
        """``comparison.json``."""
        return os.path.join(self.path, COMPARISON)

    @property
    def summary(self) -> str:
        """``summary.json``."""
        return os.path.join(self.path, SUMMARY)

    @property
    def report(self) -> str:
        """``report.md``."""
        return os.path.join(self.path, REPORT)

    @property
    def plots(self) -> str:
        """The directory of report plots."""
        return os.path.join(self.path, PLOTS)

    def plot(self, name: str) -> str:
        """``plots/<name>.png``."""
        return plot_file(self.plots, name)

    def plot_files(self) -> list[str]:
        """Every report plot present, sorted."""
        return sorted(glob.glob(plot_file(glob.escape(self.plots), "*")))

    @property
    def merged_trace(self) -> str:
        """``merged_trace.json``: every run's traces in one Perfetto timeline."""
        return os.path.join(self.path, MERGED_TRACE)

    @property
    def spare(self) -> str:
        """``.shardscope-spare``: the space kept free for the verdicts and the summary (outspace.Spare)."""
        return os.path.join(self.path, SPARE)

    def agent_ready(self, seq: int, node_rank: int = 0) -> str:
        """``.shardscope-agent<seq>.node<N>.ready``: created by node N's ``seq``-th agent started ahead once its
        imports are done."""
        return os.path.join(self.path, AGENT_READY.format(seq=seq, node=node_rank))

    @property
    def diff(self) -> str:
        """The directory ``shardscope diff`` writes its plots to."""
        return os.path.join(self.path, DIFF)

    def why_dir(self, run: str) -> str:
        """``why/<run>``: where ``shardscope why`` keeps its re-runs of ``run`` and its result."""
        return os.path.join(self.path, WHY, run)

    def why_round(self, run: str, k: int) -> str:
        """``why/<run>/round<k>``: round ``k`` of why's re-runs of ``run``, a comparison directory of its own."""
        return os.path.join(self.why_dir(run), f"{_WHY_ROUND}{k}")

    def why_result(self, run: str) -> str:
        """``why/<run>/why.json``: why's result for ``run``."""
        return os.path.join(self.why_dir(run), WHY_RESULT)

    @property
    def tune_result(self) -> str:
        """``tune.json``: in a tune's proving comparison, the search it proved."""
        return os.path.join(self.path, TUNE_RESULT)

    def why_results(self) -> list[str]:
        """Every why result present, sorted."""
        return sorted(glob.glob(os.path.join(glob.escape(self.path), WHY, "*", WHY_RESULT)))

    @property
    def init_weights(self) -> str:
        """``init.safetensors``: the shared initial weights."""
        return os.path.join(self.path, INIT_WEIGHTS)

    @property
    def identity(self) -> str:
        """``orchestrator.json``: the orchestrator's host, pid and start time."""
        return os.path.join(self.path, IDENTITY)

    def devices(self, node_rank: int = 0) -> str:
        """Device samples of node ``node_rank`` (``devices.jsonl`` on node 0)."""
        return os.path.join(self.path, devices_name(node_rank))

    def heartbeat(self, node_rank: int) -> str:
        """``nodes/node<N>.json``: node N's heartbeat (nodes other than 0)."""
        return os.path.join(self.path, NODES, f"node{node_rank}.json")

    def record_server_stats(self) -> str:
        """``nodes/record_server.json``: what node 0's record server refused and took (records over TCP)."""
        return os.path.join(self.path, NODES, "record_server.json")

    def holds_comparison(self) -> bool:
        """True when a comparison was already written here."""
        return os.path.exists(self.comparison)

    def contains(self, path: str) -> bool:
        """True when ``path``, links resolved, lies inside this directory (a symlinked ``plots/`` pointing
        elsewhere does not)."""
        root = os.path.realpath(self.path)
        return os.path.realpath(path).startswith(root + os.sep)

    def foreign_entries(self, run_names: list[str] | tuple[str, ...] = ()) -> list[str]:
        """Names in the directory that no shardscope command wrote, when it holds no comparison (a user's
        files: a comparison must not mix with them); [] when missing, empty, or a comparison's own. What other
        nodes of the same comparison may write before node 0 looks (their lock files, heartbeats, spare,
        device samples and ``run_names``' directories) is not foreign."""
        try:
            names = sorted(os.listdir(self.path))
        except OSError:
            return []
        if self.holds_comparison():
            return []
        ours = {SPARE, NODES, *run_names}
        return [n for n in names if n not in ours and not n.startswith(LOCK)
                and not (n.startswith(_DEVICES_STEM) and n.endswith(RECORDS_SUFFIX))]

    def lock(self, node_rank: int = 0) -> str:
        """Take this node's exclusive lock on the directory for the rest of this process ("" when taken or
        already held here), else one line naming the holder. Creates the directory. The kernel releases the
        lock when the process ends, however it ends; torchrun's children do not inherit it (close-on-exec)."""
        path = os.path.join(self.path, LOCK if node_rank == 0 else f"{LOCK}.node{node_rank}")
        key = os.path.realpath(path)
        if key in _HELD:
            return ""
        os.makedirs(self.path, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            return f"{self.path}: in use by another shardscope command ({holder}); choose another --out"
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        _HELD[key] = fd
        return ""


_HELD: dict[str, int] = {}  # lock file (real path) -> descriptor this process holds it through


def read_json_or_none(path: str) -> Any:
    """Return the JSON document at ``path`` (non-finite floats restored), or None when missing or unreadable."""
    try:
        return read_json(path)
    except (OSError, ValueError):
        return None


def tail_text(path: str, max_lines: int = 40) -> str:
    """Return the last ``max_lines`` lines of a text file, known library noise left out ("" if it does not exist)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text_clean(clean(text)).splitlines()[-max_lines:])  # noise out, then no terminal control


def load_summary(out_dir: str) -> dict[str, Any]:
    """Return ``<out_dir>/summary.json`` (non-finite figures restored); raises OSError when it cannot be
    read and ValueError when it is not JSON or not a comparison summary (an object with a ``runs`` list)."""
    data = read_json(RunDir(out_dir).summary)
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise ValueError(f"{RunDir(out_dir).summary}: not a comparison summary (no list of runs)")
    return data


def read_summary(out_dir: str) -> dict[str, Any] | None:
    """Return ``<out_dir>/summary.json`` as ``load_summary`` does, or None when missing or unreadable."""
    try:
        return load_summary(out_dir)
    except (OSError, ValueError):
        return None
