"""Make the README's pictures of the app: SVG screenshots taken by the app itself, headless.

    .venv/bin/python docs/make_screenshots.py   # writes docs/images/dashboard.svg and report.svg

It copies the recorded smoke comparison in ``tests/data/replay-smoke`` (DDP vs FSDP2, and a run failed on
purpose) to a temporary directory (the test data is never touched), regenerates its report there
(``shardscope report``), opens
it exactly as ``shardscope open`` would, waits until every run is replayed, and saves the dashboard, then the
report screen (key ``o``). The figures are those of the recording; only the dates and paths change.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "data" / "replay-smoke"
IMAGES = ROOT / "docs" / "images"
SIZE = (160, 48)  # columns, lines: the size the app's own tests use

sys.path.insert(0, str(ROOT))

from shardscope.config import cpu_host  # noqa: E402
from shardscope.tui.app import build_app  # noqa: E402
from shardscope.tui.screens.dashboard import DashboardScreen  # noqa: E402
from shardscope.tui.screens.report import ReportScreen  # noqa: E402


async def wait_for(pilot, predicate, timeout: float = 120.0) -> None:
    """Let the app run until ``predicate()`` holds; raise after ``timeout`` seconds."""
    for _ in range(int(timeout / 0.05)):
        if predicate():
            return
        await pilot.pause(0.05)
    raise TimeoutError("the app did not reach the expected state")


async def shoot(run_dir: Path) -> list[Path]:
    """Replay ``run_dir`` in the app and save the dashboard and the report screen as SVG."""
    IMAGES.mkdir(parents=True, exist_ok=True)
    app = build_app(replay_dir=str(run_dir), host=cpu_host())
    written = []
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, DashboardScreen) and app.board.finished is not None)
        await pilot.pause(1.0)  # let the charts and panels redraw with every record
        written.append(Path(app.save_screenshot("dashboard.svg", str(IMAGES))))
        await pilot.press("o")
        await wait_for(pilot, lambda: isinstance(app.screen, ReportScreen))
        await pilot.pause(1.0)
        written.append(Path(app.save_screenshot("report.svg", str(IMAGES))))
        await pilot.press("q")
    return written


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="shardscope-shots-") as tmp:
        run_dir = Path(tmp) / "runs" / "smoke"
        shutil.copytree(FIXTURE, run_dir)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
        subprocess.run([sys.executable, "-m", "shardscope.cli", "report", "runs/smoke"], cwd=tmp, env=env,
                       check=True, stdout=subprocess.DEVNULL)
        IMAGES.mkdir(parents=True, exist_ok=True)
        # docs/images/loss.png is a real comparison's plot (zero-stages, see docs/report.md), not the fixture's
        here = os.getcwd()
        os.chdir(tmp)  # the app shows paths relative to the current directory: runs/smoke/..., as a user sees them
        try:
            written = asyncio.run(shoot(run_dir))
        finally:
            os.chdir(here)
        for path in written:
            print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
