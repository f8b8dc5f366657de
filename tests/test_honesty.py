"""Nothing invented: non-finite losses are differences and end a run `diverged`, figures that were
not measured say so, headers carry units, tiny numbers print in scientific notation, and preset
files that cannot be read fail in one line."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from shardscope import config
from shardscope.core import events, numbers
from shardscope.config import ConfigError, HostInfo
from shardscope.analysis import fold
from shardscope.profiling import state
from shardscope.analysis import markdown, report, summary

HOST = HostInfo("cpu", 4, "2 CPU cores", True)
CLI = [sys.executable, "-m", "shardscope.cli"]


def _state(name, losses, **kw):
    st = state.RunState(name=name, status=kw.pop("status", state.OK), **kw)
    for step, loss in enumerate(losses):
        st.apply_record({"kind": "step", "rank": 0, "step": step, "loss": loss, "grad_norm": 1.0, "tokens": 64,
                         "tokens_per_s": 100.0, "t": float(step)})
    return st


# --- numbers ---------------------------------------------------------------------------------------


def test_tiny_differences_print_in_scientific_notation():
    assert numbers.fmt_sig(1.1920929e-7) == "1.19e-07"
    assert numbers.fmt_sig(-2.5e-5) == "-2.50e-05"
    assert numbers.fmt_sig(0.25) == "0.25" and numbers.fmt_sig(3.14159) == "3.14"
    assert numbers.fmt_sig(0) == "0" and numbers.fmt_sig(None) == "-"
    assert numbers.fmt_sig(float("nan")) == "nan" and numbers.fmt_sig(float("inf")) == "inf"
    assert numbers.fmt_sig(2.5e7) == "2.50e+07"


def test_summary_json_is_strict_and_keeps_nonfinite(tmp_path):
    data = {"a": float("nan"), "b": [float("inf"), 1.5, None], "c": {"d": float("-inf")}, "e": "x"}
    path = tmp_path / "s.json"
    config.dump_json(path, data)

    def refuse(name):
        raise AssertionError(f"bare {name} in JSON")

    raw = json.loads(path.read_text(), parse_constant=refuse)
    assert raw["a"] == "NaN" and raw["b"][0] == "Infinity" and raw["c"]["d"] == "-Infinity"
    back = numbers.read_json(str(path))
    assert math.isnan(back["a"]) and back["b"] == [math.inf, 1.5, None] and back["c"]["d"] == -math.inf
    assert back["e"] == "x"


def test_a_failed_json_write_leaves_no_partial_file(tmp_path):
    """The write fails at the rename (the target is a folder, as a full disk fails the write): no .tmp left."""
    target = tmp_path / "summary.json"
    target.mkdir()
    with pytest.raises(OSError):
        config.dump_json(target, {"a": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


# --- NaN-aware loss statistics and the diverged status ----------------------------------------------


def test_nan_on_either_side_is_never_equal():
    nan = float("nan")
    base = _state("ddp", [5.0, nan, nan])
    run = _state("fsdp2", [5.0, nan, nan])
    max_diff, mean_diff, common = summary.loss_diffs(run, base)
    assert common == 3 and max_diff == math.inf and mean_diff == math.inf  # not 0.00e+00
    assert summary.loss_diffs(_state("x", [5.0, 4.0]), _state("y", [5.0, nan]))[0] == math.inf
    stats = summary.loss_stats(run, base)
    assert stats["nonfinite_losses"] == 2 and stats["min_loss"] == 5.0 and stats["loss_final_abs_diff"] == math.inf
    finite = summary.loss_diffs(_state("a", [5.0, 4.0]), _state("b", [5.0, 4.5]))
    assert finite == (0.5, 0.25, 2)


def test_fold_records_first_nonfinite_step_but_not_fp16_skips():
    st = state.RunState(name="r")
    records = [{"step": 0, "loss": 5.0, "grad_norm": 1.0},
               {"step": 1, "loss": 4.0, "grad_norm": float("inf"), "skipped": True},  # fp16 overflow: skipped
               {"step": 2, "loss": 3.0, "grad_norm": float("inf")},
               {"step": 3, "loss": float("nan"), "grad_norm": float("nan")}]
    for r in records:
        st.apply_record({"kind": "step", "rank": 0, **r})
    assert st.first_nonfinite_step == 2 and st.nonfinite_what == "grad_norm"
    assert st.divergence == "non-finite grad_norm at step 2"


def test_skipped_step_with_a_nan_loss_is_divergence():
    # a loss scaler's skip excuses the gradients' overflow, not a NaN loss (DeepSpeed skips those in fp32 too)
    assert events.nonfinite_fields({"loss": 4.0, "grad_norm": float("inf"), "skipped": True}) == ""
    assert events.nonfinite_fields({"loss": float("nan"), "grad_norm": float("inf"), "skipped": True}) == "loss"
    assert events.nonfinite_fields({"loss": 4.0, "grad_norm": None}) == ""  # a norm not measured is no sign


def test_replay_reads_diverged_from_end_records(tmp_path):
    c = config.load_preset("smoke", ["steps=4"], host=HOST)
    out = tmp_path / "cmp"
    out.mkdir()
    config.dump_json(out / "comparison.json", c.to_dict())
    for name in ("ddp", "fsdp2"):
        for rank in (0, 1):
            with events.RecordWriter(out / name / "metrics" / f"rank{rank}.jsonl", name, rank) as w:
                w.write("step", step=0, loss=5.0, grad_norm=1.0, tokens=64, tokens_per_s=10.0)
                w.write("step", step=1, loss=float("nan"), grad_norm=float("nan"), tokens=64, tokens_per_s=10.0)
                w.write("end", status="diverged", steps_completed=2, first_nonfinite_step=1, nonfinite="loss")
    states = fold.replay_states(str(out))
    assert states["ddp"].status == state.DIVERGED and states["ddp"].first_nonfinite_step == 1
    s = summary.build_summary(c, states, str(out))
    entry = s["runs"][1]
    assert entry["status"] == "diverged" and entry["first_nonfinite_step"] == 1 and s["all_ok"] is False
    assert entry["loss_max_abs_diff"] == math.inf and entry["within_tolerance"] is False
    assert state.DIVERGED in state.FINISHED and state.DIVERGED in state.STATUS_STYLE


def test_on_nonfinite_is_validated():
    assert config.load_preset("smoke", ["on_nonfinite=continue"], host=HOST).on_nonfinite == "continue"
    with pytest.raises(ConfigError, match="on_nonfinite.*stop, continue"):
        config.load_preset("smoke", ["on_nonfinite=ignore"], host=HOST)


# --- units and "not measured" ------------------------------------------------------------------


def _vit_summary(tmp_path):
    c = config.load_preset("vit", [], host=HOST)
    states = {}
    for run in c.runs:
        st = state.RunState(name=run.name, strategy=run.strategy, world_size=2, status=state.OK)
        for step in range(3):
            st.apply_record({"kind": "step", "rank": 0, "step": step, "loss": 2.0, "samples": 8,
                             "samples_per_s": 40.0 + step, "t": float(step)})
        states[run.name] = st
    return c, states, summary.build_summary(c, states, str(tmp_path))


def test_vit_report_headers_say_samples_per_second(tmp_path):
    _, _, s = _vit_summary(tmp_path)
    assert summary.throughput_unit(s["runs"]) == "samples/s"
    text = report.render_markdown(s)
    assert "median samples/s" in text and "tok/s" not in text and "tokens/s" not in text
    from rich.console import Console

    from shardscope.cli.headless import comparison_table

    console = Console(width=240, record=True, file=open(os.devnull, "w"))
    console.print(comparison_table(s))
    table = console.export_text()
    assert "samples/s" in table and "tokens" not in table


def test_communication_not_measured_when_profiling_is_off(tmp_path):
    c, states, s = _vit_summary(tmp_path)
    c.profile.enabled = False
    comm = report.communication_section(c, states, str(tmp_path))
    for run in c.runs:
        assert comm["runs"][run.name]["not_measured"] == "profiling off: profile.enabled = false"
        assert "collectives" not in comm["runs"][run.name]
    text = markdown._comm_md(comm)
    assert text.count("not measured (profiling off") == len(c.runs)
    assert "0.00" not in text and "0.000" not in text


# --- preset files --------------------------------------------------------------------------------


def _cli(args, cwd=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(config.__file__)),
                                                      env.get("PYTHONPATH", "")]))
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=600, cwd=cwd, env=env)


def test_unreadable_presets_fail_in_one_line(tmp_path):
    garbage = tmp_path / "garbage.toml"
    garbage.write_bytes(bytes(range(256)) * 4)  # binary: NUL bytes
    latin = tmp_path / "latin1.toml"
    latin.write_bytes('description = "caf\xe9"\n'.encode("latin-1"))
    folder = tmp_path / "presets.toml"
    folder.mkdir()
    cases = {garbage: "binary file", latin: "not UTF-8 text (byte 0xe9 at offset 18)",
             folder: "is a directory, not a preset file"}
    for path, problem in cases.items():
        proc = _cli(["run", "--preset", str(path), "--dry-run", "--headless"])
        err = proc.stderr.strip()
        assert proc.returncode == 2, err
        assert len(err.splitlines()) == 1 and str(path) in err and problem in err, err
        assert "Traceback" not in proc.stderr + proc.stdout


def test_unreadable_file_is_named(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads files whatever their mode")
    secret = tmp_path / "secret.toml"
    secret.write_text("steps = 2\n")
    secret.chmod(0)
    with pytest.raises(ConfigError, match="secret.toml: cannot read: Permission denied"):
        config.load_preset(str(secret))


def test_folder_does_not_shadow_a_builtin_but_a_file_does(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smoke").mkdir()  # an earlier --out smoke
    assert config.preset_path("smoke") == config.PRESET_DIR / "smoke.toml"
    proc = _cli(["run", "--preset", "smoke", "--dry-run", "--headless"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    mine = (config.PRESET_DIR / "smoke.toml").read_text().replace("steps = 30", "steps = 3")
    (tmp_path / "smoke.toml").write_text(mine)  # a file of that name is the user's
    assert config.load_preset("smoke", host=HOST).steps == 3
    with pytest.raises(ConfigError, match="smoke/: is a directory"):
        config.preset_path("smoke/")


# --- a loss that blows up, through the real command line (torchrun, gloo, 2 ranks) ------------------


def _first_nonfinite(out, run):
    """First step where some rank's local loss or the global norm is inf/nan (the mean is then too), and
    the steps rank 0 logged."""
    by_rank = [[r for r in events.read_records(path)[0] if r["kind"] == "step"]
               for path in sorted((out / run / "metrics").glob("rank*.jsonl"))]
    bad = [rs[0]["step"] for rs in zip(*by_rank)
           if not all(math.isfinite(r["local_loss"]) and math.isfinite(r["grad_norm"]) for r in rs)]
    return (bad[0] if bad else None), [r["step"] for r in by_rank[0]]


@pytest.mark.slow
def test_nan_loss_marks_runs_diverged_and_stops_there(tmp_path):
    out = tmp_path / "nan"
    proc = _cli(["run", "--preset", "smoke", "--headless", "--out", str(out), "--set", "steps=6",
                 "--set", "lr=1e6", "--set", "profile.enabled=false"])
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    s = numbers.read_json(str(out / "summary.json"))
    for r in s["runs"]:
        first, logged = _first_nonfinite(out, r["name"])
        assert first is not None and first < 5, logged  # lr=1e6 blows up within a few steps
        assert r["status"] == "diverged" and r["first_nonfinite_step"] == first
        assert logged[-1] == first and r["steps_completed"] == first + 1  # stopped at that step, on every rank
        assert r["loss_max_abs_diff"] == math.inf and r["within_tolerance"] is False
        assert f"non-finite {r['nonfinite']} at step {first}" in proc.stdout
        rank1, _ = events.read_records(out / r["name"] / "metrics" / "rank1.jsonl")
        assert [e["status"] for e in rank1 if e["kind"] == "end"] == ["diverged"]
    assert "diverged" in proc.stdout and "0.00e+00" not in proc.stdout
    text = (out / "report.md").read_text()
    assert "| diverged |" in text and "**ddp diverged**" in text
    assert "not measured (profiling off" in text


@pytest.mark.slow
def test_on_nonfinite_continue_trains_to_the_end(tmp_path):
    preset = (config.PRESET_DIR / "smoke.toml").read_text()
    preset = preset[:preset.index("[[runs]]")] + '[[runs]]\nname = "ddp"\nstrategy = "ddp"\n'
    path = tmp_path / "one.toml"
    path.write_text(preset)
    out = tmp_path / "cont"
    proc = _cli(["run", "--preset", str(path), "--headless", "--out", str(out), "--set", "steps=5",
                 "--set", "lr=1e6", "--set", "profile.enabled=false", "--set", "on_nonfinite=continue"])
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = numbers.read_json(str(out / "summary.json"))["runs"][0]
    first, logged = _first_nonfinite(out, "ddp")
    assert run["status"] == "diverged" and run["first_nonfinite_step"] == first
    assert run["steps_completed"] == 5 and logged == [0, 1, 2, 3, 4]


def test_divergence_locator_names_the_first_nonfinite_layer():
    from shardscope.analysis import divergence

    nan, inf = float("nan"), float("inf")
    layers = {0: {"grad_norms": {"embed": 1.0, "blocks.0": 2.0, "blocks.1": 3.0}},
              1: {"grad_norms": {"embed": 1.0, "blocks.0": inf, "blocks.1": nan}}}
    assert divergence.first_nonfinite_layer(layers) == {"step": 1, "layer": "blocks.0", "norm": inf}
    assert divergence.first_nonfinite_layer({0: layers[0]}) is None
    base = [(0, 5.0), (1, nan)]
    entry = divergence.compare_runs(base, [(0, 5.0), (1, nan)], layers, layers, {}, {}, tolerance=1e-5,
                                    layer_rtol=1e-4)
    assert entry["first_loss_step"] == 1  # NaN vs NaN is a difference
    assert entry["first_grad_layer"]["step"] == 1 and entry["first_grad_layer"]["layer"] == "blocks.0"
    assert "first non-finite gradient at step 1 in blocks.0 (inf)" in entry["finding"]


def test_comm_report_says_why_theory_departs_and_never_prints_unmeasured_zeros():
    from shardscope.analysis.markdown import _comm_md

    run = {"collectives": {}, "per_step": {"step_time_s": 0.01, "compute_time_s": None},
           "comm_bytes_per_step": None,
           "theory": {"bytes_per_step": 2**20, "ratio": None, "basis": "b",
                      "reasons": ["the root unit stays gathered from forward to backward"]}}
    text = _comm_md({"runs": {"fsdp1": run}})
    assert "- fsdp1: the root unit stays gathered from forward to backward" in text
    row = next(line for line in text.splitlines() if line.startswith("| fsdp1 | 10.00"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:6] == ["fsdp1", "10.00", "-", "-", "-", "-"]  # not measured: "-", never 0
