"""Every line shardscope prints to be pasted into a shell, and every job script it writes, is quoted: a path that
holds ``$(…)`` is a path, never a command; a control character that would end a script's comment line is refused
up front (issue 58, item 5)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardscope.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_presets_copy_prints_a_quoted_line_that_runs_nothing_else(tmp_path):
    folder = tmp_path / "$(touch pwned)"
    folder.mkdir()
    proc = _cli(tmp_path, "presets", "copy", "smoke", str(folder / "p.toml"))
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip().split("run it with: ", 1)[1]
    assert shlex.split(line) == ["shardscope", "run", "--preset", str(folder / "p.toml")]
    runner = f"{sys.executable} -m shardscope.cli" + line[len("shardscope"):]
    done = subprocess.run(["bash", "-c", runner + " --dry-run"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (tmp_path / "pwned").exists()


def test_slurm_refuses_a_control_character_and_quotes_every_path(tmp_path):
    folder = tmp_path / "a\ntouch x"
    folder.mkdir()
    (folder / "p.toml").write_text("", encoding="utf-8")
    proc = _cli(tmp_path, "slurm", "--preset", str(folder / "p.toml"), "--nodes", "2")
    assert proc.returncode == 2 and "holds the control character '\\n'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    odd = tmp_path / "$(touch pwned)"
    odd.mkdir()
    assert _cli(tmp_path, "presets", "copy", "smoke", str(odd / "p.toml")).returncode == 0
    proc = _cli(tmp_path, "slurm", "--preset", str(odd / "p.toml"), "--nodes", "2", "--cpus-per-node", "1")
    assert proc.returncode == 0, proc.stderr
    script = proc.stdout
    assert f"# shardscope: preset {shlex.quote(str(odd / 'p.toml'))} on 2 node(s)" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_a_rendezvous_endpoint_is_a_host_and_a_port_before_anything_launches(tmp_path):
    for bad in ("a b:29500", "$(x):29500", "host;rm:29500"):
        proc = _cli(tmp_path, "run", "--preset", "smoke", "--set", f"launch.rdzv_endpoint={bad}", "--dry-run")
        assert proc.returncode == 2 and "is not a host name or address" in proc.stderr, (bad, proc.stderr)
    for good in ("node-1.cluster:29500", "10.1.2.3:29500", "[::1]:29500"):
        proc = _cli(tmp_path, "run", "--preset", "smoke", "--set", f"launch.rdzv_endpoint={good}", "--dry-run")
        assert proc.returncode == 0, (good, proc.stderr)
