"""Code named in someone else's run directory runs only when the user names it again (presets/trust.py).

A crafted directory: a real comparison of a user's module (``evil.py``, shipped in the directory, whose ``build``
leaves a file beside itself each time it runs), the files it left removed. Opened, reported, predicted from, asked
``why`` (from the command line and with the app's ``w``), nothing of it runs: each command that would build the model
says in one line what would run and how to allow it. With ``--trust-code`` it runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _pilot import wait_for
from tui_fakes import run_async

pytestmark = pytest.mark.slow
SOURCE = Path(__file__).resolve().parent / "data" / "user" / "module" / "mymodel.py"
WITNESS = '''

def build(model, seed):  # leaves a file beside this module each time it runs, then builds as mymodel.py does
    import os as _os
    open(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), f"ran-{_os.getpid()}"), "w").close()
    return _build(model, seed)
'''


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardscope.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900)


def _ran(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("ran-"))


@pytest.fixture(scope="module")
def crafted(tmp_path_factory) -> Path:
    """A finished run directory naming a module by its absolute path (``code/evil.py``), its witness files removed."""
    root = tmp_path_factory.mktemp("crafted")
    code = root / "code"  # named by an absolute path, as a directory someone sent could name any file
    code.mkdir(parents=True)
    text = SOURCE.read_text(encoding="utf-8").replace("def build(model: dict, seed: int)", "def _build(model: dict, seed: int)")
    (code / "evil.py").write_text(text + WITNESS, encoding="utf-8")
    (root / "p.toml").write_text("\n".join([
        "steps = 3", "global_batch = 4", "world_size = 2", "control = false", 'precision = "fp32"', "",
        "[model]", 'kind = "module"', f'entry = "{code / "evil.py"}:build"', "seq_len = 16", "",
        "[model.args]", "width = 32", "heads = 4", "",
        "[[runs]]", 'name = "ddp"', 'strategy = "ddp"', "",
        "[[runs]]", 'name = "bf16"', 'strategy = "ddp"', 'precision = "bf16-autocast"']) + "\n", encoding="utf-8")
    proc = _cli(root, "run", "--preset", "p.toml", "--headless", "--out", str(root / "run"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert _ran(code)  # the witness works: the run's model check and ranks built it
    for name in _ran(code):
        os.remove(code / name)
    return root / "run"


def test_why_refuses_to_run_a_directorys_code_and_says_how_to_allow_it(crafted):
    proc = _cli(crafted.parent, "why", str(crafted), "bf16")
    assert proc.returncode != 0
    assert "its comparison names code to run (model.entry =" in proc.stderr + proc.stdout
    assert "--trust-code" in proc.stderr + proc.stdout
    assert _ran(crafted.parent / "code") == []


def test_predict_and_report_probes_refuse_it_too(crafted):
    for args in (["predict", "--calibrate", str(crafted), "--preset", "smoke"],
                 ["report", str(crafted), "--calibrate", str(crafted), "--probe"]):
        proc = _cli(crafted.parent, *args)
        said = proc.stderr + proc.stdout
        assert proc.returncode == 2 and "--trust-code" in said, (args, said[-2000:])
        assert len([ln for ln in proc.stderr.splitlines() if "Traceback" in ln]) == 0, said[-2000:]
    assert _ran(crafted.parent / "code") == []
    proc = _cli(crafted.parent, "report", str(crafted))  # reading is as safe as ever
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _ran(crafted.parent / "code") == []


@run_async
async def test_the_apps_why_on_an_opened_directory_runs_nothing(crafted):
    from shardscope.config import cpu_host
    from shardscope.tui.app import build_app
    from shardscope.tui.screens.why import WhyScreen
    from shardscope.tui.widgets.run_card import RunCard

    app = build_app(replay_dir=str(crafted), host=cpu_host())
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: app.board.finished is not None and len(app.screen.query(RunCard)) == 2)
        for _ in range(4):  # select the run whose loss differs
            if app.screen.selected == "bf16":
                break
            await pilot.press("right")
            await pilot.pause(0.05)
        assert app.screen.selected == "bf16"
        await pilot.press("w")
        await wait_for(pilot, lambda: isinstance(app.screen, WhyScreen) and not app.screen.running
                       and bool(app.screen.error))
        assert "--trust-code" in app.screen.error, app.screen.error
    assert _ran(crafted.parent / "code") == []


def test_with_trust_code_the_named_code_runs(crafted):
    proc = _cli(crafted.parent, "predict", "--calibrate", str(crafted), "--preset", "smoke", "--trust-code")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _ran(crafted.parent / "code")  # probing the calibration's runs built the module
