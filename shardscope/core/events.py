"""Metric records: the one contract between ranks and the orchestrator.

Every rank appends one flat JSON object per line to ``<run>/metrics/rank<R>.jsonl`` and
flushes after each line. Every record carries ``v`` (schema version), ``kind``, ``run``,
``rank``, ``t`` (unix seconds) and, where it applies, ``step``. Metric names carry their unit
(``step_time_s``, ``mem_peak_bytes``). Readers ignore keys they do not know and count and skip
lines that are not valid JSON objects.

This module never imports torch: the orchestrator and the app use it too.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from shardscope.core.rundir import RANK_SPARE_SUFFIX

SCHEMA_VERSION = 1

# Kinds of record, and what each carries beyond the common keys.
START = "start"  # spec (resolved RunSpec dict), world_size, device, backend, versions, precision{...},
# startup{stage: epoch s}, forked (the rank was forked from an agent that had imported the worker: engines/rank.py)
STEP = "step"  # step, local_loss (this rank's mean; the run's loss is the mean over ranks, profiling/loss_fold.py),
#               loss? (the global loss, only on steps whose verdict reduced it), grad_norm (global), lr,
#               step_time_s, tokens, tokens_per_s, samples_per_s?, mem_*_bytes; CPU: busy_s, idle_s, time_<phase>_s,
#               cpu_wait_s? (run-queue wait of the main thread, Linux)
MEMORY = "memory"  # param_bytes, grad_bytes, optim_bytes, model_state_bytes, mem_*_bytes, rss_bytes
TRACE = "trace"  # path (relative to the run directory), format ("chrome" | "tensorboard"), steps
LAYERS = "layers"  # step, grad_norms {layer: norm}, param_norms {layer: norm} (parity mode)
COMM = "comm"  # bytes and calls per collective counted in-rank over the profiled window (profile.count_collectives)
ERROR = "error"  # message, traceback
STALL = "stall"  # asked by the orchestrator of a stalled run: step, collectives (the flight recorder's last
#                  entries: seq, op, group, sizes, entered_t, done), stack (every thread's Python stack)
PROBE = "probe"  # shardscope why's re-runs only: step, dp_rank, tp_rank, forward [[module, norm, [projections],
#                  hash, shape, dtype], ...] in execution order; rank 0 also grads [...] of each module's own
#                  parameters (full tensors) or grads_note, why not (engines/module_probe.py)
END = "end"  # status ("ok" | "failed" | "stopped" | "diverged"), steps_completed; reason (stopped: "orchestrator
#              lost"); compiled_graphs when compile is on; first_nonfinite_step and nonfinite ("loss",
#              "grad_norm") when diverged

ORCHESTRATOR_LOST = "orchestrator lost"  # an end record's reason when the rank's orchestrator disappeared
# Environment variable naming the orchestrator each rank watches: "<pid>:<create_time>:<tid>" (engines/watchdog.py).
ORCHESTRATOR_ENV = "SHARDSCOPE_ORCHESTRATOR"
# "<pid>:<create_time>[,...]": the previous run's torchrun, still tearing down when this run was launched;
# the ranks train only once it is gone (start-up overlaps the previous run's teardown, never its steps)
PREVIOUS_RUN_ENV = "SHARDSCOPE_AFTER"
# "<pid>:<create_time>:<ready path>": the next run's torchrun agent, started beside this run's start-up
# (orchestrator/prestart.py); the ranks train only once it finished its imports (the path exists) or is gone
WARM_AGENT_ENV = "SHARDSCOPE_WARM_AGENT"
# torch's flight recorder (every collective's sequence number, kind, sizes, state), read by a stalled rank
FLIGHT_RECORDER_ENV, FLIGHT_RECORDER_ENTRIES = "TORCH_FR_BUFFER_SIZE", "2000"
# Profiler ranges the training loop opens around each phase; the trace analysis reads them back.
PHASE_MARKERS = {"forward": "shardscope.forward", "backward": "shardscope.backward", "step": "shardscope.step"}

KINDS = (START, STEP, MEMORY, TRACE, LAYERS, COMM, ERROR, STALL, PROBE, END)
COMMON_KEYS = ("v", "kind", "run", "rank", "t")


def nonfinite_fields(step_record: dict[str, Any]) -> str:
    """Return which of a ``step`` record's loss and grad norm are inf or nan ("loss", "grad_norm" or
    "loss and grad_norm"; "" when both are finite). On a step a loss scaler skipped, the gradients'
    overflow is the scaler doing its job, so only the loss counts: a non-finite loss is divergence
    that no scale fixes (DeepSpeed skips such steps even in fp32, and would otherwise end ``ok``)."""
    keys = ("loss",) if step_record.get("skipped") else ("loss", "grad_norm")
    bad = [k for k in keys
           if isinstance(step_record.get(k), (int, float)) and not math.isfinite(step_record[k])]
    return " and ".join(bad)


def make_record(kind: str, run: str, rank: int, **fields: Any) -> dict[str, Any]:
    """Return a record dict with the common keys first, then ``fields``.

    Raises ValueError for an unknown kind.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown record kind {kind!r}; allowed: {', '.join(KINDS)}")
    record: dict[str, Any] = {"v": SCHEMA_VERSION, "kind": kind, "run": run, "rank": rank, "t": time.time()}
    record.update(fields)
    return record


