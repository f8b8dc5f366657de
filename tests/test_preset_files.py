"""Unreadable presets: one line naming the file and the problem, exit 2, no traceback; a bare name
is the built-in unless a *file* of that name exists (a folder never shadows it). Through the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "shardscope.cli"]


def refuse(cwd, preset):
    proc = subprocess.run([*CLI, "run", "--preset", preset, "--headless", "--dry-run"], cwd=cwd,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    return proc.stderr.strip()


@pytest.mark.parametrize("name, content, problem", [
    ("random.toml", bytes(range(256)) * 4, "binary data (a NUL byte at offset 0)"),
    ("latin1.toml", "name = \"caf\xe9\"\n".encode("latin-1"), "not UTF-8 text (byte 0xe9 at offset 11)"),
    ("broken.toml", b"steps = = 3\n", "not valid TOML"),
])
def test_unreadable_bytes_are_one_line(tmp_path, name, content, problem):
    (tmp_path / name).write_bytes(content)
    line = refuse(tmp_path, name)
    assert line.startswith(f"error: {name}: ") or f"{name}: " in line
    assert problem in line


def test_directory_and_unreadable_file(tmp_path):
    (tmp_path / "conf.toml").mkdir()
    assert "conf.toml: is a directory, not a preset file" in refuse(tmp_path, "conf.toml")
    secret = tmp_path / "secret.toml"
    secret.write_text("steps = 3\n")
    secret.chmod(0)
    if os.access(secret, os.R_OK):  # root reads anything: cover the message through the module instead
        from shardscope.preset_files import PresetFileError, read_toml
        from unittest import mock
        with mock.patch("pathlib.Path.read_bytes", side_effect=PermissionError(13, "Permission denied")):
            with pytest.raises(PresetFileError, match=r"secret.toml: cannot read: Permission denied"):
                read_toml(secret)
    else:
        assert "secret.toml: cannot read: Permission denied" in refuse(tmp_path, "secret.toml")


def test_folder_named_like_a_builtin_does_not_shadow_it(tmp_path):
    (tmp_path / "smoke").mkdir()  # an earlier --out smoke
    proc = subprocess.run([*CLI, "run", "--preset", "smoke", "--headless", "--dry-run"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ddp" in proc.stdout and "fsdp2" in proc.stdout


def test_a_file_of_that_name_is_the_users_preset(tmp_path):
    from shardscope import config

    (tmp_path / "smoke.toml").write_text((config.PRESET_DIR / "smoke.toml").read_text().replace(
        'name = "fsdp2"', 'name = "mine"'))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert config.preset_path("smoke") == config.Path("smoke.toml")
        assert [r.name for r in config.load_preset("smoke").runs] == ["ddp", "mine"]
        with pytest.raises(config.ConfigError, match=r"^sub/smoke: no such preset file$"):
            config.preset_path("sub/smoke")  # a path is never a built-in name
    finally:
        os.chdir(cwd)
