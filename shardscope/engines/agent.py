"""A torchrun agent started ahead of its run: ``python -m shardscope.engines.agent READY_PATH [MODULE ...]``.

Between two runs of a comparison, most of the gap is start-up that does not depend on the run: torchrun's
agent importing torch (``torch.distributed.run``: 1.5-2.5 s on a 2-core VM) before it spawns any rank. The
orchestrator therefore starts the *next* run's agent early (``orchestrator/prestart.py``), while the cores
are idle (beside the first run's own agent, or where the machine has a core to spare), never beside
measured steps: once its imports are done this process writes the time into ``READY_PATH`` and sleeps on its standard
input, and the ranks of the run going on wait before their first step until it has (``watchdog``).

When the run is due, the orchestrator writes one JSON line on the agent's standard input: ``{"args": [...],
"env": {...}, "cwd": ..., "console": ...}`` with exactly what ``python -m torch.distributed.run ARGS``
would have been started with. The agent sends its output to ``console``, takes that environment and
directory, points its standard input at ``/dev/null`` (what a cold launch gives) and calls
``torch.distributed.run.main(args)``: the very function the ``torchrun`` command runs, so the job is a real
torchrun job, signals and exit codes included. End of input before a line (the comparison ended without
it): exit 0 without starting anything. An import that fails is said on the run's console once the run is due,
with exit code 1, as ``python -m torch.distributed.run`` would; the ready file is written all the same, so the run
going on does not wait for an agent that will never be ready.

MODULEs are imported too, after torchrun: with ``launch.start_method = fork`` torchrun forks the ranks from this
process (``--start-method fork --run-path engines/rank.py``), so a rank inherits ``torch._dynamo``, the worker and
its strategy's module instead of importing them (3-4 s a rank on a 2-core machine). One that fails to import is
left to the rank, which imports it again and records the error as any rank does. A run started cold goes through
this process too (its order written at once), so that its ranks are forked from a preloaded agent as well.

Written by hand: torchrun has no "import now, launch later" mode; a fork server outside torchrun would make ranks
children of something other than torchrun.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import signal
import sys
import time
import traceback

from shardscope.core.rundir import PARTIAL_SUFFIX
from shardscope.engines.agent_exits import ExitWatch

ORDER_KEYS = {"args": list, "env": dict, "cwd": str, "console": str}


def parse_order(line: str) -> dict:
    """Return the launch order in ``line``; ValueError when it is not one (its own parent wrote it: a
    malformed line is a bug, said on the console instead of a torchrun started with the wrong arguments)."""
    order = json.loads(line)
    if not isinstance(order, dict) or set(order) != set(ORDER_KEYS):
        raise ValueError(f"launch order: expected the keys {sorted(ORDER_KEYS)}")
    for key, kind in ORDER_KEYS.items():
        if not isinstance(order[key], kind):
            raise ValueError(f"launch order: {key} must be a {kind.__name__}")
    if not all(isinstance(a, str) for a in order["args"]):
        raise ValueError("launch order: args must be strings")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in order["env"].items()):
        raise ValueError("launch order: env must map strings to strings")
    return order


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):  # gone already, or never written
        os.remove(path)


def _redirect(console: str) -> None:
    """Standard output and error appended to ``console``; standard input from /dev/null."""
    out = os.open(console, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.dup2(null, 0)
    os.close(out)
    os.close(null)


def preload(modules: list[str]) -> None:
    """Import ``modules`` for the ranks this process will fork; one that fails is the rank's to report."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the forked rank imports it again and records why it failed
            continue


def main(argv: list[str] | None = None) -> int:
    """Import torchrun, say so in READY_PATH, wait for the launch order, run torchrun; return its exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m shardscope.engines.agent READY_PATH [MODULE ...]", file=sys.stderr)
        return 2
    # Ended before its run (the orchestrator gone: parent-death SIGTERM): leave no ready file behind.
    signal.signal(signal.SIGTERM, lambda *_: (_remove(argv[0]), os._exit(128 + signal.SIGTERM)))
    failure = ""
    try:
        import torch.distributed.run as torchrun  # the start-up this process exists to take early
    except Exception:  # noqa: BLE001 - said on the run's console once it is due, as a cold launch would
        failure = traceback.format_exc()
    if not failure:
        preload(argv[1:])
    ready = f"{argv[0]}.{os.getpid()}{PARTIAL_SUFFIX}"
    with open(ready, "w", encoding="utf-8") as fh:  # whole or absent: a rank reads the time in it
        fh.write(f"{time.time()!r}\n")
    os.replace(ready, argv[0])
    line = sys.stdin.readline()
    _remove(argv[0])  # used or not, it is not waited for any more
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # from here torchrun's own handling, as a cold launch's
    if not line.strip():
        return 0
    order = parse_order(line)
    _redirect(order["console"])
    if failure:
        print(failure, file=sys.stderr, end="", flush=True)
        return 1
    os.chdir(order["cwd"])
    os.environ.clear()
    os.environ.update(order["env"])
    sys.argv = ["torchrun", *order["args"]]
    code = 0
    watch = ExitWatch().start()  # forked ranks: how each ended, which torchrun's table may leave out
    try:
        torchrun.main(order["args"])
    except SystemExit as exc:  # argparse's usage error, say: its code, and its message where it gives one
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - said as an uncaught exception is, exit 1: what `torchrun` does
        sys.excepthook(*sys.exc_info())
        code = 1
    for line in watch.lines() if code else ():  # a failed job's verdict reads them; a finished one needs none
        print(line, file=sys.stderr)
    leave(code)
    return code


def leave(code: int) -> None:
    """Exit without the interpreter's finalization (0.5 s or more with torch, dynamo and the worker loaded,
    which the next run's ranks would wait for, ``watchdog.wait_for_previous_run``); the job is over by now."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a console on a full disk
            stream.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