def encode(record: dict[str, Any]) -> str:
    """Return the record as one JSON line (with the trailing newline)."""
    return json.dumps(record, separators=(",", ":"), default=_jsonable) + "\n"


def _jsonable(value: Any) -> Any:
    # Tensors, numpy scalars and paths sneak into records; turn them into plain values.
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


class RecordWriter:
    """Appends records for one rank to its JSONL file, one line per record, flushed per line.

    Used by ranks. The file is opened in append mode so a restarted rank keeps earlier records.
    With ``spare_bytes``, a file of that many bytes is kept beside it (``<path>.spare``): when the
    disk fills, ``release_spare()`` frees it so that the rank's last records (error, end) still fit.
    """

    def __init__(self, path: str | os.PathLike[str], run: str, rank: int, *, spare_bytes: int = 0) -> None:
        self.path = os.fspath(path)
        self.run = run
        self.rank = rank
        self._injected: int | None = None
        self._lock = threading.Lock()
        self.forward: Any = None  # a record_wire.RecordSender once forward_to() was called
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8", buffering=1)
        self.spare_path = self.path + RANK_SPARE_SUFFIX
        if spare_bytes:
            try:
                with open(self.spare_path, "wb") as fh:
                    fh.write(b"\0" * spare_bytes)
            except OSError:  # too full already: the first record write will say so
                self.release_spare()

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Write one record of ``kind`` and return it; raises OSError when the disk refuses it."""
        record = make_record(kind, self.run, self.rank, **fields)
        if self._injected is not None:
            raise OSError(self._injected, os.strerror(self._injected), self.path)
        line = encode(record)
        with self._lock:  # the stall dump writes from its own thread
            try:
                self._file.write(line)
                self._file.flush()
            except OSError as err:  # the buffered file's error names no file: the message must say which
                raise OSError(err.errno, err.strerror, err.filename or self.path) from err
        if self.forward is not None:  # another node: node 0 gets the line too (record_wire)
            self.forward.send(line)
        return record

    def forward_to(self, endpoint: str, connect_timeout_s: float = 30.0, secret: bytes | None = None) -> None:
        """Also send every record to node 0's record server at ``endpoint`` (no shared filesystem).

        Waits for the first connection; raises ``record_wire.Unreachable`` (one clear line) when node 0
        cannot be reached within ``connect_timeout_s``.
        """
        from shardscope.core.record_wire import RecordSender

        sender = RecordSender(endpoint, self.run, self.rank, connect_timeout_s=connect_timeout_s, secret=secret)
        sender.wait_connected()
        self.forward = sender

    def inject_error(self, err: int) -> None:
        """Fault injection: make every write fail with OSError(``err``) until ``release_spare``."""
        self._injected = err

    def release_spare(self) -> None:
        """Delete the spare file (room for the last records) and drop an injected error."""
        self._injected = None
        try:
            os.remove(self.spare_path)
        except OSError:
            pass

    def close(self) -> None:
        """Close the file (a failing flush of a full disk is ignored: the rank has recorded why);
        the spare goes too. Records sent to node 0 are flushed first (up to 30 s). Further writes raise
        ValueError."""
        if self.forward is not None and not self.forward.close():
            print(f"shardscope: records not all delivered to node 0 ({self.forward.error or 'timed out'}); "
                  f"this node's file keeps them: {self.path}", file=sys.stderr)
        try:
            self._file.close()
        except OSError:
            pass
        self.release_spare()

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class LineDecoder:
    """Turns appended bytes into records, keeping a torn last line until its newline arrives.

    ``invalid`` counts lines that were not JSON objects; they are skipped, never fatal.
    """

    invalid: int = 0
    _pending: bytes = field(default=b"", repr=False)
    _skipping: bool = field(default=False, repr=False)  # inside a line past MAX_RECORD_BYTES: dropped to its end

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Return the complete records in ``_pending + data``; keep the unterminated tail (at most
        ``MAX_RECORD_BYTES``: a longer line is counted invalid and dropped as it streams, never held whole)."""
        buf = self._pending + data
        lines = buf.split(b"\n")
        self._pending = lines.pop()  # b"" when data ended with a newline
        if self._skipping:
            if not lines:
                self._pending = b""
                return []
            lines, self._skipping = lines[1:], False  # the over-long line's end
        if len(self._pending) > MAX_RECORD_BYTES:
            self._pending, self._skipping = b"", True
            self.invalid += 1
        return list(self._decode_lines(lines))

    def _decode_lines(self, lines: Iterable[bytes]) -> Iterable[dict[str, Any]]:
        for raw in lines:
            if not raw.strip():
                continue
            record = decode_line(raw)
            if record is None:
                self.invalid += 1
            else:
                yield record


