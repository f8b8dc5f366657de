"""A rank forked by torchrun: ``torchrun --start-method fork --run-path <this file> <run_dir>/spec.json``.

With ``launch.start_method = fork`` (the default, but for DeepSpeed on CUDA), torchrun's agent already imported
torch, ``torch._dynamo`` and the worker (``engines/agent.py`` preloads them) and forks each rank from itself (torchrun's
``--start-method fork``: ``torch.distributed.elastic.multiprocessing``), which then runs this file with
``runpy.run_path``. A rank so started skips the 3-4 s of imports a new interpreter pays on a 2-core machine; it is
the same worker (``worker.main``), the same records and exit codes.

Three things differ from a rank that is a new interpreter, and this file handles them:

- ``/proc/<pid>/environ`` shows the agent's environment, without torchrun's ``RANK``: the rank names itself
  (``core/rank_process.py``) so the orchestrator and the device sampler know which rank each process is;
- the rank inherits the agent's signal handlers (torchrun's, which raise its ``SignalException``): SIGINT is
  Python's KeyboardInterrupt again and SIGHUP/SIGQUIT their default, as in a new interpreter (the worker sets its
  own SIGTERM handler);
- torchrun collects a forked rank's return value: a rank that succeeded must return from this file (exiting
  with ``os._exit(0)`` would leave torchrun waiting for a value forever); one that failed or stopped leaves with
  its exit code. torchrun's multiprocessing child never finalizes the interpreter (it ends with ``os._exit``), the
  hazard that ``worker.exit_now`` avoids for a new interpreter.
"""

from __future__ import annotations

import os
import signal
import sys

from shardscope.core import rank_process
from shardscope.engines import worker


def main() -> None:
    """Run the rank in this forked process; return on success, else exit with the rank's code."""
    rank_process.name_this_process(int(os.environ.get("RANK", "0")))  # /proc shows no RANK for a forked rank
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    code = worker.main(sys.argv[1:])
    if code:
        worker.exit_now(code)


if __name__ == "__main__":
    main()
