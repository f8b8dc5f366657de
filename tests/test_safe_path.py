"""No child interpreter imports from the working directory: a ``typing_extensions.py`` planted in the folder
shardscope runs from (torch imports that module first thing) is never imported by the model check, the agents or
the ranks (``core/bounded.SAFE_PATH``). Run through the installed ``shardscope`` command, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PLANTED = """import os
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"imported-{os.getpid()}"), "w").close()
"""  # imported instead of the real one, it would also break torch's import: the run would fail too


def _shardscope() -> str:
    return os.path.join(os.path.dirname(sys.executable), "shardscope")


def _planted(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("imported-"))


@pytest.mark.slow
def test_a_module_planted_in_the_working_directory_is_never_imported(tmp_path):
    (tmp_path / "typing_extensions.py").write_text(PLANTED, encoding="utf-8")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(config), encoding="utf-8")
    (tmp_path / "p.toml").write_text("\n".join([
        "steps = 2", "global_batch = 4", "world_size = 2", "control = false", "", "[model]", 'kind = "hf"',
        'path = "./llama"', "seq_len = 8", "", "[[runs]]", 'name = "ddp"', 'strategy = "ddp"']) + "\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    proc = subprocess.run([_shardscope(), "run", "--preset", "p.toml", "--headless", "--out", "run"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["runs"][0]["status"] == "ok"
    assert _planted(tmp_path) == []  # the model check, the agent and both ranks ran from this folder
    # the planted module works as a witness: a plain interpreter started here imports it
    subprocess.run([sys.executable, "-c", "import typing_extensions"], cwd=tmp_path, env=env, check=True)
    assert len(_planted(tmp_path)) == 1


@pytest.mark.slow
def test_a_package_entry_is_still_found_from_the_folder_the_command_runs_in(tmp_path):
    """``entry = "package.module:build"``: its folder (the working directory) is put on the path by name, for the
    model check and the ranks alike, and nothing else of it."""
    source = Path(__file__).resolve().parent / "data" / "user" / "module" / "mymodel.py"
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("", encoding="utf-8")
    (tmp_path / "mypkg" / "mymodel.py").write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / "p.toml").write_text("\n".join([
        "steps = 2", "global_batch = 4", "world_size = 2", "control = false", "", "[model]", 'kind = "module"',
        'entry = "mypkg.mymodel:build"', "seq_len = 16", "", "[model.args]", "width = 32", "heads = 4", "",
        "[[runs]]", 'name = "ddp"', 'strategy = "ddp"']) + "\n", encoding="utf-8")
    proc = subprocess.run([_shardscope(), "run", "--preset", "p.toml", "--headless", "--out", "run"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["runs"][0]["status"] == "ok"
