"""``shardscope tune`` (issue 47): the search space, pruning by memory and by prediction, the budget, the winner's
preset, the refusals of bad input, and one search end to end on CPU."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardscope import config
from shardscope.analysis.tune import choose, space
from shardscope.config import ModelSpec, RunSpec
from shardscope.profiling import memory_model

MODEL = ModelSpec(vocab_size=128, d_model=32, n_layers=2, n_heads=4, d_ff=64, seq_len=16)


def _comparison(ws: int = 2) -> config.Comparison:
    c = config.Comparison(name="t", model=MODEL, runs=[RunSpec("ddp", "ddp")], world_size=ws, global_batch=8,
                          profile=config.ProfileSpec(enabled=False))
    return config.validate(c)


def test_the_space_varies_only_options_that_keep_the_mathematics():
    cands = space.candidates(_comparison(), world_size=2)
    names = [x.name for x in cands]
    assert len(names) == len(set(names))  # every candidate a distinct run name
    assert {"ddp", "ddp.ac", "fsdp2", "fsdp2.reshard-off"} <= set(names)
    for x in cands:
        assert set(x.run.options) <= set(space.SPEED_OPTIONS) | set(space.DEGREE_OPTIONS) | {"grad_accum"}, x.name
        assert not x.run.precision and not x.changes_math  # precision only with --allow precision
    refused = {x.name: x.refused for x in cands if x.refused}
    assert "supports hf" in refused["deepspeed-autotp"]  # the comparison's own check, its reason kept
    assert refused["pp-gpipe.ac"] == "activation_checkpointing = true: not built for pipeline stages"


def test_micro_batch_times_accumulation_keeps_the_global_batch_and_lowers_activation_memory():
    """grad_accum 2 and 4 for every strategy at the same global batch (8 sequences, dp 2): micro-batches of 2 and 1,
    each predicted to hold less activation memory than one micro-batch of 4; one the global batch cannot take (dp 2 x
    accum 8 > 8) is refused by the comparison's own check."""
    c = _comparison()
    by = {x.name: x for x in space.candidates(c, world_size=2, only=("ddp", "fsdp2"))}
    assert {"ddp.accum-2", "ddp.accum-4", "fsdp2.accum-4", "fsdp2.reshard-off.accum-2"} <= set(by)
    assert not any(by[n].refused for n in ("ddp.accum-2", "ddp.accum-4"))
    active = [memory_model.predict_run(c, dataclasses.replace(by[n].run))["activation_bytes"]
              for n in ("ddp", "ddp.accum-2", "ddp.accum-4")]
    assert active[0] > active[1] > active[2] > 0, active
    wide = dataclasses.replace(c, global_batch=4)
    refused = {x.name: x.refused for x in space.candidates(wide, world_size=2, only=("ddp",))}
    assert "must be divisible by dp (2) x grad_accum (4) (its options.grad_accum)" in refused["ddp.accum-4"]


def test_precision_joins_only_when_allowed_and_says_so():
    cands = space.candidates(_comparison(), world_size=2, allow=("precision",), only=("ddp",))
    changed = [x for x in cands if x.changes_math]
    assert changed and all(x.run.precision == "bf16-autocast" for x in changed)
    assert {x.run.strategy for x in cands} == {"ddp"}
    # the gradient reduction's dtype too (FSDP2's reduce_dtype), marked, and never without --allow precision
    allowed = space.candidates(_comparison(), world_size=2, allow=("precision",), only=("fsdp2",))
    bf16 = [x for x in allowed if x.run.options.get("reduce_dtype") == "bf16"]
    assert bf16 and all(x.changes_math and not x.refused for x in bf16)
    assert "fsdp2.reduce-bf16" in {x.name for x in bf16}
    assert not [x for x in space.candidates(_comparison(), world_size=2, only=("fsdp2",)) if "reduce_dtype" in x.run.options]
    with pytest.raises(KeyError, match="unknown strategy 'nope'"):
        space.candidates(_comparison(), world_size=2, only=("nope",))


