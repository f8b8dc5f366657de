"""``shardscope predict`` for an image model (the ``vit`` preset): FLOPs per patch checked against torch's own
count of the real model, throughput predicted and compared in samples/s (its unit), never in tokens/s."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from shardscope import config
from shardscope.analysis.predict import predictor as predict, fit as predict_fit, report as predict_report
from shardscope.analysis.predict.work import tokens_per_sample, vit_flops_per_patch, work_of
from shardscope.engines.vit import ViT

from test_predict import CPU, _runs, smoke


def test_flops_per_patch_match_torchs_count_of_the_real_model():
    m = config.load_preset("vit", host=CPU).model
    net = ViT(m.image_size, m.patch_size, m.channels, m.num_classes, m.d_model, m.n_layers, m.n_heads, m.d_ff)
    # The input takes a gradient (as every block's input does) so the patch projection counts its full backward;
    # the math attention is decomposed into matmuls the counter sees (CPU's fused kernel has no FLOP formula).
    images = torch.randn(4, m.channels, m.image_size, m.image_size, requires_grad=True)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        net(images).sum().backward()
    counted = counter.get_total_flops() / (4 * tokens_per_sample(m))
    # ours also counts 6 FLOPs per bias and norm element (torchtitan's 6N), which no matmul does: 0.8% here
    assert vit_flops_per_patch(m) == pytest.approx(counted, rel=0.02)
    assert vit_flops_per_patch(m) > counted


def test_vit_is_predicted_in_samples_per_second():
    c = config.load_preset("vit", host=CPU)
    model = predict_fit.fit(_runs(smoke()), cores=8)
    rows = predict.predict_comparison(c, model)["runs"]
    assert {r["name"] for r in rows} == {"ddp", "fsdp2", "fsdp1"}
    for r in rows:
        assert r["why"] is None, r["why"]
        assert r["unit"] == "samples/s" and r["tokens_per_s"] is None
        assert r["samples_per_s"] == pytest.approx(c.global_batch / r["step_time_s"])
        assert predict.rate(r) == r["samples_per_s"] and predict.unit(r) == "samples/s"
    w = work_of(c, c.run("ddp"))
    assert w.tokens_per_step == c.global_batch * (c.model.image_size // c.model.patch_size) ** 2
    text = smoke()
    assert predict.predict_run(text, text.run("ddp"), model)["unit"] == "tokens/s"


def test_the_report_sets_samples_per_second_beside_samples_per_second():
    row = {"name": "ddp", "strategy": "ddp", "why": None, "unit": "samples/s", "tokens_per_s": None,
           "samples_per_s": 1200.0, "measured_tokens_per_s": None, "measured_samples_per_s": 1000.0, "error": 0.2,
           "measured_spread": 0.05, "step_time_s": 0.02, "compute_s": 0.015, "exposed_comm_s": 0.004,
           "rest_s": 0.001, "bound": None, "notes": []}
    sec = {"calibrated_on": "smoke", "runs": {"ddp": row}, "assumptions": []}
    md = predict_report.markdown(sec)
    assert "predicted samples/s" in md and "| 1,200 | 1,000 | +20.0%" in md and "tokens/s" not in md
    assert "predicted 1,200 samples/s, measured 1,000" in "\n".join(predict_report.plain_lines(sec))
    assert predict.unit({"unit": "../../etc/passwd"}) == "tokens/s"  # summary.json is input: only the two units
