"""Every decoder a user brings: the block layouts transformers' families use, found and held by path before anything
wraps them; checkpoints loaded as transformers loads them; pipeline stages cut from the model's own forward, tied
embeddings included; every refusal a note, the other runs run.

The families are transformers' own default configs, shrunk (``benchmarks/architectures.tiny_config``, the sweep's
own), written as a ``config.json``: nothing is downloaded. End to end (slow): GPT-2 (tied embeddings) under every
data-parallel strategy and two pipelines, and GPT-NeoX (from its ``save_pretrained`` checkpoint), OPT, BLOOM, Falcon
Mamba and Mixtral (4 experts, 2 per token) under DDP, FSDP2 and 1F1B: parity with DDP, observed / theory bytes 1.000, model states exact on every rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _launch import grad_norms, max_abs_diff, read_run
from benchmarks.architectures import tiny_config
from shardscope.config import ModelSpec
from shardscope.engines import describe, hf_model
from shardscope.engines.parallelize import BLOCKS_ATTR, blocks_of

LAYOUTS = {"gpt2": "transformer.h", "gpt_neox": "gpt_neox.layers", "opt": "model.decoder.layers",
           "bloom": "transformer.h", "falcon": "transformer.h", "mamba": "backbone.layers", "llama": "model.layers", "mixtral": "model.layers"}


def family_dir(root: Path, family: str) -> Path:
    """A folder holding ``family``'s shrunk default config."""
    values, skipped = tiny_config(family)
    assert values is not None, skipped
    folder = root / family
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(values, default=str), encoding="utf-8")
    return folder


@pytest.mark.parametrize("family", list(LAYOUTS))
def test_the_blocks_are_found_for_every_layout_and_noted_by_path(tmp_path, family):
    model = hf_model.build_model(ModelSpec(kind="hf", path=str(family_dir(tmp_path, family)), seq_len=16), seed=0)
    assert getattr(model, BLOCKS_ATTR) == LAYOUTS[family]
    assert blocks_of(model) is model.get_submodule(LAYOUTS[family])
    assert not model.training  # dropout off: every strategy computes one function


FULLY_SHARD = """
import sys
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from shardscope.config import ModelSpec
from shardscope.engines import hf_model
from shardscope.engines.parallelize import blocks_of

model = hf_model.build_model(ModelSpec(kind="hf", path=sys.argv[1], seq_len=16), seed=0)
blocks = blocks_of(model)
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[2], 1), rank=0, world_size=1)
for block in blocks:
    fully_shard(block)
fully_shard(model)
print(type(model).__name__, type(blocks[0]).__name__, blocks_of(model) is blocks)
dist.destroy_process_group()
"""


def test_the_blocks_are_found_after_fully_shard_renames_their_class(tmp_path):
    # its own interpreter: a process group's threads left in a test worker would be there when it forks
    proc = subprocess.run([sys.executable, "-c", FULLY_SHARD, str(family_dir(tmp_path, "gpt2")), str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["FSDPGPT2LMHeadModel", "FSDPGPT2Block", "True"], proc.stdout


def test_model_blocks_names_a_hugging_face_models_layers_or_is_refused(tmp_path):
    folder = str(family_dir(tmp_path, "gpt2"))
    model = hf_model.build_model(ModelSpec(kind="hf", path=folder, seq_len=16, blocks="transformer.h"), seed=0)
    assert getattr(model, BLOCKS_ATTR) == "transformer.h"
    with pytest.raises(ValueError, match="model.blocks = 'transformer.nope': GPT2LMHeadModel has no attribute 'nope'"):
        hf_model.build_model(ModelSpec(kind="hf", path=folder, seq_len=16, blocks="transformer.nope"), seed=0)


def test_a_neox_checkpoint_loads_the_bytes_transformers_loads(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    values, _ = tiny_config("gpt_neox")
    values["num_hidden_layers"] = 3
    config = AutoConfig.for_model(**values)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "neox")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "neox" / "model.safetensors"), "pt") as fh:
        assert "embed_out.weight" in set(fh.keys())  # transformers' own name on disk, lm_head in the module
    spec = ModelSpec(kind="hf", path=str(tmp_path / "neox"), hf_layers=2, seq_len=16)
    mine = hf_model.build_model(spec, seed=7).state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "neox").state_dict()
    assert len(mine) == len(theirs) - 12  # the third layer's tensors are left unread
    assert all(torch.equal(t, theirs[n]) for n, t in mine.items())
    assert describe.describe(spec, 0)["weights"]["files"] == ["model.safetensors"]


