"""The recommendation logic on synthetic summaries: winner, tie within noise, failed run, no fit, CPU."""

from __future__ import annotations

import pytest

from shardscope.analysis import recommend

MiB = 2**20


def _summary(*runs):
    return {"baseline": runs[0]["name"], "runs": list(runs)}


def _run(name, rate, peak_mib, status="ok", **extra):
    return {"name": name, "status": status, "median_tokens_per_s": rate, "peak_mem_bytes": peak_mib * MiB, **extra}


def test_clear_winner_and_what_each_run_saves_and_costs():
    s = _summary(_run("ddp", 10000, 800), _run("fsdp", 7000, 500))
    rec = recommend.recommend(s, {"ddp": 0.02, "fsdp": 0.03}, "cuda")
    assert rec["fastest"] == "ddp" and rec["no_clear_difference"] == []
    assert "fastest run: ddp (10,000 tokens/s, 1.43x fsdp, 1.36x-1.50x with the noise)" in rec["lines"]
    assert rec["runs"]["fsdp"]["mem_saved_bytes"] == 300 * MiB
    assert ("fsdp vs ddp: saves 300.0 MiB of allocator peak memory per rank, costs 30.0% throughput (0.70x, 0.67x-0.74x "
            "with the noise) (7,000 vs 10,000 tokens/s)") in rec["lines"]
    assert rec["caveats"] == []


def test_tie_within_the_runs_own_spread_is_no_clear_difference():
    s = _summary(_run("ddp", 10000, 800), _run("fsdp", 9800, 500))
    rec = recommend.recommend(s, {"ddp": 0.015, "fsdp": 0.01}, "cuda")
    assert rec["no_clear_difference"] == ["ddp", "fsdp"]
    assert any(line.startswith("no clear difference in throughput between ddp, fsdp") for line in rec["lines"])
    assert "throughput not distinguishable on this machine now (0.98x, band ±2.5%" in rec["lines"][-1]
    # The same 2% gap with tighter spreads is a real difference.
    assert recommend.recommend(s, {"ddp": 0.005, "fsdp": 0.005}, "cuda")["no_clear_difference"] == []


def test_a_failed_run_is_left_out_and_said():
    s = _summary(_run("ddp", 10000, 800), _run("zero3", None, 300, status="failed", error="out of memory on rank 1"))
    rec = recommend.recommend(s, {"ddp": 0.02, "zero3": None}, "cuda")
    assert rec["fastest"] == "ddp"
    assert "zero3 failed: left out of the recommendation (out of memory on rank 1)" in rec["lines"]
    assert not any(line.startswith("zero3 vs") for line in rec["lines"])


def test_a_run_that_does_not_fit_is_not_the_winner_and_its_scale_is_said():
    s = _summary(_run("ddp", 10000, 900), _run("fsdp", 7000, 500))
    rec = recommend.recommend(s, {"ddp": 0.01, "fsdp": 0.01}, "cuda", 600 * MiB, {"ddp": None, "fsdp": 1})
    assert rec["fastest"] == "fsdp" and rec["runs"]["ddp"]["fits"] is False
    assert "fastest run that fits: fsdp (7,000 tokens/s)" in rec["lines"]
    assert any(line.startswith("ddp would not fit 600.0 MiB: peak 900.0 MiB per rank at the measured batch; the "
                               "memory model (model states") and "does not fit at any world size" in line for line in rec["lines"])


def test_model_states_saved_come_from_the_exact_counts():
    s = _summary(_run("ddp", 10000, 800), _run("fsdp", 7000, 790))
    s["memory"] = {"runs": {"ddp": {"measured": {"model_state_bytes": 400 * MiB}},
                            "fsdp": {"measured": {"model_state_bytes": 100 * MiB}}}}
    rec = recommend.recommend(s, {"ddp": 0.01, "fsdp": 0.01}, "cuda")
    assert rec["runs"]["fsdp"]["model_states_saved_bytes"] == 300 * MiB
    assert "(model states 400.0 MiB -> 100.0 MiB, counted exactly)" in rec["lines"][-1]


def test_cpu_runs_say_gloo_timings_do_not_predict_gpus():
    s = _summary(_run("ddp", 10000, 800), _run("fsdp", 5000, 790))
    rec = recommend.recommend(s, {"ddp": 0.05, "fsdp": 0.05}, "cpu")
    assert rec["caveats"] == [recommend.GPU_CAVEAT] and "gloo" in rec["caveats"][0]
    assert "**Caveat**" in recommend.markdown(rec)


