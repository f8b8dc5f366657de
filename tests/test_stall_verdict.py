"""The stalled-run verdict from the ranks' ``stall`` records: who never entered which collective."""

from __future__ import annotations

from shardscope.orchestrator.stall_verdict import describe, rank_list, where


def entry(seq, done, group="default_pg", op="all_reduce", t=100.0, sizes=((7,),)):
    return {"group": group, "seq": seq, "op": op, "sizes": [list(s) for s in sizes], "entered_t": t, "done": done}


def test_rank_list():
    assert rank_list([1]) == "rank 1"
    assert rank_list([0, 2, 3]) == "ranks 0 and 2-3"
    assert rank_list([3, 0, 1, 5]) == "ranks 0-1, 3 and 5"


def test_one_rank_never_entered_the_collective_the_others_wait_in():
    stalls = {0: {"t": 120.0, "step": 7, "collectives": [entry(57, True), entry(58, False, t=100.0)], "stack": ""},
              1: {"t": 120.0, "step": 7, "collectives": [entry(56, True), entry(57, True)], "stack": ""},
              2: {"t": 121.0, "step": 7, "collectives": [entry(58, False, t=101.0)], "stack": ""},
              3: {"t": 121.0, "step": 7, "collectives": [entry(58, False, t=102.0)], "stack": ""}}
    assert where(stalls) == ("rank 1 never entered all_reduce #58 (group default_pg, size 7); "
                             "ranks 0 and 2-3 waiting in it for 21 s")
    line, stacks = describe(stalls, 20, 4)
    assert line.startswith("stalled at step 7 (no progress for 20 s): rank 1 never entered")
    assert "--- rank 3: Python stacks" in stacks


def test_a_deadlock_across_groups_names_every_direction_and_silent_ranks():
    stalls = {0: {"t": 130.0, "step": 3, "collectives": [entry(1, False, "pg 1", t=100.0), entry(9, True)]},
              1: {"t": 130.0, "step": 3, "collectives": [entry(9, True), entry(10, False, t=105.0)]}}
    said = where(stalls)
    assert said.startswith("deadlock across process groups: ")
    assert "rank 1 never entered all_reduce #1 (group pg 1, size 7); rank 0 waiting in it for 30 s" in said
    assert ("; and rank 0 never entered all_reduce #10 (group default_pg, size 7); rank 1 waiting in it for 25 s"
            in said)
    line, _ = describe(stalls, 20, 3)
    assert line.endswith("; rank 2 did not answer")


def test_no_collective_in_flight_says_so_only_by_its_stacks():
    stalls = {0: {"t": 1.0, "step": 2, "collectives": [entry(3, True)], "stack": "Thread 0x1:\n  File x"}}
    assert where(stalls) == ""
    line, stacks = describe(stalls, 20, 1)
    assert line == "stalled at step 2 (no progress for 20 s): no rank is in a collective" and "File x" in stacks


def test_ranks_outside_any_collective_are_placed_by_their_main_threads_innermost_frame():
    """the 2026-11-27 CI stalled with every rank answering and none in a collective, and its verdict said only the head."""
    def stack(func, line):
        return ("Thread 0x2 (most recent call first):\n"
                '  File "/x/threading.py", line 320 in wait\n'
                '  File "/x/shardscope/engines/record_wire.py", line 77 in _send\n\n'
                "Thread 0x1 (most recent call first):\n"
                f'  File "/x/shardscope/engines/watchdog.py", line {line} in {func}\n'
                '  File "/x/shardscope/engines/worker.py", line 182 in run_rank\n'
                '  File "/x/shardscope/engines/worker.py", line 283 in main\n\n'
                "Current thread 0x3 (most recent call first):\n"
                '  File "/x/shardscope/engines/stall_dump.py", line 60 in stacks\n')
    stalls = {r: {"t": 1.0, "step": 0, "collectives": [entry(1, True)], "stack": stack("wait_for_previous_run", 98)}
              for r in (0, 1, 3)}
    stalls[2] = {"t": 1.0, "step": 0, "collectives": [], "stack": stack("sleep_a_while", 7)}
    line, _ = describe(stalls, 300, 4)
    assert line == ("stalled at step 0 (no progress for 300 s): no rank is in a collective; "
                    "ranks 0-1 and 3 in wait_for_previous_run (watchdog.py:98); rank 2 in sleep_a_while (watchdog.py:7)")


def test_a_ranks_stack_is_cut_below_the_worker_entry():
    """The launch's frames below ``worker.main`` (torchrun, multiprocessing, runpy: 25 for a forked rank) are left
    out, so the summary's traceback tail shows where the rank is."""
    stack = ("Thread 0x1 (most recent call first):\n"
             '  File "/x/shardscope/engines/faults.py", line 9 in maybe_fire\n'
             '  File "/x/shardscope/engines/worker.py", line 283 in main\n'
             '  File "/x/shardscope/engines/rank.py", line 40 in main\n'
             '  File "<frozen runpy>", line 88 in _run_code\n')
    _, stacks = describe({1: {"t": 1.0, "step": 3, "collectives": [], "stack": stack}}, 20, 2)
    assert stacks.splitlines()[-1].endswith('worker.py", line 283 in main') and "maybe_fire" in stacks
    assert "runpy" not in stacks and "rank.py" not in stacks