def test_degrees_follow_the_world_size():
    cands = space.candidates(_comparison(4), world_size=4, only=("pp-1f1b", "fsdp2-tp"))
    pp = {x.run.options.get("pp", 2) for x in cands if x.run.strategy == "pp-1f1b" and not x.refused}
    tp = {x.run.options.get("tp", 2) for x in cands if x.run.strategy == "fsdp2-tp"}
    assert pp == {2, 4} and tp == {2, 4}


def test_memory_prunes_what_does_not_fit_with_both_figures():
    c = _comparison()
    cands = space.candidates(c, world_size=2, only=("ddp", "fsdp2"))
    ddp = memory_model.predict_run(c, RunSpec("ddp", "ddp", world_size=2))["total_bytes"]
    fsdp2 = memory_model.predict_run(c, RunSpec("fsdp2", "fsdp2", world_size=2))["total_bytes"]
    assert fsdp2 < ddp
    choose.prune_by_memory(c, cands, (ddp + fsdp2) // 2)
    by = {x.name: x for x in cands}
    assert by["ddp"].pruned.startswith("does not fit: ") and "per rank predicted >" in by["ddp"].pruned
    assert not by["fsdp2"].pruned and by["fsdp2"].predicted_mem_bytes == fsdp2


def test_prediction_keeps_the_band_of_the_best_and_the_budget_stops_the_rest():
    c = _comparison()
    cands = space.candidates(c, world_size=2, only=("ddp",))
    steps = {"ddp": 0.010, "ddp.ac": 0.013, "ddp.bucket-100": 0.0105, "ddp.bucket-100.ac": 0.020}
    choose.prune_by_prediction(cands, {n: {"step_time_s": t} for n, t in steps.items()}, 0.4)
    by = {x.name: x for x in cands}
    assert by["ddp.bucket-100.ac"].pruned.startswith("predicted 2.00x slower than the best")
    assert not by["ddp"].pruned and not by["ddp.ac"].pruned
    chosen = choose.within_budget(cands, budget_s=25.0, startup_s=10.0, steps=10, fallback_step_s=0.1)
    assert [x.name for x in chosen] == ["ddp", "ddp.bucket-100"]  # 10.1 s each: a third would pass 25 s
    assert by["ddp.ac"].pruned.startswith("over the budget")
    one = space.candidates(c, world_size=2, only=("ddp",))
    choose.prune_by_prediction(one, {}, 0.4)  # nothing predicted: nothing pruned by prediction
    assert not any(x.pruned for x in one)


def test_the_winners_preset_reproduces_it(tmp_path):
    c = config.load_preset("smoke")
    winner = next(x for x in space.candidates(c, world_size=2, only=("fsdp2",)) if x.run.options)
    path = tmp_path / "winner.toml"
    path.write_text(choose.winner_toml(c, winner, "smoke"), encoding="utf-8")
    again = config.load_preset(str(path))
    run = again.runs[0]
    assert (run.strategy, run.options, run.world_size) == (winner.run.strategy, winner.run.options, 2)
    for key in ("steps", "global_batch", "lr", "seed", "precision", "weight_decay", "grad_clip", "warmup_steps"):
        assert getattr(again, key) == getattr(c, key), key
    assert again.model == c.model and again.data == c.data


@pytest.mark.parametrize("args, message", [
    (["--budget", "soon"], "--budget 'soon': expected a duration"),
    (["--steps", "2"], "--steps 2: at least 3"),
    (["--strategies", "ddp,nope"], "--strategies ddp,nope: unknown strategy 'nope'"),
    (["--keep-within", "0"], "--keep-within 0.0: a fraction between 0 and 10"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "tune", "--preset", "smoke", "--out",
                           str(tmp_path / "t"), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_a_search_end_to_end(tmp_path):
    """Two strategies' candidates, a memory limit that leaves DDP out: the winner fits, every candidate says what
    happened to it, the winner's preset is written and loads, and the proving runs report their time."""
    c = config.load_preset("smoke")
    limit = (memory_model.predict_run(c, RunSpec("ddp", "ddp", world_size=2))["total_bytes"]
             + memory_model.predict_run(c, RunSpec("fsdp2", "fsdp2", world_size=2))["total_bytes"]) // 2
    out = tmp_path / "t"
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "tune", "--preset", "smoke", "--strategies",
                           "ddp,fsdp2", "--device-memory", str(limit), "--budget", "60s", "--steps", "4", "--out",
                           str(out), "--json", "--rounds", "1"],  # rounds: their own test below
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    answer = json.loads(proc.stdout[proc.stdout.rindex("\n{\n") + 1:])  # after the runs' progress
    by = {x["name"]: x for x in answer["candidates"]}
    assert by["ddp"]["pruned"].startswith("does not fit")
    assert all(x["refused"] or x["pruned"] or x["measured"] for x in by.values())
    winner = by[answer["winner"]]
    assert winner["measured"]["status"] == "ok" and winner["predicted_mem_bytes"] <= limit
    again = config.load_preset(answer["preset"])
    assert again.runs[0].strategy == winner["strategy"] and again.runs[0].options == winner["options"]
    assert answer["launch"] == f"shardscope run --preset {answer['preset']} --headless"
    assert answer["proof_s"] > 0 and answer["budget_s"] == 60
    assert (Path(out) / "proof" / "summary.json").exists()
    report = (Path(out) / "tune.md").read_text(encoding="utf-8")
    assert f"**Winner: {answer['winner']}**" in report and "does not fit" in report
    # the proving comparison's own report.md shows the search it proved (and keeps it when rebuilt)
    proof_report = (Path(out) / "proof" / "report.md").read_text(encoding="utf-8")
    assert "## The search this comparison proved (shardscope tune)" in proof_report
    assert f"**Winner: {answer['winner']}**" in proof_report and "does not fit" in proof_report


def test_a_what_if_on_a_gpu_this_machine_is_not_is_predicted_on_every_line_and_runs_nothing(tmp_path):
    """``--device H100 -n 8`` on a CPU machine: the preset as it loads on GPUs, every candidate predicted (memory
    against the datasheet's 80 GB, step time from the device table), none run; the winner's preset says it was
    predicted and loads; an unknown device is one line and exit 2."""
    out = tmp_path / "t"
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "tune", "--preset", "smoke", "--device", "H100",
                           "-n", "8", "--strategies", "ddp,fsdp2,pp-1f1b", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("WHAT-IF on 8 x H100") and "predicted only, nothing runs" in lines[0]
    rows = [x for x in lines if x.startswith("  ") and not x.startswith("  preset") and not x.startswith("  launch")
            and not x.startswith("  report")]
    assert rows and all(x.startswith("  predicted ") for x in rows)
    assert any("WINNER (predicted)" in x for x in rows)
    assert not (out / "proof").exists() and not (out / "calibration").exists()  # nothing ran
    again = config.load_preset(str(out / "winner.toml"), host=config.HostInfo("cuda", 8, "test"))
    assert "predicted fastest on H100 (a what-if, not measured)" in again.description
    assert again.world_size == 8 and again.runs[0].strategy in ("ddp", "fsdp2", "pp-1f1b")
    assert "WHAT-IF on H100" in (out / "tune.md").read_text(encoding="utf-8")
    bad = subprocess.run([sys.executable, "-m", "shardscope.cli", "tune", "--preset", "smoke", "--device", "TPU"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip() == "shardscope: error: --device 'TPU': known: A100, H100, H200, B200"


@pytest.mark.slow
def test_a_planted_slow_option_is_excluded_by_measurement(tmp_path):
    """Two candidates the predictor cannot tell apart (DDP with two bucket sizes: the same calls, the same bytes), the
    second carrying 40 ms of extra CPU work a step on rank 0 (the ``slow`` fault, real work): tune's own proving
    comparison and verdict pick the first, and the planted one is not called a tie."""
    from shardscope.cli.headless_run import load_summary, run_headless
    from shardscope.orchestrator.session import Session

    c = config.load_preset("smoke", host=config.cpu_host())
    live = [x for x in space.candidates(c, world_size=2, only=("ddp",)) if not x.refused
            and not x.run.activation_checkpointing]
    good, planted = live[0], next(x for x in live if x.run.options == {"bucket_cap_mb": 100})
    planted.run = dataclasses.replace(planted.run, fault="rank=0,step=0,kind=slow,ms=40")
    for x in (good, planted):
        x.predicted_step_s = 0.01  # predicted alike: only the measurement can tell them apart
    proof = config.with_control(config.validate(choose.proving_comparison(c, [good, planted], steps=8)))
    assert proof.baseline == good.name
    run_headless(Session(proof, str(tmp_path / "proof"), device="cpu"))
    answer = choose.verdict(load_summary(str(tmp_path / "proof")) or {}, [good, planted])
    assert answer["winner"] == good.name, answer
    assert planted.name not in answer["tie"] and planted.measured["status"] == "ok"


@pytest.mark.slow
def test_a_spent_budget_stops_what_still_runs_and_the_summary_says_so(tmp_path):
    """The budget is kept by the clock, not only by the estimate: at the deadline (here one already passed, so
    nothing depends on timing) every run still going or queued is stopped, and the summary is written from what
    ran."""
    from shardscope.cli.headless_run import load_summary, run_headless
    from shardscope.orchestrator.session import Session
    import time

    c = config.load_preset("smoke", host=config.cpu_host(), overrides=["steps=200", "control=false"])
    code = run_headless(Session(c, str(tmp_path / "proof"), device="cpu"), deadline=time.monotonic())
    summary = load_summary(str(tmp_path / "proof"))
    assert summary is not None and code != 0
    assert {r["status"] for r in summary["runs"]} == {"stopped"}, [(r["name"], r["status"]) for r in summary["runs"]]


@pytest.mark.slow
def test_the_app_shows_a_search_live_and_its_answer(tmp_path):
    """Key u on the preset screen opens the tune screen (escape stops it); a search there lists the candidates with
    what happened to each, marks the proving runs as they start and end, and ends with the winner, its preset and
    launch line, the same search as the command line's (analysis/tune/search)."""
    import asyncio

    from shardscope.tui.app import build_app
    from shardscope.tui.screens.presets import PresetsScreen
    from shardscope.tui.screens.tune import TuneScreen
    from test_tui_app import wait_for

    async def go() -> None:
        app = build_app(preset="smoke", host=config.cpu_host())
        async with app.run_test(size=(160, 48)) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, PresetsScreen) and app.screen.comparison is not None)
            await pilot.press("u")
            await wait_for(pilot, lambda: isinstance(app.screen, TuneScreen))
            await pilot.press("escape")  # stops what it started
            await wait_for(pilot, lambda: isinstance(app.screen, PresetsScreen))
            c = app.screen.comparison
            screen = TuneScreen(c, str(tmp_path / "t"), budget_s=120, steps=4, only=("ddp", "fsdp2"),
                                max_rounds=1)
            app.push_screen(screen)
            await wait_for(pilot, lambda: bool(screen.lines) and not screen.running, 600)
            answer = screen.answer
            assert answer and answer["winner"], screen.lines
            table = screen.query_one("#tune-table")
            outcomes = {str(table.get_row(key)[0]): str(table.get_row(key)[4]) for key in table.rows}
            assert outcomes[answer["winner"]].startswith("WINNER")
            assert any(o.startswith("measured") or o.startswith("predicted") or o.startswith("over the budget")
                       for n, o in outcomes.items() if n != answer["winner"]), outcomes
            assert (answer["winner"], "ok") in screen.statuses and any(s == "starting" for _, s in screen.statuses)
            assert any(line.startswith("tune 3/3: measuring") for line in screen.lines)
            assert config.load_preset(answer["preset"]).runs[0].name == answer["winner"]
            await pilot.press("escape")

    asyncio.run(go())


def test_the_presets_own_runs_are_measured_whatever_their_prediction():
    """The winner is measured against the preset's own runs: the candidates that are those runs (options with their
    defaults spelled or not) are kept even when predicted slow, and go first within the budget; a run whose options
    are outside the space is named."""
    c = _comparison()
    c = config.validate(dataclasses.replace(c, runs=[RunSpec("ddp", "ddp"), RunSpec("f", "fsdp2", options={
        "reshard_after_forward": True}), RunSpec("odd", "ddp", options={"bucket_cap_mb": 7})], baseline="ddp"))
    cands = space.candidates(c, world_size=2, only=("ddp", "fsdp2"))
    steps = {x.name: 0.010 for x in cands if not x.refused}
    steps["fsdp2"] = 0.050  # predicted 5x slower: pruned, unless it is the preset's
    choose.prune_by_prediction(cands, {n: {"step_time_s": t} for n, t in steps.items()}, 0.4)
    missing = choose.mark_presets_runs(c, cands)
    by = {x.name: x for x in cands}
    assert (by["ddp"].of_preset, by["fsdp2"].of_preset) == ("ddp", "f") and not by["fsdp2"].pruned
    assert missing == ["odd: its options are outside the search"]
    chosen = choose.within_budget(cands, budget_s=25.0, startup_s=10.0, steps=10, fallback_step_s=0.1)
    assert [x.name for x in chosen] == ["ddp", "fsdp2"]  # the references first; a third would pass 25 s
    by["fsdp2"].measured, by["ddp"].measured = {"status": "ok"}, {"status": "ok"}
    assert "no configuration searched was faster" in choose.against_preset(cands, {"winner": "ddp", "tie": []})
    assert "not distinguishable from the preset's own run(s) f" in choose.against_preset(
        cands, {"winner": "ddp.ac", "tie": ["fsdp2"]})


@pytest.mark.parametrize("text", ['{"answer": {}, "candidates": [{"name": 3}]}', "[1, 2", '{"answer": [], "candidates": []}',
                                  '{"answer": {"winner": "x"}, "candidates": [{"name": "x", "strategy": "ddp", '
                                  '"predicted_step_s": "fast"}]}'])
def test_a_crafted_tune_json_is_one_line_in_the_report_never_a_crash(tmp_path, text):
    (tmp_path / "tune.json").write_text(text, encoding="utf-8")
    section = choose.report_section(str(tmp_path))
    assert section.startswith("## The search this comparison proved") and "unreadable (" in section
    assert choose.report_section(str(tmp_path / "none")) == ""


def _round(baseline: str, verdicts: dict[str, tuple[float, float]], order: list[str]) -> dict:
    """A proving round's summary as rounds.combine reads it: each run's verdict (ratio, band) against ``baseline``."""
    runs = {baseline: {"status": "ok"}}
    runs.update({n: {"status": "ok", "verdict": {"ratio": r, "band": b}} for n, (r, b) in verdicts.items()})
    return {"baseline": baseline, "recommendation": {"runs": runs}, "order": order}


def test_rounds_pool_a_lead_that_holds_and_call_a_flip_a_tie():
    """A lead that every round confirms beyond its own noise stays a winner; a lead that the second round reverses
    is a tie; ratios are pooled against the first round's winner whatever each round's baseline."""
    from shardscope.analysis.tune import rounds

    cands = [space.Candidate(RunSpec(n, "ddp")) for n in ("a", "b", "c")]
    # round 1's baseline is c (the preset's run), a won; round 2 runs a (its baseline) and b, reversed
    first = _round("c", {"a": (1.5, 1.05), "b": (1.2, 1.05)}, ["c", "a", "b"])
    held = _round("a", {"b": (0.7, 1.1)}, ["b", "a"])
    answer = rounds.combine([first, held], "a", cands)
    assert answer["winner"] == "a" and answer["tie"] == [], answer
    assert answer["pooled"]["b"] == pytest.approx((1.2 / 1.5 + 0.7) / 2)
    assert cands[1].measured["rounds"] == [pytest.approx(0.8), 0.7]
    assert "measured in 2 rounds" in answer["lines"][0] and "(a b / b a)" in answer["lines"][0]
    flipped = _round("a", {"b": (1.3, 1.1)}, ["b", "a"])
    answer = rounds.combine([first, flipped], "a", cands)
    assert answer["winner"] == "b" and answer["tie"] == ["a"], answer  # 0.8 then 1.3: no round-proof lead either way
    # within a round's noise (band 1.3 > 1 / 0.8) is never "beaten"
    noisy = _round("a", {"b": (0.8, 1.3)}, ["b", "a"])
    assert rounds.combine([first, noisy], "a", cands)["tie"] == ["b"]


def test_the_next_round_runs_the_tie_else_the_runner_up_beside_the_presets_runs():
    from shardscope.analysis.tune import rounds

    cands = [space.Candidate(RunSpec(n, "ddp")) for n in ("a", "b", "c", "d")]
    cands[3].of_preset = "ddp"
    summary = {"runs": [{"name": n, "status": "ok", "median_tokens_per_s": r}
                        for n, r in (("a", 100), ("b", 90), ("c", 95), ("d", 50), ("a.again", 99))]}
    assert rounds.contenders(cands, {"winner": "a", "tie": ["b"]}, summary) == ["a", "b", "d"]
    assert rounds.contenders(cands, {"winner": "a", "tie": []}, summary) == ["a", "c", "d"]  # the runner-up
    assert rounds.contenders(cands, {"winner": None, "tie": []}, summary) == []


@pytest.mark.slow
def test_the_proof_is_measured_again_in_reversed_order_and_the_winner_comes_with_its_settings(tmp_path):
    """The preset's two runs are always measured, so round 1 has at least two; a budget far above what 5-step runs
    cost leaves room for round 2, which runs the winner beside its tie or runner-up in the reversed order with its
    own A/A control; the answer pools both rounds, and carries the winner's settings as its rank 0 wrote them."""
    import ast

    out = tmp_path / "t"
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "tune", "--preset", "smoke", "--strategies",
                           "ddp,fsdp2", "--keep-within", "0.0001", "--budget", "600s", "--steps", "5", "--rounds", "2",
                           "--out", str(out), "--json"], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    answer = json.loads(proc.stdout[proc.stdout.rindex("\n{\n") + 1:])
    assert answer["round_dirs"] == [str(out / "proof-2")], answer["lines"]
    second = json.loads((out / "proof-2" / "summary.json").read_text(encoding="utf-8"))
    first = json.loads((out / "proof" / "summary.json").read_text(encoding="utf-8"))
    ran = lambda s: [r["name"] for r in s["runs"] if not r.get("control_of")]  # noqa: E731
    # the contenders in round 1's order reversed; round 1's winner is round 2's reference (its baseline)
    assert len(ran(second)) >= 2 and ran(second) == [n for n in ran(first) if n in ran(second)][::-1]
    assert second["baseline"] == first["recommendation"]["fastest"]
    assert any(r.get("control_of") for r in second["runs"])  # its own A/A control
    assert answer["lines"][0].startswith("measured in 2 rounds")
    by = {x["name"]: x for x in answer["candidates"]}
    assert len(by[answer["winner"]]["measured"]["rounds"]) == 2
    code = answer["settings"]["code"]
    ast.parse(code)
    assert ("fully_shard(" if by[answer["winner"]]["strategy"] == "fsdp2" else "DistributedDataParallel(") in code
