"""How close ``shardscope why``'s estimate comes to the wall clock: a comparison run, then ``why --dry-run``'s
estimate beside the real time of the round it estimates, ``--repeats`` times. Prints each ratio (real / estimate)
and their median. Wall-clock figures belong here, not in a test (tests/test_why.py checks the estimate's recount).

    python benchmarks/why_estimate.py --repeats 3
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_why import PLAIN  # noqa: E402  (the preset whose bf16 reduction why explains)

CLI = [sys.executable, "-m", "shardscope.cli"]


def main() -> None:
    """Run the benchmark and print the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        preset = Path(tmp) / "why.toml"
        preset.write_text(PLAIN, encoding="utf-8")
        out = Path(tmp) / "out"
        subprocess.run([*CLI, "run", "--preset", str(preset), "--headless", "--out", str(out)], check=True,
                       capture_output=True)
        for i in range(args.repeats):
            dry = subprocess.run([*CLI, "why", str(out), "fsdp2-bf16-reduce", "--dry-run", "--again"],
                                 capture_output=True, text=True, check=True)
            estimate = float(re.search(r"estimate: about ([\d.,]+) s", dry.stdout).group(1).replace(",", ""))
            began = time.monotonic()
            subprocess.run([*CLI, "why", str(out), "fsdp2-bf16-reduce", "--again"], capture_output=True, check=True)
            took = time.monotonic() - began
            ratios.append(took / estimate)
            print(f"repeat {i + 1}: estimate {estimate:.0f} s, real {took:.1f} s, real / estimate {took / estimate:.2f}")
    print(f"median real / estimate: {statistics.median(ratios):.2f} over {len(ratios)} repeats")


if __name__ == "__main__":
    main()