def test_pipeline_facts_find_tied_embeddings_and_what_runs_after_the_blocks(tmp_path):
    gpt2 = describe.describe(ModelSpec(kind="hf", path=str(family_dir(tmp_path, "gpt2")), seq_len=16), 0)["pipeline"]
    assert gpt2["refusal"] == "" and gpt2["tied"] == ["transformer.wte.weight"]
    assert {"transformer.ln_f.weight", "transformer.ln_f.bias", "transformer.wte.weight"} == set(gpt2["last"])
    assert gpt2["pre_modules"] == ["transformer.wte", "transformer.wpe"]
    neox = describe.describe(ModelSpec(kind="hf", path=str(family_dir(tmp_path, "gpt_neox")), seq_len=16), 0)["pipeline"]
    assert neox["tied"] == [] and "lm_head.weight" in neox["last"]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe", "granitemoe", "gpt_oss"])
def test_mixture_of_experts_decoders_pass_the_model_check(tmp_path, family):
    """Routed experts on fake tensors (describe.MOE_FAKE): every expert's parameters described, FLOPs counted, the
    experts' gathered weights not counted as activations."""
    d = describe.describe(ModelSpec(kind="hf", path=str(family_dir(tmp_path, family)), seq_len=16), 0)
    assert d["train_flops_per_sample"] > 0 and d["pipeline"]["refusal"] == "", d["pipeline"]
    experts = [p for p in d["params"] if ".experts." in p[0]]
    assert experts and all(shape[0] == 4 for _, shape, *_ in experts if len(shape) == 3), experts
    params = sum(n * 4 for n in [int(torch.tensor(shape).prod()) for _, shape, *_ in experts])
    assert d["saved_bytes_per_sample"] < params  # no per-token copy of the experts' weights


def _cli(tmp: Path, text: str, *args: str) -> subprocess.CompletedProcess:
    (tmp / "p.toml").write_text(text, encoding="utf-8")
    return subprocess.run([sys.executable, "-m", "shardscope.cli", "run", "--preset", str(tmp / "p.toml"), *args],
                          capture_output=True, text=True, timeout=600, cwd=tmp)


def _runs(*runs: tuple[str, str, str, int]) -> list[str]:
    lines: list[str] = []
    for name, strategy, options, ws in runs:
        lines += ["", "[[runs]]", f'name = "{name}"', f'strategy = "{strategy}"', f"world_size = {ws}"]
        if options:
            lines.append(f"options = {{ {options} }}")
    return lines