def test_unknown_spread_is_said_not_guessed():
    s = _summary(_run("ddp", 10000, 800), _run("fsdp", 9900, 500))
    rec = recommend.recommend(s, {"ddp": None, "fsdp": None}, "cuda")
    assert "not tested against noise (fewer than 4 timed steps and no A/A control)" in rec["lines"][0]


def test_smallest_fitting_world_size_follows_the_memory_model():
    from shardscope import config
    from shardscope.profiling import memory_model

    c = config.load_preset("ddp-vs-fsdp")
    ddp, fsdp = c.runs[0], c.runs[1]
    limit = memory_model.predict_run(c, fsdp, 4)["total_bytes"]
    at = recommend.smallest_fitting_world_size(c, fsdp, limit)
    assert at is not None and at <= 4
    assert memory_model.predict_run(c, fsdp, at)["total_bytes"] <= limit
    if at > 1:
        assert memory_model.predict_run(c, fsdp, at // 2)["total_bytes"] > limit
    assert recommend.smallest_fitting_world_size(c, ddp, limit) is None  # a replica does not shrink with ranks


def test_device_memory_refits_the_summary_and_report_of_a_run_directory(tmp_path):
    import json
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from shardscope.analysis.report import write_reports
    from shardscope.cli.recommendview import refit

    out = tmp_path / "run"
    shutil.copytree(Path(__file__).parent / "data" / "replay-smoke", out)
    write_reports(str(out))
    outside = tmp_path / "not-yours.md"  # a report.md that links out of the directory is replaced, not written through
    outside.write_text("keep me")
    (out / "report.md").unlink()
    (out / "report.md").symlink_to(outside)
    summary = refit(str(out), 1 * MiB)  # every run's measured peak is above 1 MiB
    assert outside.read_text() == "keep me" and not (out / "report.md").is_symlink()
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["recommendation"] == summary["recommendation"]
    assert summary["recommendation"]["device_memory_bytes"] == MiB
    ok = [r["name"] for r in summary["runs"] if r.get("peak_mem_bytes")]
    for name in ok:
        assert summary["recommendation"]["runs"][name]["fits"] is False
        assert any(line.startswith(f"{name} would not fit 1.0 MiB") for line in summary["recommendation"]["lines"])
    assert "would not fit 1.0 MiB" in (out / "report.md").read_text()
    bad = subprocess.run([sys.executable, "-m", "shardscope.cli", "run", "--preset", "smoke", "--headless",
                          "--device-memory", "80XB", "--out", str(tmp_path / "never")], capture_output=True, text=True,
                         check=False)
    assert bad.returncode == 2 and "--device-memory '80XB'" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "never").exists()


def test_on_cpu_memory_is_judged_by_model_states_never_by_process_rss():
    """FSDP2 on CPU: its process RSS is 14 MiB above DDP's (runtime, libraries), its model states half of DDP's.
    The recommendation says what it saves in model states and never that it uses more memory."""
    s = _summary(_run("ddp", 10000, 368, peak_mem_kind="process RSS"),
                 _run("fsdp2", 9000, 382, peak_mem_kind="process RSS"))
    s["memory"] = {"runs": {"ddp": {"measured": {"model_state_bytes": 2 * MiB}},
                            "fsdp2": {"measured": {"model_state_bytes": 1 * MiB}}}}
    rec = recommend.recommend(s, {"ddp": 0.01, "fsdp2": 0.01}, "cpu")
    assert rec["runs"]["fsdp2"]["mem_saved_bytes"] == 1 * MiB
    line = next(x for x in rec["lines"] if x.startswith("fsdp2 vs ddp"))
    assert line.startswith("fsdp2 vs ddp: saves 1.0 MiB of model-state memory (counted exactly; process RSS not "
                           "compared) per rank"), line
    assert "more" not in line


def test_one_noise_rule_no_line_contradicts_another():
    """The issue's case: zero3 and zero2 were 'no clear difference' with the fastest, then 'zero2 vs ddp:
    costs 67.1% throughput'. Every pair named together is within each other's noise, and a run's line
    against the baseline uses the same rule."""
    from shardscope.core.numbers import within_noise

    # zero3 is fastest; ddp and zero2 are each within zero3's noise but not within each other's: zero2
    # must stay out of the group that ddp is in, since its line against ddp says what it costs.
    s = _summary(_run("ddp", 91, 800), _run("zero3", 100, 300), _run("zero2", 81, 500))
    spreads = {"ddp": 0.0, "zero3": 0.1, "zero2": 0.1}
    rec = recommend.recommend(s, spreads, "cuda")
    group = rec["no_clear_difference"]
    assert group == ["zero3", "ddp"]
    for a in group:
        for b in group:
            if a != b:
                ra, rb = (next(r for r in s["runs"] if r["name"] == n)["median_tokens_per_s"] for n in (a, b))
                assert within_noise(ra, rb, spreads[a], spreads[b])
    for name in ("zero3", "zero2"):
        line = next(line for line in rec["lines"] if line.startswith(f"{name} vs ddp"))
        assert ("not distinguishable" in line) == (name in group), (group, line)
    # Without a measured spread, a cost is said to be untested against the noise.
    rec = recommend.recommend(s, {"ddp": None, "zero3": 0.1, "zero2": 0.1}, "cuda")
    assert any(line.startswith("zero2 vs ddp") and "not tested against noise" in line for line in rec["lines"])


