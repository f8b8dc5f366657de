"""A rank forked by torchrun: ``torchrun --start-method fork --run-path <this file> <run_dir>/spec.json``.

With ``launch.start_method = fork`` (the default, but for DeepSpeed on CUDA), torchrun's agent already imported
torch, ``torch._dynamo`` and the worker (``engines/agent.py`` preloads them) and forks each rank from itself (torchrun's
``--start-method fork``: ``torch.distributed.elastic.multiprocessing``), which then runs this file with
``runpy.run_path``. A rank so started skips the 3-4 s of imports a new interpreter pays on a 2-core machine; it is
the same worker (``worker.main``), the same records and exit codes.

Five things differ from a rank that is a new interpreter, and this file handles them:

- torchrun starts a new interpreter in a session of its own (``start_new_session=True``); a forked rank stays in
  the agent's session, and with Linux's autogroup scheduling (``kernel.sched_autogroup_enabled``, one scheduling
  group per session) all of a node's ranks and the agent then share one group. The rank starts its own session
  (``own_session``, where the measurement is): that is how torchrun's ranks are scheduled;
- ``/proc/<pid>/environ`` shows the agent's environment, without torchrun's ``RANK``: the rank names itself
  (``core/rank_process.py``) so the orchestrator and the device sampler know which rank each process is;
- the rank inherits the agent's signal handlers (torchrun's, which raise its ``SignalException``): SIGINT is
  Python's KeyboardInterrupt again and SIGHUP/SIGQUIT their default, as in a new interpreter (the worker sets its
  own SIGTERM handler);
- torchrun collects a forked rank's return value: a rank that succeeded must return from this file (exiting
  with ``os._exit(0)`` would leave torchrun waiting for a value forever); one that failed or stopped leaves with
  its exit code. torchrun's multiprocessing child never finalizes the interpreter (it ends with ``os._exit``), the
  hazard that ``worker.exit_now`` avoids for a new interpreter;
- a forked rank inherits the agent's locks as they were at the fork, held ones included: no rank connects anywhere
  until the agent has forked all of this node's ranks (``wait_for_siblings``).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Callable

from shardscope.core import rank_process
from shardscope.engines import worker

SIBLINGS_WAIT_S = 20.0  # at most: an agent forks its ranks within a second; past this the rank goes on regardless


def agent_children() -> int:
    """How many processes the agent (this rank's parent) has forked so far."""
    import psutil

    try:
        return len(psutil.Process(os.getppid()).children())
    except psutil.Error:
        return 0


def wait_for_siblings(want: int, children: Callable[[], int] = agent_children, limit_s: float = SIBLINGS_WAIT_S,
                      poll_s: float = 0.005) -> bool:
    """Block until the agent has forked ``want`` ranks (this node's LOCAL_WORLD_SIZE), at most ``limit_s``; return
    whether it has.

    Why: a forked rank inherits the agent's locks as they were at the fork. torchrun's store runs on threads of the
    agent (libuv), which look up each new connection's peer name, inside glibc's resolver; a rank forked while one
    of them was there inherits the resolver's lock held, by a thread it does not have, and its own first lookup
    waits on it forever. Seen with bare torchrun (``--start-method fork``, 6 ranks, 2 loaded cores: 2 jobs in 69,
    gdb: the rank in ``get_locked_global`` (resolv_conf.c) under ``getaddrinfo("localhost")`` in TCPStore's connect;
    with the store's address a number, 2 in 111, the rank then in ``getnameinfo`` under gloo's connect) and in CI (a
    4-rank run, one rank 300 s in ``_create_c10d_store``, 2026-11-27; RESULTS). The earlier ranks' connections are
    what wakes those threads: none connecting before the last rank is forked leaves them idle while the agent forks."""
    deadline = time.monotonic() + limit_s
    while children() < want:
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def own_session() -> bool:
    """Make this forked rank the leader of a new session (``os.setsid``), as torchrun's own ranks are; return whether
    it is. Measured on a 2-core VM with autogroup on (2026-11-29, FSDP2 on ``smoke``, 300 steps, 6 alternating
    pairs): with both ranks in the agent's session, rank 0 spent 25.2% of each step neither running nor waiting for
    a core (blocked in collectives; 23.0-26.0%), against 19.0% (16.2-20.8%) with a session each, and trained
    10% fewer tokens/s (medians 13,558 against 15,048; benchmarks/RESULTS.md). Nothing here relies on the agent's
    process group: the launcher signals every rank by pid, and each rank's watchdog ends it with its orchestrator."""
    try:
        os.setsid()
    except OSError:  # already a session leader (not a forked rank): nothing to do
        return os.getsid(0) == os.getpid()
    return True


def main() -> None:
    """Run the rank in this forked process; return on success, else exit with the rank's code."""
    rank_process.name_this_process(int(os.environ.get("RANK", "0")))  # /proc shows no RANK for a forked rank
    own_session()  # first: what follows is scheduled as a rank that torchrun started itself
    wait_for_siblings(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # before any connection: see its docstring
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    code = worker.main(sys.argv[1:])
    if code:
        worker.exit_now(code)


if __name__ == "__main__":
    main()
