"""The README's one install command is the whole product: pyproject's main dependencies hold every
package a built-in preset needs, the torch range's floor is the one .ci/run tests, and in this
environment every built-in preset passes ``--dry-run`` (.ci/check_install.py, which .ci/run also
runs in a venv made with only ``pip install -e .``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent


def _deps() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    out = {}
    for dep in project["dependencies"]:
        name = re.match(r"[A-Za-z0-9_.-]+", dep).group(0).lower()
        out[name] = dep[len(name):]
    return out


def test_main_dependencies_hold_what_every_preset_needs():
    deps = _deps()
    for name in ("torch", "deepspeed", "transformers", "torch-tb-profiler", "textual", "safetensors"):
        assert name in deps, name
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    assert set(extras) == {"dev"}  # test tools only: nothing a preset needs hides behind an extra


def test_torch_range_floor_is_the_one_ci_tests():
    floor = re.search(r">=\s*([0-9.]+)", _deps()["torch"]).group(1)
    ci = re.search(r"^FLOOR_TORCH=([0-9.]+)$", (ROOT / ".ci" / "run").read_text(encoding="utf-8"), re.M).group(1)
    assert ci.startswith(floor), (floor, ci)


def test_every_builtin_preset_dry_runs_here():
    proc = subprocess.run([sys.executable, str(ROOT / ".ci" / "check_install.py")], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("--dry-run: ok") >= 7, proc.stdout
