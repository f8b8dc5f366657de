"""Run in a venv made with only the README's install command (`pip install -e .`): every package a
built-in preset needs imports, and every built-in preset passes `shardscope run --dry-run` (which
validates it for this machine: a preset whose strategy needs a missing package is refused there).
Exits 1 listing what failed. Used by .ci/run."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys

from shardscope.config import list_presets

NEEDED = ("torch", "deepspeed", "transformers", "torch_tb_profiler", "textual", "safetensors", "matplotlib")


def main() -> int:
    """Check imports and every preset's dry run; print one line per check; return the exit code."""
    failed = []
    for module in NEEDED:
        try:
            importlib.import_module(module)
            print(f"import {module}: ok")
        except Exception as err:  # noqa: BLE001 - report any import failure, go on
            failed.append(f"import {module}: {type(err).__name__}: {err}")
    exe = shutil.which("shardscope")
    if exe is None:
        failed.append("the `shardscope` command is not on PATH")
        exe = ""
    for name, _ in list_presets():
        cmd = [exe, "run", "--preset", name, "--dry-run"] if exe else [sys.executable, "-m", "shardscope.cli", "run",
                                                                       "--preset", name, "--dry-run"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        ok = proc.returncode == 0 and "torch.distributed.run" in proc.stdout
        print(f"shardscope run --preset {name} --dry-run: {'ok' if ok else f'exit {proc.returncode}'}")
        if not ok:
            failed.append(f"preset {name}: exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
    for line in failed:
        print(f"FAILED: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
