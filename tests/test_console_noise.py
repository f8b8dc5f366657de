"""Known library noise stays out of the console pane and error texts; real errors pass.

The logs under tests/data/console-torch2.15/ are real console.log files of `shardscope run --preset
smoke --headless --set steps=6 --set profile.start_step=2 --set runs.fsdp2.fault=...` with torch
2.15.0+cu132 on a CPU machine: kineto prints `profiler_start`/`profiler_stop` tracepoints and
"gpuGetDeviceCount failed with code 35" on every rank; the fsdp2 run also holds real tracebacks.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from shardscope.core.console_noise import ConsoleFilter, clean, is_noise
from shardscope.orchestrator.tail import ConsoleTailer
from shardscope.core.rundir import tail_text

DATA = Path(__file__).parent / "data" / "console-torch2.15"
NOISE_WORDS = ("gpuGetDeviceCount failed", "] profiler_start", "] profiler_stop")


def _text(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")


@pytest.mark.parametrize("name", ["ddp.console.log", "fsdp2-fault.console.log"])
def test_noise_lines_go_and_every_other_line_stays(name):
    text = _text(name)
    lines = text.splitlines(keepends=True)
    noisy = [ln for ln in lines if any(w in ln for w in NOISE_WORDS)]
    assert len(noisy) == 6  # 3 per rank, 2 ranks: independent count with plain substring search
    assert clean(text) == "".join(ln for ln in lines if ln not in noisy)


def test_real_errors_still_pass():
    shown = clean(_text("fsdp2-fault.console.log"))
    assert "RuntimeError: injected fault at step 5 on rank 1" in shown
    assert shown.count("Traceback (most recent call last):") == _text("fsdp2-fault.console.log").count("Traceback")


def test_only_kinetos_format_is_noise():
    real = "ERROR:2026-11-23 07:51:37 12829:12829 DeviceProperties.cpp:56] gpuGetDeviceCount failed with code 35"
    assert is_noise(real)
    for line in ("RuntimeError: gpuGetDeviceCount failed with code 35",
                 "ERROR:2026-11-23 07:51:37 12829:12829 DeviceProperties.cpp:56] cudaMalloc failed with code 2",
                 "my own profiler_start"):
        assert not is_noise(line), line


@pytest.mark.parametrize("seed", range(5))
def test_tailer_filters_text_that_arrives_in_arbitrary_chunks(tmp_path, seed):
    """Writes cut at random byte offsets (mid-line, mid-noise-line) give the same shown text."""
    data = _text("fsdp2-fault.console.log").encode("utf-8")
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(data)), 40))
    path = tmp_path / "console.log"
    path.write_bytes(b"")
    tailer, shown = ConsoleTailer(str(path)), []
    for lo, hi in zip([0, *cuts], [*cuts, len(data)]):
        with open(path, "ab") as fh:
            fh.write(data[lo:hi])
        shown.append(tailer.poll())
    shown.append(tailer.poll())  # a poll that finds nothing new passes on a held-back piece
    assert "".join(shown) == clean(data.decode("utf-8"))


def test_a_held_back_partial_line_is_passed_on_when_nothing_follows():
    f = ConsoleFilter()
    assert f.feed("ERR") == ""  # might become a kineto line
    assert f.feed("") == "ERR"
    assert f.feed("step 3 loss 1.0") == "step 3 loss 1.0"  # cannot become noise: shown at once


def test_tail_text_for_errors_leaves_noise_out():
    tail = tail_text(str(DATA / "ddp.console.log"))
    assert tail.startswith("$ ") and len(tail.splitlines()) == 1
