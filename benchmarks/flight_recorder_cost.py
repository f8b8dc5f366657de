"""What does torch's flight recorder cost per collective? (shardscope turns it on for every rank, so that a stalled
run can say which collective each rank last entered: ``engines/stall_dump.py``.)

The overhead benchmark (``benchmarks/overhead.py``) cannot see it: its bare and instrumented loops share one
process, hence one recorder. Here, alternating torchrun jobs of 2 gloo ranks, with ``TORCH_FR_BUFFER_SIZE`` at
the value shardscope sets and at 0 (off), each time ``--calls`` all-reduces of a small tensor (the recorder's cost
is per call, not per byte) after a warm-up, between barriers. Prints the median time per all-reduce of each side
over ``--rounds`` rounds and the difference per call, then what that is against a DDP step of the smoke preset
(``--step-ms``, about 2 all-reduces a step).

    python benchmarks/flight_recorder_cost.py [--rounds 6] [--calls 3000] [--step-ms 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SCRIPT = """
import os, sys, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(16)
calls = int(sys.argv[1])
for _ in range(200):
    dist.all_reduce(t)
dist.barrier()
start = time.perf_counter()
for _ in range(calls):
    dist.all_reduce(t)
dist.barrier()
elapsed = time.perf_counter() - start
if dist.get_rank() == 0:
    print(f"PER_CALL {elapsed / calls!r}", flush=True)
dist.destroy_process_group()
os._exit(0)
"""


def once(script: str, calls: int, entries: str) -> float:
    """One torchrun job with the flight recorder at ``entries`` ("0": off); seconds per all-reduce on rank 0."""
    from shardscope.core.events import FLIGHT_RECORDER_ENV

    env = {**os.environ, "OMP_NUM_THREADS": "1", FLIGHT_RECORDER_ENV: entries}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           script, str(calls)], env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("PER_CALL "):
            return float(line.split()[1])
    raise RuntimeError(f"job failed ({proc.returncode}): {proc.stderr[-2000:]}")


def main() -> int:
    """Alternate jobs with the recorder on and off; print medians and the difference."""
    from shardscope.core.events import FLIGHT_RECORDER_ENTRIES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--step-ms", type=float, default=10.0, help="a DDP step of the preset you compare against")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    on, off = [], []
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(SCRIPT)
    try:
        for i in range(args.rounds):
            order = [("on", FLIGHT_RECORDER_ENTRIES), ("off", "0")]
            for side, entries in (order if i % 2 == 0 else order[::-1]):
                (on if side == "on" else off).append(once(fh.name, args.calls, entries))
            print(f"round {i + 1}: on {1e6 * on[-1]:.1f} us/call, off {1e6 * off[-1]:.1f} us/call")
    finally:
        os.remove(fh.name)
    m_on, m_off = statistics.median(on), statistics.median(off)
    extra = m_on - m_off
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print(f"median per all-reduce: recorder on {1e6 * m_on:.1f} us, off {1e6 * m_off:.1f} us, "
          f"difference {1e6 * extra:+.1f} us")
    print(f"flight_recorder per_step_fraction (2 all-reduces / {args.step_ms:g} ms step): "
          f"{2 * extra / (args.step_ms / 1000):+.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
