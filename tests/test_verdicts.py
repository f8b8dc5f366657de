"""Verdicts that survive a second run: the same comparison run twice on a machine another process keeps busy never
says "A faster" once and "A slower" the other time, and every throughput verdict carries its interval or says it
cannot tell (the A/A control's movement, numbers.speed_verdict).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _run(out) -> dict:
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "run", "--preset", "smoke", "--headless",
                           "--out", str(out), "--set", "steps=14", "--set", "profile.start_step=8"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads((out / "summary.json").read_text())


def test_two_runs_beside_a_busy_neighbour_never_contradict(tmp_path):
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # a neighbour that wants a core all the time
    try:
        first, second = _run(tmp_path / "a"), _run(tmp_path / "b")
    finally:
        burner.kill()
        burner.wait()
    verdicts = []
    for s in (first, second):
        rec = s["recommendation"]
        assert s["noise"]["between"]["measured"], s["noise"]
        assert "ddp.again" not in rec["runs"]  # the control is never a candidate
        verdicts.append({name: r["verdict"]["verdict"] for name, r in rec["runs"].items() if r.get("verdict")})
        for line in rec["lines"]:
            if " vs ddp: " in line:  # each verdict has its interval, or says it cannot tell
                assert "with the noise" in line or "not distinguishable" in line or "not tested" in line, line
    for name in set(verdicts[0]) & set(verdicts[1]):
        assert {verdicts[0][name], verdicts[1][name]} != {"faster", "slower"}, (name, verdicts)
