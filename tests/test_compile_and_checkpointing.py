"""End to end: ``compile = true`` on FSDP1, FSDP2, the hand-written FSDP and DeepSpeed ZeRO-2/3, and
``activation_checkpointing = true`` on some of them, fp32, 2 CPU ranks, in one comparison with an eager DDP
baseline. (FSDP2 compiled had its own smoke comparison through the command line in test_cli_e2e.py, a DDP run
and 40 s of CI more, checking the same thing: 2026-11-26.)

torch strategies compile per block (``parallelize.compile_blocks``); DeepSpeed compiles through
``engine.compile()``. Each compiled run must report compiled graphs in its ``end`` record (so the
compile really happened, whatever path it took) and train like eager DDP within 1e-5 at every
step, the parity bound for fp32 data-parallel sharding. Measured on this 2-core VM (4 steps): FSDP1
and the hand-written FSDP 0 difference, ZeRO-1/2/3 4.8e-7. AutoTP with compile was run by hand
(parity-sized Qwen2 model, 4 ranks, 4 steps): losses equal to DDP's to 8 decimals.
"""

from __future__ import annotations

import pytest

from _launch import grad_norms, launch_all, max_abs_diff, tiny_comparison
from shardscope.config import RunSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # a module fixture of several runs counts against its first test

# ZeRO-1 compiles through the same ``engine.compile()`` as ZeRO-2 and keeps its gradients whole as ZeRO-2 does until
# the step: left out (~30 s of CI, 2026-11-29; it passed here with 4.8e-7 before)
COMPILED = {"fsdp1": "fsdp1", "fsdp2": "fsdp2", "hw": "fsdp-handwritten", "zero2": "deepspeed-zero2",
            "zero3": "deepspeed-zero3"}
CHECKPOINTED = ("hw", "zero2", "zero3")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runs = [RunSpec("ddp", "ddp")]
    runs += [RunSpec(name, strategy, compile=True, activation_checkpointing=name in CHECKPOINTED)
             for name, strategy in COMPILED.items()]
    comparison = tiny_comparison(runs, steps=4, grad_clip=1.0, stall_timeout_s=300.0)
    return launch_all(tmp_path_factory.mktemp("compile"), comparison, timeout_s=400.0)  # compiling is slow on 2 cores


@pytest.mark.parametrize("name", list(COMPILED))
def test_compiled_run_really_compiled_and_matches_eager_ddp(results, name):
    end = results[name].of_kind("end")[-1]
    assert end.get("compiled_graphs", 0) > 0, f"{name}: no graph compiled: {end}"
    base, other = results["ddp"], results[name]
    assert other.losses()[0] == base.losses()[0]
    measured = max_abs_diff(other.losses(), base.losses())
    print(f"compiled {name} vs eager ddp: max |dloss| = {measured:.2e}")
    assert measured <= 1e-5
    assert max_abs_diff(grad_norms(other), grad_norms(base)) <= 1e-5


def test_eager_run_reports_no_compile(results):
    assert "compiled_graphs" not in results["ddp"].of_kind("end")[-1]
