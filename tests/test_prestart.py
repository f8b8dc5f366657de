"""The next run's torchrun agent started ahead (orchestrator/prestart.py, engines/agent.py, the ranks' gate)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import psutil
import pytest

from shardscope.engines.agent import parse_order
from shardscope.engines.watchdog import wait_for_warm_agent
from shardscope.orchestrator import launcher, prestart
from shardscope.orchestrator.supervision import _Active


def test_a_launch_order_is_checked():
    """The agent takes exactly the four keys with their types; anything else is an error, not a torchrun."""
    good = {"args": ["--nnodes", "1", "x.py"], "env": {"A": "1"}, "cwd": "/", "console": "/tmp/c.log"}
    assert parse_order(json.dumps(good)) == good
    for bad in ({**good, "extra": 1}, {k: v for k, v in good.items() if k != "cwd"}, {**good, "args": "x.py"},
                {**good, "args": [1]}, {**good, "env": {"A": 1}}, {**good, "console": None}, [good]):
        with pytest.raises(ValueError):
            parse_order(json.dumps(bad))


def test_the_agent_runs_the_plans_own_torchrun_arguments():
    argv = launcher.torchrun_argv("/x/spec.json", nproc_per_node=2, python="/usr/bin/python3")
    assert (argv[0], *prestart.torchrun_args(argv)) == (argv[0], *argv[3:])
    assert prestart.torchrun_args(argv)[-3:] == ("-m", "shardscope.engines.worker", "/x/spec.json")
    with pytest.raises(ValueError):
        prestart.torchrun_args(("/usr/bin/python3", "-m", "shardscope.cli"))


def test_when_the_next_agent_may_start():
    """Beside a cold launch, a second core is enough (the launch's own agent uses one, no rank exists yet);
    beside a launch that used an agent started ahead, only a core beyond this node's ranks."""
    assert prestart.worth_starting(cold=True, local_ranks=2, cpus=2)
    assert not prestart.worth_starting(cold=True, local_ranks=1, cpus=1)
    assert not prestart.worth_starting(cold=False, local_ranks=2, cpus=2)
    assert prestart.worth_starting(cold=False, local_ranks=2, cpus=3)
    assert prestart.usable_cpus() >= 1


def test_ranks_wait_for_the_next_agent_to_finish_its_imports(tmp_path):
    """The gate: nothing named, or a process gone, is no wait; while the agent lives without its ready file the
    rank does not start; the ready file ends the wait, and the time in it goes into the start record."""
    assert wait_for_warm_agent("") is None
    assert wait_for_warm_agent("garbage") is None
    ready = tmp_path / "agent.ready"
    assert wait_for_warm_agent(f"999999999:1.0:{ready}") is None  # no such process
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        named = f"{sleeper.pid}:{psutil.Process(sleeper.pid).create_time():.3f}:{ready}"
        result: list[float] = []
        waiter = threading.Thread(target=lambda: result.append(wait_for_warm_agent(named)), daemon=True)
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive() and not result  # importing still: no first step yet
        ready.write_text("1795000000.25\n")
        waiter.join(timeout=60)
        assert not waiter.is_alive() and result == [1795000000.25]  # when the agent said it was ready
        assert sleeper.poll() is None  # the ready agent goes on sleeping; only its imports were waited for
    finally:
        sleeper.kill()
        sleeper.wait()


def test_time_left_to_the_last_step_follows_rank_0s_pace():
    active = _Active("r", None, None, None, 0.0)  # type: ignore[arg-type]
    assert active.seconds_left(9) is None
    active.step_clock = [(0, 100.0), (0, 100.0)]
    assert active.seconds_left(9) is None  # one step: no pace yet
    active.step_clock = [(0, 100.0), (4, 102.0)]
    assert active.seconds_left(9) == pytest.approx(2.5)  # 0.5 s a step, 5 steps to go


WORKER = """
import json, os, sys, time
with open(sys.argv[1], "w") as fh:
    json.dump({"ppid": os.getppid(), "cwd": os.getcwd(), "mark": os.environ.get("PRESTART_TEST"),
               "rank": os.environ.get("RANK"), "stdin": os.readlink("/proc/self/fd/0")}, fh)
print("rank says hello", flush=True)
"""


def _plan(tmp_path, result):
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    argv = (sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", "prestart-test",
            "--max-restarts", "0", str(script), str(result))
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    return launcher.LaunchPlan("r", argv, {"PRESTART_TEST": "yes"}, str(tmp_path / "r" / "console.log"),
                               str(workdir))


def test_an_agent_started_ahead_runs_the_plans_torchrun_job(tmp_path):
    """A real agent: it imports torchrun, says it is ready, and on its launch order runs the plan's torchrun
    job as a cold launch would: the plan's environment and directory, its console (the command line first,
    then torchrun's and the rank's output), standard input from /dev/null, the rank a child of the agent."""
    result = tmp_path / "rank.json"
    plan = _plan(tmp_path, result)
    warm = prestart.start(sys.executable, str(tmp_path / "a.ready"), {}, str(tmp_path))
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(warm.ready_path) and warm.popen.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.exists(warm.ready_path), "the agent never said it was ready"
        assert warm.popen.poll() is None and float(open(warm.ready_path).read()) <= time.time()
        proc = warm.launch(plan)
        assert proc is not None and proc.pid == warm.popen.pid
        assert proc.popen.wait(timeout=300) == 0
    finally:
        if warm.popen.poll() is None:
            warm.popen.kill()
    seen = json.loads(result.read_text())
    assert seen == {"ppid": warm.popen.pid, "cwd": plan.cwd, "mark": "yes", "rank": "0", "stdin": os.devnull}
    console = open(plan.console_path, encoding="utf-8").read()
    assert console.startswith(f"$ {plan.shell_line()}\n") and "rank says hello" in console
    assert not os.path.exists(warm.ready_path)


def test_an_unused_agent_is_ended_and_a_dead_one_means_a_cold_start(tmp_path):
    warm = prestart.start(sys.executable, str(tmp_path / "a.ready"), {}, str(tmp_path))
    warm.discard()
    assert warm.popen.poll() is not None and not os.path.exists(warm.ready_path)
    dead = prestart.start(sys.executable, str(tmp_path / "b.ready"), {}, str(tmp_path))
    dead.popen.kill()
    dead.popen.wait()
    assert dead.launch(_plan(tmp_path, tmp_path / "never.json")) is None  # the session starts it cold instead


def test_an_agent_whose_orchestrator_is_gone_leaves_no_ready_file(tmp_path):
    """The parent-death SIGTERM reaches a sleeping agent: it ends and takes its ready file with it."""
    import signal

    warm = prestart.start(sys.executable, str(tmp_path / "c.ready"), {}, str(tmp_path))
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(warm.ready_path) and warm.popen.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.exists(warm.ready_path)
        warm.popen.send_signal(signal.SIGTERM)
        assert warm.popen.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if warm.popen.poll() is None:
            warm.popen.kill()
    assert not os.path.exists(warm.ready_path)


def test_an_agent_whose_import_fails_says_so_on_the_runs_console(tmp_path):
    """A torch that cannot be imported: the agent still says it is done (the run going on must not wait for
    it), and once its run is due the traceback is on that run's console with exit code 1, as a cold launch's."""
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('a torch broken for this test')\n")
    env = {"PYTHONPATH": str(tmp_path / "fake") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    warm = prestart.start(sys.executable, str(tmp_path / "d.ready"), env, str(tmp_path))
    try:
        assert wait_for_warm_agent(warm.gate_env()["SHARDSCOPE_WARM_AGENT"]) is not None
        plan = _plan(tmp_path, tmp_path / "never.json")
        proc = warm.launch(plan)
        assert proc is not None and proc.popen.wait(timeout=120) == 1
    finally:
        if warm.popen.poll() is None:
            warm.popen.kill()
    console = open(plan.console_path, encoding="utf-8").read()
    assert console.startswith("$ ") and "ImportError: a torch broken for this test" in console
    assert not (tmp_path / "never.json").exists()


def test_each_node_has_its_own_ready_file(tmp_path):
    """Nodes sharing one output directory count their agents apart: the names must not meet."""
    from shardscope.core.rundir import RunDir

    out = RunDir(str(tmp_path))
    assert out.agent_ready(2, 0) != out.agent_ready(2, 1)
    assert os.path.dirname(out.agent_ready(1)) == str(tmp_path)


def test_ranks_are_forked_by_default_and_exec_is_kept():
    """``launch.start_method``: auto forks, except DeepSpeed's ranks on CUDA; the command names torchrun's fork
    start method and the rank script by path (which exists), or the worker module for a new interpreter per rank."""
    assert prestart.fork_ranks("auto", "cpu") and prestart.fork_ranks("auto", "cuda")
    assert prestart.fork_ranks("auto", "cpu", deepspeed=True) and not prestart.fork_ranks("auto", "cuda", True)
    assert prestart.fork_ranks("fork", "cuda") and not prestart.fork_ranks("exec", "cpu")
    forked = launcher.torchrun_argv("/x/spec.json", nproc_per_node=2, fork=True)
    assert forked[-5:] == ("--start-method", "fork", "--run-path", launcher.RANK_SCRIPT, "/x/spec.json")
    assert os.path.isfile(launcher.RANK_SCRIPT) and os.path.isabs(launcher.RANK_SCRIPT)
    assert "--start-method" not in launcher.torchrun_argv("/x/spec.json", nproc_per_node=2)


def test_what_an_agent_preloads_follows_the_runs_strategy():
    from shardscope.config import Comparison
    from shardscope.core import registry

    plain = next(n for n in registry.names() if not registry.get(n).needs_deepspeed)
    deepspeed = next(n for n in registry.names() if registry.get(n).needs_deepspeed)
    comparison = Comparison.from_dict({"name": "p", "runs": [{"name": "a", "strategy": plain},
                                                             {"name": "b", "strategy": deepspeed}]})
    ddp = prestart.preload_for(comparison, "a", "cpu")
    assert ddp == [*prestart.RANK_MODULES, registry.get(plain).entry.partition(":")[0]]  # the built-in transformer
    # DeepSpeed on CPU: its module, and the compiler's that deepspeed.initialize imports
    assert prestart.preload_for(comparison, "b", "cpu") == [*prestart.RANK_MODULES, *prestart.COMPILER_MODULES,
                                                           registry.get(deepspeed).entry.partition(":")[0]]
    assert prestart.preload_for(comparison, "a", "cuda") == ddp  # forked on CUDA too (tests/test_fork_cuda.py)
    # DeepSpeed on CUDA (unchecked there): new interpreters, nothing preloaded
    assert prestart.preload_for(comparison, "b", "cuda") is None and not prestart.forks(comparison, "b", "cuda")
    # ... unless the preset says fork: then DeepSpeed imports itself in the rank, where it probes the accelerator
    forked = Comparison.from_dict({"name": "p", "launch": {"start_method": "fork"}, "runs": [{"name": "b", "strategy": deepspeed}]})
    assert prestart.preload_for(forked, "b", "cuda") == list(prestart.RANK_MODULES)
    # A Hugging Face model: transformers' classes and the family's module; compile: the compiler's
    hf = Comparison.from_dict({"name": "p", "model": {"kind": "hf", "hf_arch": "qwen2-tiny"},
                               "runs": [{"name": "a", "strategy": plain, "compile": True}]})
    assert prestart.preload_for(hf, "a", "cpu") == [*prestart.RANK_MODULES, *prestart.HF_MODULES,
                                                   "transformers.models.qwen2.modeling_qwen2", *prestart.COMPILER_MODULES,
                                                   registry.get(plain).entry.partition(":")[0]]
    # every module named is importable here (a name that is not would only cost its rank the import)
    import importlib.util
    assert all(importlib.util.find_spec(m) for m in prestart.preload_for(hf, "a", "cpu"))


FORKED_RANK = """
import json, os, sys, time
preloaded = "shardscope.engines.worker" in sys.modules  # before this script imports anything of shardscope
from shardscope.core import rank_process
import torch.distributed as dist
rank_process.name_this_process(int(os.environ["RANK"]))
dist.init_process_group("gloo")
seen = {"pid": os.getpid(), "ppid": os.getppid(), "preloaded": preloaded, "rank": os.environ["RANK"]}
with open(sys.argv[1] + "." + os.environ["RANK"] + ".part", "w") as fh:
    json.dump(seen, fh)
os.replace(sys.argv[1] + "." + os.environ["RANK"] + ".part", sys.argv[1] + "." + os.environ["RANK"])
deadline = time.monotonic() + 120
while not os.path.exists(sys.argv[1] + ".release") and time.monotonic() < deadline:
    time.sleep(0.05)
dist.destroy_process_group()
"""


def test_an_agent_forks_ranks_that_inherit_its_imports(tmp_path):
    """A cold launch in fork mode: the agent preloads the worker, torchrun forks both ranks from the agent (its
    children), the ranks find the worker imported, and the job's exit code is torchrun's."""
    script = tmp_path / "forked.py"
    script.write_text(FORKED_RANK)
    result = tmp_path / "rank.json"
    argv = (sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", "fork-test",
            "--max-restarts", "0", "--start-method", "fork", "--run-path", str(script), str(result))
    plan = launcher.LaunchPlan("r", argv, {}, str(tmp_path / "r" / "console.log"), str(tmp_path))
    proc = prestart.launch_cold(plan, sys.executable, str(tmp_path / "e.ready"), ["shardscope.engines.worker"])
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline and not all(
                (tmp_path / f"rank.json.{rank}").exists() for rank in (0, 1)):
            time.sleep(0.05)
        seen = [json.loads((tmp_path / f"rank.json.{rank}").read_text()) for rank in (0, 1)]
        # /proc shows no RANK for a forked rank: its name tells the orchestrator which rank it is
        assert proc.refresh_descendants() == {seen[0]["pid"]: 0, seen[1]["pid"]: 1}
        (tmp_path / "rank.json.release").touch()
        assert proc.popen.wait(timeout=300) == 0, open(plan.console_path).read()[-3000:]
    finally:
        (tmp_path / "rank.json.release").touch()
        proc.kill()
    for rank, got in enumerate(seen):
        assert got["ppid"] == proc.pid and got["preloaded"] is True and got["rank"] == str(rank)
    assert not (tmp_path / "e.ready").exists()


def test_a_forked_rank_that_fails_gives_torchrun_its_exit_code(tmp_path):
    """A rank that raises through engines/rank.py (a spec that is not there): the worker's own exit code 1 for the
    rank, torchrun's failure exit for the job, the error on the run's console; no process left."""
    plan = launcher.LaunchPlan("r", launcher.torchrun_argv(str(tmp_path / "missing.json"), nproc_per_node=1,
                                                           fork=True),
                               {}, str(tmp_path / "r" / "console.log"), str(tmp_path))
    proc = prestart.launch_cold(plan, sys.executable, str(tmp_path / "f.ready"), list(prestart.RANK_MODULES))
    try:
        assert proc.popen.wait(timeout=300) == 1
    finally:
        proc.kill()
    console = open(plan.console_path, encoding="utf-8").read()
    assert "missing.json" in console and "exitcode" in console, console[-3000:]
    assert proc.alive_pids() == []


def test_a_rank_is_known_by_its_environment_or_its_name():
    from shardscope.core.rank_process import rank_of

    class Proc:
        def __init__(self, env, name):
            self.env, self.label = env, name

        def environ(self):
            return self.env

        def name(self):
            return self.label

    assert rank_of(Proc({"RANK": "3"}, "python3")) == 3  # a new interpreter: torchrun's RANK
    assert rank_of(Proc({}, "ssrank12")) == 12  # forked: the name it gave itself
    assert rank_of(Proc({}, "python3")) is None and rank_of(Proc({}, "ssrankx")) is None
