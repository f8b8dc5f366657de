"""Every ``shardscope ...`` line of README.md and of the docs pages (``docs/*.md``) runs and exits as documented (0).

Lines that launch torchrun jobs (``run``, ``tune``) run with ``--dry-run`` (which still validates the preset for this
machine and prints the exact torchrun commands). A line that cannot run here is listed in
``EXCEPTIONS`` with the reason; a listed line that is no longer in the README or the docs fails the test, so
the list cannot go stale. Each line runs in a scratch directory holding what the README assumes
exists (``./mine.toml``; ``runs/mine``, a recorded run directory).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))  # the docs pages: their command lines are checked as the README's
REPLAY = Path(__file__).parent / "data" / "replay-smoke"
USER = Path(__file__).parent / "data" / "user"

EXCEPTIONS = {
    "shardscope": "opens the interactive app; tests/test_tui_app.py and test_tui_e2e.py drive it",
    "shardscope open runs/mine": "opens the app on a run directory; tests/test_tui_app.py replays one",
}


def readme_commands() -> list[str]:
    """Every line of a fenced code block in README.md, then in each docs page, that starts with ``shardscope``,
    without its trailing ``# comment`` and output redirection; a line the README or another page already has is
    taken once."""
    lines: list[str] = []
    for page in (README, *DOCS):
        text = page.read_text(encoding="utf-8")
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
            for line in block.splitlines():
                line = line.split(" #", 1)[0].strip()
                if line == "shardscope" or line.startswith("shardscope "):
                    line = re.sub(r"\s*>\s*\S+$", "", line)
                    if line not in lines:
                        lines.append(line)
    return lines


COMMANDS = readme_commands()


def test_the_readme_has_examples_and_every_exception_is_one_of_them():
    assert len(COMMANDS) >= 10, COMMANDS
    assert set(EXCEPTIONS) <= set(COMMANDS), set(EXCEPTIONS) - set(COMMANDS)
    assert set(EXPECTED_EXIT) <= set(COMMANDS), set(EXPECTED_EXIT) - set(COMMANDS)

# Lines documented to exit non-zero on the recorded run directory, with the reason.
EXPECTED_EXIT = {
    "shardscope diff runs/mine runs/mine": (1, "runs/mine holds a run failed on purpose (a fault): diff fails a "
                                               "new run that did not end ok, even against itself"),
}


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A working directory with ``mine.toml`` (the smoke preset) and ``runs/mine`` (a recorded run)."""
    d = tmp_path_factory.mktemp("readme")
    shutil.copy(ROOT / "shardscope" / "presets" / "smoke.toml", d / "mine.toml")
    shutil.copytree(REPLAY, d / "runs" / "mine")
    # "Your model and your data": the README's own preset files, and the files they name
    for name, text in readme_presets().items():
        (d / name).write_text(text, encoding="utf-8")
    shutil.copytree(USER / "llama", d / "llama")
    for name in ("train.bin", "corpus.txt", "tokenizer.json"):
        shutil.copy(USER / name, d / name)
    shutil.copy(USER / "module" / "mymodel.py", d / "mymodel.py")
    return d


def readme_presets() -> dict[str, str]:
    """The README's TOML blocks that start with ``# <name>.toml``, by file name."""
    out = {}
    for block in re.findall(r"```toml\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S):
        first = block.splitlines()[0]
        if first.startswith("# ") and first.endswith(".toml"):
            out[first[2:]] = block
    return out


def test_the_readme_presets_are_there():
    assert set(readme_presets()) == {"llama.toml", "mymodel.toml"}


@pytest.mark.parametrize("line", [c for c in COMMANDS if c not in EXCEPTIONS])
def test_readme_line_exits_as_documented(line, scratch):
    args = shlex.split(line)[1:]
    if args[0] in ("run", "tune") and "--dry-run" not in args:
        args.append("--dry-run")
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", *args], cwd=scratch, capture_output=True,
                          text=True, timeout=300)
    expected = EXPECTED_EXIT.get(line, (0, ""))[0]
    assert proc.returncode == expected, f"{line}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr
    if args[0] == "run":
        assert "torch.distributed.run" in proc.stdout