def test_recommendation_and_diff_share_the_rule():
    from shardscope.core.numbers import within_noise

    assert within_noise(95.5, 100, 0.02, 0.03) is True and within_noise(100, 95.5, 0.03, 0.02) is True
    assert within_noise(94, 100, 0.02, 0.03) is False
    assert within_noise(94, 100, None, 0.03) is None
    # A CI run's case: a run slowed 5.7x beside a noisy old run (spread 0.90) was called noise when spreads were
    # added (0.826 <= 0.939). Spreads compose as factors: (1.90)(1.04) = 1.98, so only ratios down to 0.51 are noise.
    assert within_noise(17.4, 100, 0.04, 0.90) is False
    assert within_noise(52, 100, 0.04, 0.90) is True and within_noise(100, 52, 0.90, 0.04) is True
    rec = recommend.recommend(_summary(_run("ddp", 100, 800), _run("fsdp", 95.5, 500)), {"ddp": 0.03, "fsdp": 0.02}, "cuda")
    assert rec["no_clear_difference"] == ["ddp", "fsdp"]
    rec = recommend.recommend(_summary(_run("ddp", 100, 800), _run("fsdp", 94, 500)), {"ddp": 0.03, "fsdp": 0.02}, "cuda")
    assert rec["no_clear_difference"] == []