MAX_RECORD_BYTES = 1 << 20  # a record line (a rank writes a few KiB at most; record_wire's protocol line too)
MAX_INT_DIGITS = 20  # an integer beyond 64 bits is no figure a rank writes (and float() of 500 digits overflows)
_TYPED = {"rank": (int,), "step": (int,), "t": (int, float), "run": (str,), "kind": (str,), "v": (int,)}


def _bounded_int(text: str) -> int:
    if len(text) > MAX_INT_DIGITS + 1:
        raise ValueError("an integer too long")
    return int(text)


def decode_line(raw: bytes | str) -> dict[str, Any] | None:
    """Return the record in one line, or None when it is not one: not a JSON object with a ``kind``, a line over
    ``MAX_RECORD_BYTES``, nested past what the decoder takes, an integer over ``MAX_INT_DIGITS`` digits, or a
    common key of the wrong type (``"t": "soon"``, a ``rank`` that is not an integer). Readers of every kind go
    through here, so a crafted or damaged file is counted invalid, never a traceback."""
    if len(raw) > MAX_RECORD_BYTES:
        return None
    try:
        value = json.loads(raw, parse_int=_bounded_int)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(value, dict) or "kind" not in value:
        return None
    for key, types in _TYPED.items():
        got = value.get(key)
        if got is not None and (type(got) not in types):  # bool is not an int here
            return None
    if isinstance(value.get("t"), float) and not math.isfinite(value["t"]):
        return None
    return value


def read_records(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], int]:
    """Read a whole rank file; return (records, invalid line count). A torn last line is ignored."""
    decoder = LineDecoder()
    records: list[dict[str, Any]] = []
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):  # streamed: a file of one huge line is never held whole
            records += decoder.feed(chunk)
    return records, decoder.invalid
