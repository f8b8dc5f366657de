"""The run directory: the one module that knows the names of the files under ``<out>``.

Layout (DESIGN.md "run directory")::

    <out>/comparison.json        the validated Comparison, written before any run starts
    <out>/init.safetensors       the shared initial weights (init.log: the subprocess that wrote them)
    <out>/orchestrator.json      the orchestrator's identity (liveness.IDENTITY_FILE)
    <out>/devices.jsonl          device samples (devices.node<N>.jsonl from other nodes)
    <out>/nodes/node<N>.json     heartbeats of nodes other than 0
    <out>/summary.json  report.md  plots/  diff/
    <out>/<run>/spec.json        what the ranks run
    <out>/<run>/status.json      the orchestrator's verdict
    <out>/<run>/console.log      torchrun's output (console.node<N>.log from other nodes)
    <out>/<run>/metrics/rank<R>.jsonl   records, one file per global rank
    <out>/<run>/traces/          profiler traces (traces/tb: the TensorBoard plugin's layout,
                                 traces/merged_trace.json: every rank in one Perfetto trace)

Everything else reads and writes these through ``RunDir`` / ``RunFiles`` and the readers here.
Torch-free and psutil-free: the app, ``report`` and ``open`` use it.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Any

from shardscope.console_noise import clean
from shardscope.liveness import IDENTITY_FILE
from shardscope.numbers import read_json

COMPARISON = "comparison.json"
SUMMARY = "summary.json"
REPORT = "report.md"
PLOTS = "plots"
DIFF = "diff"
INIT_WEIGHTS = "init.safetensors"
INIT_LOG = "init.log"
SPEC = "spec.json"
STATUS = "status.json"
METRICS = "metrics"
TRACES = "traces"
TB = "tb"
MERGED_TRACE = "merged_trace.json"


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
        return os.path.join(self.path, "console.log" if node_rank == 0 else f"console.node{node_rank}.log")

    @property
    def metrics(self) -> str:
        """The directory of per-rank record files."""
        return os.path.join(self.path, METRICS)

    def rank_file(self, rank: int) -> str:
        """``metrics/rank<R>.jsonl``."""
        return os.path.join(self.metrics, f"rank{rank}.jsonl")

    def rank_files(self) -> list[str]:
        """Every rank's record file present, sorted by name."""
        return sorted(glob.glob(os.path.join(self.metrics, "rank*.jsonl")))

    @property
    def traces(self) -> str:
        """The directory of profiler traces."""
        return os.path.join(self.path, TRACES)

    @property
    def tb(self) -> str:
        """``traces/tb``: the TensorBoard profiler plugin's layout."""
        return os.path.join(self.traces, TB)

    @property
    def merged_trace(self) -> str:
        """``traces/merged_trace.json``: every rank's trace in one Perfetto timeline."""
        return os.path.join(self.traces, MERGED_TRACE)


@dataclass(frozen=True)
class RunDir:
    """A comparison's output directory ``<out>``."""

    path: str

    def run(self, name: str) -> RunFiles:
        """The files of run ``name``."""
        return RunFiles(os.path.join(self.path, name))

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

    @property
    def diff(self) -> str:
        """The directory ``shardscope diff`` writes its plots to."""
        return os.path.join(self.path, DIFF)

    @property
    def init_weights(self) -> str:
        """``init.safetensors``: the shared initial weights."""
        return os.path.join(self.path, INIT_WEIGHTS)

    @property
    def init_log(self) -> str:
        """``init.log``: output of the subprocess that wrote the initial weights."""
        return os.path.join(self.path, INIT_LOG)

    @property
    def identity(self) -> str:
        """``orchestrator.json``: the orchestrator's host, pid and start time."""
        return os.path.join(self.path, IDENTITY_FILE)

    def devices(self, node_rank: int = 0) -> str:
        """Device samples of node ``node_rank`` (``devices.jsonl`` on node 0)."""
        return os.path.join(self.path, "devices.jsonl" if node_rank == 0 else f"devices.node{node_rank}.jsonl")

    def heartbeat(self, node_rank: int) -> str:
        """``nodes/node<N>.json``: node N's heartbeat (nodes other than 0)."""
        return os.path.join(self.path, "nodes", f"node{node_rank}.json")

    def holds_comparison(self) -> bool:
        """True when a comparison was already written here."""
        return os.path.exists(self.comparison)


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
    return "\n".join(clean(text).splitlines()[-max_lines:])