def test_a_comparison_at_another_world_size_keeps_each_ranks_micro_batch():
    from shardscope import config
    from shardscope.analysis.recommend_scale import comparison_at

    c = config.load_preset("smoke", host=config.cpu_host())
    at8, notes = comparison_at(c, 8)
    assert (at8.world_size, at8.global_batch) == (8, c.global_batch * 8 // c.world_size)
    assert [r.name for r in at8.runs] == [r.name for r in c.runs] and "global_batch" in notes[0]
    assert comparison_at(c, c.world_size) == (c, [])


def test_the_a_a_control_widens_the_band_and_is_not_ranked():
    """Two identical comparisons on a shared machine ranked strategies differently: a gap is a verdict only outside
    how far the A/A control (the baseline again) moved, and the control itself is never a candidate."""
    runs = [_run("ddp", 10000, 800), _run("zero2", 9000, 500), _run("ddp.again", 8800, 800, control_of="ddp")]
    s = {**_summary(*runs), "noise": {"between": {"measured": True, "control": "ddp.again", "baseline": "ddp",
                                                  "steps": 10, "baseline_rate": 10000, "control_rate": 8800,
                                                  "moved": 10000 / 8800 - 1}}}
    rec = recommend.recommend(s, {"ddp": 0.01, "zero2": 0.01, "ddp.again": 0.01}, "cuda")
    assert "ddp.again" not in rec["runs"] and rec["no_clear_difference"] == ["ddp", "zero2"]
    line = next(x for x in rec["lines"] if x.startswith("zero2 vs ddp"))
    assert "throughput not distinguishable on this machine now (0.90x, band ±13.6%: A/A moved 13.6%)" in line, line
    assert rec["lines"][-1].startswith("A/A control, in wall-clock tokens/s: ddp run again moved 13.6%")
    # The same gap with a quiet control is a verdict, with its interval.
    s["noise"]["between"].update(control_rate=9900, moved=10000 / 9900 - 1)
    rec = recommend.recommend(s, {"ddp": 0.01, "zero2": 0.01, "ddp.again": 0.01}, "cuda")
    assert "costs 10.0% throughput (0.90x, 0.88x-0.92x with the noise)" in next(
        x for x in rec["lines"] if x.startswith("zero2 vs ddp"))


def test_runs_that_waited_for_cores_are_ranked_by_busy_cpu_time():
    """The issue's case: DDP's ranks waited for a core 62% of the time and 'gained 38%' in wall clock while every
    strategy's busy time was the same. On a contended CPU the ranking uses tokens per busy CPU second."""
    runs = [_run("ddp", 13800, 300, peak_mem_kind="process RSS"), _run("fsdp2", 10000, 300, peak_mem_kind="process RSS"),
            _run("ddp.again", 12000, 300, peak_mem_kind="process RSS", control_of="ddp")]
    s = {**_summary(*runs), "noise": {
        "between": {"measured": True, "control": "ddp.again", "baseline": "ddp", "steps": 10, "baseline_rate": 13800,
                    "control_rate": 12000, "moved": 0.15},
        "core_wait": {"ddp": 0.62, "fsdp2": 0.3, "ddp.again": 0.5}, "contended": ["ddp", "ddp.again", "fsdp2"],
        "busy_per_token": {"ddp": 1.35e-4, "fsdp2": 1.36e-4, "ddp.again": 1.37e-4}}}
    rec = recommend.recommend(s, {"ddp": 0.01, "fsdp2": 0.01, "ddp.again": 0.01}, "cpu")
    assert rec["ranked_by"] == "tokens per busy CPU second"
    assert rec["lines"][0].startswith("ranks waited for a core (ddp 62%, fsdp2 30% of the time")
    assert rec["no_clear_difference"] == ["ddp", "fsdp2"]
    versus = next(x for x in rec["lines"] if x.startswith("fsdp2 vs ddp"))
    assert "throughput per busy CPU second not distinguishable" in versus
    # the bracketed figures on the ratio's basis, not wall-clock tokens/s beside a busy-time ratio
    assert versus.endswith(f"({1 / 1.36e-4:,.0f} vs {1 / 1.35e-4:,.0f} tokens per busy CPU s)"), versus
    # without the A/A control there is nothing to test busy time against, and the reason says so (not "steps")
    alone = {**_summary(*runs[:2]), "noise": {**s["noise"], "between": {"measured": False, "why": "control = false"}}}
    rec = recommend.recommend(alone, {"ddp": 0.01, "fsdp2": 0.01}, "cpu")
    text = " ".join(rec["lines"])
    assert "busy CPU time per token is one figure per run, with no step-to-step spread, and no A/A control ran" in text
    assert "fewer than 4 timed steps" not in text


def test_the_verdict_rule():
    from shardscope.core.numbers import speed_verdict

    assert speed_verdict(80, 100, 0.01, 0.01, 0.3)["verdict"] == "tie"  # the A/A control moved 30%
    v = speed_verdict(80, 100, 0.01, 0.01, 0.05)
    assert v["verdict"] == "slower" and v["band"] == pytest.approx(1.05)
    assert v["interval"] == pytest.approx([0.8 / 1.05, 0.8 * 1.05])
    assert speed_verdict(130, 100, 0.2, 0.2, None)["verdict"] == "tie"  # the step spread alone: (1.2)(1.2) = 1.44
    assert speed_verdict(150, 100, 0.2, 0.2, None)["verdict"] == "faster"
    assert speed_verdict(150, 100, None, None, None)["verdict"] == "untested"
    assert speed_verdict(150, 100, None, 0.1, 0.6)["verdict"] == "tie"  # no step spread, a 60% A/A move


def test_a_run_that_never_started_does_not_change_the_ranking_basis():
    """A failed run with no start record names no device: the others' "cpu" stands (busy-time ranking stays on)."""
    from types import SimpleNamespace

    from shardscope.analysis.recommend import device_of

    started = SimpleNamespace(start={0: {"device": "cpu"}})
    never = SimpleNamespace(start={})
    assert device_of({"ddp": started, "zero2": never, "fsdp2": started}) == "cpu"
    assert device_of({"a": SimpleNamespace(start={0: {"device": "cuda:0"}}), "b": never}) == "cuda"
    assert device_of({"a": never}) == "unknown"


def test_the_a_a_figure_is_on_the_rankings_basis_said_once():
    """Ranked by busy CPU time per token, the A/A line gives the control's move on that basis, and says so."""
    from shardscope.analysis import noise

    n = {"between": {"measured": True, "control": "ddp.again", "baseline": "ddp", "steps": 10,
                     "baseline_rate": 10000, "control_rate": 5000, "moved": 1.0},
         "busy_per_token": {"ddp": 1e-4, "ddp.again": 1.02e-4}}
    busy = noise.line(n, busy=True)
    assert busy.startswith("A/A control, in busy CPU time per token (the basis of the ranking): ddp run again "
                           "moved 2.0%"), busy
    assert "100.0%" not in busy  # the wall-clock move is not beside it
    assert noise.line(n).startswith("A/A control, in wall-clock tokens/s: ddp run again moved 100.0%")
