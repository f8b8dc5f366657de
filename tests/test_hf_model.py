"""The Hugging Face causal LM: built from the architecture table, never downloaded."""

from __future__ import annotations

import pytest
import torch

from shardscope.config import ModelSpec
from shardscope.engines import hf_model
from shardscope.engines.model import build_model
from shardscope.engines.parallelize import blocks_of

TINY = ModelSpec(kind="hf", hf_arch="qwen2-tiny", hf_layers=2, vocab_size=512, seq_len=8)


def test_builds_qwen2_with_the_requested_depth_and_returns_logits():
    model = build_model(TINY, seed=1)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert len(blocks_of(model)) == 2
    logits = model(torch.randint(0, 512, (2, 8)))
    assert logits.shape == (2, 8, 512) and logits.dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as in Qwen2.5


def test_the_real_architecture_values_are_used():
    cfg = hf_model.hf_config(ModelSpec(kind="hf", hf_arch="qwen2.5-0.5b", hf_layers=3))
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (151936, 896, 4864)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers) == (14, 2, 3)
    assert cfg.tie_word_embeddings and cfg.rope_parameters["rope_theta"] == 1000000.0  # transformers 5 layout


def test_seed_decides_the_weights_and_global_rng_is_untouched():
    torch.manual_seed(7)
    before = torch.rand(1)
    torch.manual_seed(7)
    a, b, c = build_model(TINY, 1), build_model(TINY, 1), build_model(TINY, 2)
    assert torch.rand(1) == before
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.mlp.up_proj.weight"], sc["model.layers.0.mlp.up_proj.weight"])


def _model_dir(tmp_path, layers=3, seed=5):
    """A model directory of qwen2-tiny's config with ``layers`` layers and its weights (tied: saved once)."""
    import json

    from safetensors.torch import save_file

    from shardscope.core.hf_archs import ARCHS

    deep = build_model(ModelSpec(**{**TINY.__dict__, "hf_layers": layers}), seed=seed)
    (tmp_path / "config.json").write_text(json.dumps({**ARCHS["qwen2-tiny"], "num_hidden_layers": layers}))
    state = {k: v.contiguous() for k, v in deep.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    return deep


def test_model_dir_loads_real_weights_and_drops_extra_layers(tmp_path):
    deep = _model_dir(tmp_path)
    loaded = build_model(ModelSpec(kind="hf", path=str(tmp_path), hf_layers=2, seq_len=8), seed=99)
    assert len(blocks_of(loaded)) == 2
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, deep.state_dict()[name]), name
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_a_config_alone_is_initialised_from_the_seed(tmp_path):
    _model_dir(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    a = build_model(ModelSpec(kind="hf", path=str(tmp_path / "config.json"), seq_len=8), seed=3)
    b = build_model(ModelSpec(kind="hf", path=str(tmp_path), seq_len=8), seed=3)
    assert len(blocks_of(a)) == 3  # hf_layers = 0: every layer of the config
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_weights_that_do_not_fit_the_config(tmp_path):
    from safetensors.torch import save_file

    _model_dir(tmp_path)
    save_file({"model.norm.weight": torch.ones(64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks .* weights"):
        build_model(ModelSpec(kind="hf", path=str(tmp_path), seq_len=8), seed=0)
    save_file({"model.norm.weight": torch.ones(32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight has shape \\[32\\], the config gives \\[64\\]"):
        build_model(ModelSpec(kind="hf", path=str(tmp_path), seq_len=8), seed=0)
