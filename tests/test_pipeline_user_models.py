"""Pipeline stages of the user's own models (issue 46, item 2), end to end through the command line against DDP:
a user's Mistral ``config.json`` (untied output layer), each stage rebuilt from the model's own modules
(engines/pipeline_stages.HFStage), and a module of the user's with untied embeddings whose ``pre_blocks`` and
``post_blocks`` run on the first and last stages (engines/module_pipeline.py), both split by the same unit split as
the built-in transformer (embeddings, each block, head); and the models whose stages cannot be built refused before
the start, with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardscope import config

DATA = Path(__file__).resolve().parent / "data" / "user"

PRESET = """
description = "pipeline stages of a user's model against ddp"
steps = 4
global_batch = 8
lr = 3e-3
warmup_steps = 1
precision = "fp32"
world_size = 2
seed = 7
loss_tolerance = 1e-5
stall_timeout_s = 120
parity = true
control = false

[model]
{model}

[profile]
start_step = 2
steps = 1
count_collectives = true

[[runs]]
name = "ddp"
strategy = "ddp"

[[runs]]
name = "1f1b"
strategy = "pp-1f1b"

[[runs]]
name = "interleaved"
strategy = "pp-interleaved"
"""
PIPELINES = ("1f1b", "interleaved")


MODELS = {
    "mistral": f'kind = "hf"\npath = "{DATA / "mistral"}"\nseq_len = 16',
    # 4 blocks: interleaved's 4 stages hold embeddings + a block, two blocks, a block + head (units balanced)
    "module": f'kind = "module"\nentry = "{DATA / "module" / "mymodel.py"}:build"\nseq_len = 16\n\n'
              '[model.args]\nwidth = 64\nheads = 4\ndepth = 4\ntied = false',
}


@pytest.mark.slow
@pytest.mark.floor
@pytest.mark.parametrize("model", list(MODELS))
def test_a_users_model_in_stages_trains_like_ddp_with_exact_bytes_and_states(tmp_path, model):
    (tmp_path / "p.toml").write_text(PRESET.format(model=MODELS[model]), encoding="utf-8")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "run", "--preset", str(tmp_path / "p.toml"),
                           "--headless", "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    runs = {r["name"]: r for r in summary["runs"]}
    for name in PIPELINES:
        assert runs[name]["status"] == "ok", runs[name].get("error")
        assert runs[name]["loss_max_abs_diff"] <= 1e-5 and runs[name]["loss_steps_compared"] == 4, name
        comm = summary["communication"]["runs"][name]
        for kind in ("send", "recv", "all_reduce"):
            counted = []
            for f in sorted(os.listdir(out / name / "metrics")):
                lines = (out / name / "metrics" / f).read_text(encoding="utf-8").splitlines()
                counted.append([json.loads(x) for x in lines if '"comm"' in x][-1]["collectives"][kind]["bytes_per_step"])
            assert sum(counted) / len(counted) == pytest.approx(comm["theory"]["by_type"][kind], rel=1e-12), (name, kind)
        for rank, row in summary["memory"]["runs"][name]["per_rank"].items():
            for key in ("param_bytes", "grad_bytes", "optim_bytes"):
                assert row["predicted"][key] == row["measured"][key], (name, rank, key)
        assert 0.0 <= runs[name]["pipeline"]["bubble_measured"] <= 1.0


NO_METHODS = """
import torch
from torch import nn


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 64)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(model, seed):
    return Plain()
"""


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_a_hugging_face_configs_stages_are_its_own_tied_or_windowed(tmp_path, family):
    """A described Hugging Face model's stages are cut from its own forward (engines/hf_pipeline.py): a tied Llama
    and Gemma 2 (sliding window, soft-capping) are judged runnable; tests/test_architectures.py trains such stages."""
    text = "\n".join(["world_size = 2", "global_batch = 8", "", "[model]", "kind = 'hf'", f"path = '{DATA / family}'",
                      "seq_len = 16", "", "[[runs]]", "name = 'p'", "strategy = 'pp-1f1b'"]) + "\n"
    (tmp_path / "p.toml").write_text(text, encoding="utf-8")
    c = config.load_preset(str(tmp_path / "p.toml"), host=config.HostInfo("cpu", 8, "test"))
    assert [r.name for r in c.runs] == ["p"] and not c.adjustments


@pytest.mark.parametrize("model, said", [
    (["kind = 'hf'", "hf_arch = 'qwen2-tiny'"], "tie_word_embeddings = true"),
    # the user's module as shipped ties its embeddings: found by watching what pre_blocks and post_blocks touch
    (["kind = 'module'", f"entry = '{DATA / 'module' / 'mymodel.py'}:build'"],
     "embed.weight is used both before and after the blocks .tied or shared weights.*untie it"),
    (["kind = 'module'", "entry = './plain.py:build'"], "Plain defines no pre_blocks or post_blocks"),
    # what the user's methods raise refuses pipeline stages only (the model check itself goes on)
    (["kind = 'module'", "entry = './raising.py:build'"], "pre_blocks, the blocks and post_blocks raised ValueError: "
                                                          "not like this"),
])
def test_models_whose_stages_are_not_built_are_refused_with_the_reason(tmp_path, model, said):
    (tmp_path / "plain.py").write_text(NO_METHODS, encoding="utf-8")
    (tmp_path / "raising.py").write_text(NO_METHODS.replace("    def forward(self, tokens):", "    def pre_blocks(self, tokens):\n"
                                         "        raise ValueError('not like this')\n\n    def post_blocks(self, x):\n"
                                         "        return self.head(x)\n\n    def forward(self, tokens):"), encoding="utf-8")
    text = "\n".join(["world_size = 2", "global_batch = 8", "", "[model]", *model, "seq_len = 16", "",
                      "[[runs]]", "name = 'p'", "strategy = 'pp-1f1b'"]) + "\n"
    (tmp_path / "p.toml").write_text(text, encoding="utf-8")
    with pytest.raises(config.ConfigError, match=said):
        config.load_preset(str(tmp_path / "p.toml"), host=config.HostInfo("cpu", 8, "test"))