def test_runs_that_cannot_run_the_model_are_each_a_note_and_the_others_run(tmp_path):
    head = ["steps = 2", "global_batch = 8", "world_size = 2", "", "[model]", 'kind = "hf"',
            f'path = "{family_dir(tmp_path, "gpt2")}"', "seq_len = 16"]
    runs = _runs(("ddp", "ddp", "", 2), ("tp", "fsdp2-tp", "tp = 2", 4),
                 ("deep", "pp-interleaved", "pp = 2, stages_per_rank = 4", 2), ("m3", "pp-1f1b", "pp = 2, microbatches = 3", 2),
                 ("pp", "pp-1f1b", "pp = 2", 2))
    proc = _cli(tmp_path, "\n".join(head + runs) + "\n", "--dry-run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = proc.stdout + proc.stderr
    assert "run tp left out: fsdp2-tp: this model declares no tensor-parallel plan" in said
    assert "run deep left out: pp-interleaved: options.pp = 2 x stages_per_rank = 4: 8 stages, but the model has 4 units" in said
    assert "run m3 left out: pp-1f1b: options.microbatches = 3" in said
    assert '"name": "pp"' in proc.stdout and '"name": "deep"' not in proc.stdout
    alone = _runs(("tp", "fsdp2-tp", "tp = 2", 4))
    proc = _cli(tmp_path, "\n".join(head + alone) + "\n", "--dry-run")
    assert proc.returncode == 2 and "the baseline cannot run this model" in proc.stderr, proc.stderr[-2000:]


def test_the_estimate_gives_each_schedule_its_own_activations_for_a_described_model(tmp_path):
    from shardscope.config import load_preset
    from shardscope.profiling import memory_model

    head = ["steps = 2", "global_batch = 16", "world_size = 2", "", "[model]", 'kind = "hf"',
            f'path = "{family_dir(tmp_path, "gpt2")}"', "seq_len = 16"]
    runs = _runs(("gpipe", "pp-gpipe", "pp = 2, microbatches = 8", 2), ("1f1b", "pp-1f1b", "pp = 2, microbatches = 8", 2))
    (tmp_path / "p.toml").write_text("\n".join(head + runs) + "\n", encoding="utf-8")
    c = load_preset(str(tmp_path / "p.toml"))
    from shardscope.profiling.run_description import describe_run

    acts = {r.name: memory_model.activation_bytes(c, describe_run(c, r).layout) for r in c.runs}
    # rank 0 of 2: GPipe holds all 8 micro-batches of its stage, 1F1B at most pp - rank = 2
    assert acts["gpipe"]["layers"] == 4 * acts["1f1b"]["layers"] > 0, acts
    by_run = {p["run"]: p for p in memory_model.predict_comparison(c)}
    assert by_run["gpipe"]["activation_bytes"] > by_run["1f1b"]["activation_bytes"]


# --- end to end --------------------------------------------------------------------------------------------------

DATA_PARALLEL = [("ddp", "ddp", "", 2), ("fsdp1", "fsdp1", "", 2), ("fsdp2", "fsdp2", "", 2),
                 ("handwritten", "fsdp-handwritten", "", 2), ("zero1", "deepspeed-zero1", "", 2),
                 ("zero2", "deepspeed-zero2", "", 2), ("zero3", "deepspeed-zero3", "", 2)]
PIPELINES = [("1f1b", "pp-1f1b", "pp = 2, microbatches = 2", 2),
             ("1f1b-fsdp2", "pp-1f1b", 'pp = 2, microbatches = 2, dp_shard = "fsdp2"', 4)]
COMPARISONS = {"gpt2": DATA_PARALLEL + PIPELINES,
               **{f: [DATA_PARALLEL[0], DATA_PARALLEL[2], PIPELINES[0]] for f in ("gpt_neox", "opt", "bloom", "falcon",
                                                                                   "mamba", "mixtral")}}


@pytest.fixture(scope="module")
def comparisons(tmp_path_factory):
    done: dict[str, tuple[subprocess.CompletedProcess, Path]] = {}

    def get(family: str) -> tuple[subprocess.CompletedProcess, Path]:
        if family not in done:
            tmp = tmp_path_factory.mktemp(family)
            folder = family_dir(tmp, family)
            if family == "gpt_neox":  # from transformers' own save_pretrained: embed_out.weight on disk
                from transformers import AutoConfig, AutoModelForCausalLM

                config = AutoConfig.from_pretrained(folder)
                torch.manual_seed(1)
                AutoModelForCausalLM.from_config(config).save_pretrained(folder)
            text = ["steps = 3", "global_batch = 8", "world_size = 2", "parity = true", 'precision = "fp32"',
                    "lr = 3e-3", "warmup_steps = 1", "loss_tolerance = 1e-4", "stall_timeout_s = 240", "control = false",
                    "", "[model]", 'kind = "hf"', f'path = "{folder}"', "seq_len = 16", "",
                    "[profile]", "start_step = 2", "steps = 1", "count_collectives = true",
                    *_runs(*COMPARISONS[family])]
            done[family] = (_cli(tmp, "\n".join(text) + "\n", "--headless", "--out", str(tmp / "run")), tmp / "run")
        return done[family]
    return get


CASES = [pytest.param(f, r[0], id=f"{f}-{r[0]}") for f, runs in COMPARISONS.items() for r in runs[1:]]


@pytest.mark.slow
@pytest.mark.parametrize("family, name", CASES)
def test_each_family_trains_at_parity_with_exact_bytes_and_states(comparisons, family, name):
    proc, out = comparisons(family)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    status = {r["name"]: r["status"] for r in summary["runs"]}
    assert status.get(name) == "ok", status
    ddp, run = read_run(out / "ddp"), read_run(out / name)
    assert len(run.losses()) == len(ddp.losses()) == 3
    assert max_abs_diff(run.losses(), ddp.losses()) <= 1e-5, (run.losses(), ddp.losses())
    assert max_abs_diff(grad_norms(run), grad_norms(ddp)) <= 1e-5
    theory = summary["communication"]["runs"][name]["theory"]
    assert theory["ratio"] == pytest.approx(1.0, abs=1e-3), theory
    for rank, row in summary["memory"]["runs"][name]["per_rank"].items():
        for key in ("param_bytes", "grad_bytes", "optim_bytes", "model_state_bytes"):
            assert row["predicted"][key] == row["measured"][key], (rank, key)
    if family == "gpt2" and name.startswith("1f1b"):  # the tied embedding: summed between the first and last stage
        assert "tied embedding's gradient (transformer.wte.weight)" in theory.get("basis", ""), theory


def test_an_index_naming_files_outside_the_model_folder_is_refused_before_reading_them(tmp_path):
    folder = family_dir(tmp_path, "llama")
    (tmp_path / "secret.safetensors").write_bytes(b"not read")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "../secret.safetensors"}}), encoding="utf-8")
    spec = ModelSpec(kind="hf", path=str(folder), seq_len=16)
    with pytest.raises(describe.DescribeError, match="names '../secret.safetensors', a file outside the model's folder"):
        describe.describe(spec, 0)
    with pytest.raises(ValueError, match="outside the model's folder"):
        hf_model.build_model(spec, seed=0)
