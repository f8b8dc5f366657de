"""One search of ``shardscope tune``, whoever shows it: the command line (``cli/tune.py``) or the app's tune screen
(``tui/screens/tune.py``).

Three phases: (1) calibration — the predictor needs this machine's speed: finished comparisons given, else a short
run of the preset's baseline; (2) search — every candidate of ``space`` checked, pruned by the memory model and by
predicted step time (``choose``); (3) proof — the kept candidates run side by side as one real comparison (the same
model, data, weights, global batch; an A/A control), within the budget, which the clock keeps too. The answer is
that comparison's own verdict, with the winner written as a preset and the table as tune.md.

The comparisons are run by the caller's ``runner(comparison, out_dir, deadline)`` (this room never imports the
orchestrator); ``say(text)`` gets each phase's line and ``changed(cands)`` the candidates whenever what is known of
them changes (listed, pruned, predicted, being measured, measured).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from shardscope import config
from shardscope.analysis.tune import choose, rounds, space
from shardscope.analysis.tune.space import Candidate
from shardscope.core.rundir import RunDir, read_json_or_none

CALIBRATION_STEPS = 12
Runner = Callable[[config.Comparison, str, "float | None"], int]


@dataclass
class Request:
    """What to search: the comparison (its model, data, global batch), at ``world_size``, in ``out``."""

    comparison: config.Comparison
    world_size: int
    out: str
    budget_s: float = 600.0
    steps: int = 12
    keep_within: float = 0.4
    allow: tuple[str, ...] = ()
    only: tuple[str, ...] = ()
    device_memory: int | None = None
    calibrate_dirs: tuple[str, ...] = ()
    host: Any = None
    max_rounds: int = rounds.MAX_ROUNDS  # rounds of the proof at most (``rounds``): 1 measures each candidate once
    answer: dict[str, Any] = field(default_factory=dict)


class CannotCalibrate(Exception):
    """The calibration could not be read (one line)."""


def calibrate(req: Request, runner: Runner, say: Callable[[str], None]) -> list[str]:
    """The calibration directories: those given, else a short run of the baseline alone in ``out/calibration``."""
    if req.calibrate_dirs:
        return list(req.calibrate_dirs)
    c = req.comparison
    base = next(r for r in c.runs if r.name == c.baseline)
    cal = dataclasses.replace(c, name=f"{c.name}-calibration", runs=[base], baseline=base.name,
                              steps=CALIBRATION_STEPS, warmup_steps=min(c.warmup_steps, 3), control=False,
                              profile=dataclasses.replace(c.profile, enabled=True, start_step=6, steps=2))
    where = os.path.join(req.out, "calibration")
    say(f"tune 1/3: calibrating this machine: {base.name} alone, {CALIBRATION_STEPS} steps -> {where}")
    runner(config.validate(cal), where, None)
    return [where]


def search(req: Request, runner: Runner, say: Callable[[str], None],
           changed: Callable[[list[Candidate]], None] = lambda cands: None) -> tuple[list[Candidate], dict[str, Any]]:
    """Run the whole search; return every candidate and the answer (``choose.verdict``'s, with ``elapsed_s``,
    ``proof_s``, ``budget_s``, ``preset``, ``launch``, ``settings``, ``report``, ``proof_dir``, ``proof_baseline``). Raises
    CannotCalibrate."""
    from shardscope.analysis.predict import predictor
    from shardscope.analysis.predict.work import NotPredicted

    c, t0 = req.comparison, time.monotonic()
    dirs = calibrate(req, runner, say)
    calibration_s = time.monotonic() - t0 if not req.calibrate_dirs else None
    try:
        model = predictor.calibrate(dirs)
    except (NotPredicted, OSError, ValueError) as err:
        raise CannotCalibrate(f"cannot calibrate on {', '.join(dirs)}: {err}") from None
    cands = space.candidates(c, world_size=req.world_size, allow=req.allow, host=req.host, only=req.only)
    cut = (f" (the first {space.LIMIT}, defaults first: the space is larger; narrow it with --strategies)"
           if space.truncated(cands) else "")
    say(f"tune 2/3: {len(cands)} candidates at world size {req.world_size}{cut}; "
        f"{sum(1 for x in cands if x.refused)} cannot run here")
    choose.prune_by_memory(c, cands, req.device_memory)
    changed(cands)
    rows = {}
    predictor.read_grids_for((dataclasses.replace(c, runs=[x.run], baseline=x.name), x.run)
                             for x in cands if not x.refused and not x.pruned)
    for x in cands:
        if not x.refused and not x.pruned:
            rows[x.name] = predictor.predict_run(dataclasses.replace(c, runs=[x.run], baseline=x.name), x.run, model)
    choose.prune_by_prediction(cands, rows, req.keep_within)
    for line in choose.mark_presets_runs(c, cands):
        say(f"tune 2/3: the preset's run {line}: not measured beside the candidates")
    measured_steps = [v["measured_step_s"] for v in (model.fit_error.get("runs") or {}).values() if isinstance(v, dict)]
    fallback = max(measured_steps) if measured_steps else 0.1
    # A run's cost beyond its steps: what the calibration phase took in all (the session's set-up, the launch, the
    # agent, the report) less its steps: runs after the first start sooner (the next agent is prepared ahead), so
    # the budget is spent conservatively. A given calibration has no such figure: 10 s.
    startup = max(1.0, calibration_s - CALIBRATION_STEPS * fallback) if calibration_s else 10.0
    # the first round takes a share of the budget when more may follow, so the lead can be confirmed (rounds.py)
    first_share = rounds.FIRST_ROUND_SHARE if req.max_rounds > 1 else 1.0
    chosen = choose.within_budget(cands, req.budget_s * first_share, startup, req.steps, fallback,
                                  "the budget" if first_share == 1 else f"the first round's {first_share:.0%} of the budget")
    for x in chosen:
        x.measured = {"status": "queued"}  # what the screens show until the proof's summary says more
    changed(cands)
    say(f"tune 3/3: measuring {len(chosen)} candidate(s) side by side, {req.steps} steps each, about {startup:.0f} s "
        f"start-up per run, budget {req.budget_s:.0f} s: {', '.join(x.name for x in chosen)}")
    where = os.path.join(req.out, "proof")
    t1, baseline = time.monotonic(), ""
    if chosen:
        proof = config.with_control(config.validate(choose.proving_comparison(c, chosen, req.steps)))
        baseline = proof.baseline
        # the budget is kept by the clock too: what still runs when it is spent is stopped (the estimate can be short)
        runner(proof, where, t1 + req.budget_s)
    for x in chosen:
        x.measured = {}
    first = read_json_or_none(RunDir(where).summary) or {}
    answer = choose.verdict(first, cands)
    round_dirs = _repeat(req, runner, say, cands, answer, {**first, "order": [x.name for x in chosen]},
                         t1, startup, fallback) if chosen else []
    proof_s = time.monotonic() - t1
    answer.update(elapsed_s=time.monotonic() - t0, proof_s=proof_s, budget_s=req.budget_s, proof_dir=where,
                  proof_baseline=baseline, presets_runs={x.of_preset: x.name for x in cands if x.of_preset},
                  round_dirs=round_dirs)
    if proof_s >= req.budget_s:  # the clock stopped these, not a failure of theirs
        for x in cands:
            if x.measured.get("status") == "stopped" and not x.measured.get("error"):
                x.measured["error"] = "stopped when the budget was spent"
    answer["against_preset"] = choose.against_preset(cands, answer)
    _write_answer(req, cands, answer)
    changed(cands)
    return cands, answer


def _repeat(req: Request, runner: Runner, say: Callable[[str], None], cands: list[Candidate], answer: dict[str, Any],
            first: dict[str, Any], t1: float, startup: float, step_s: float) -> list[str]:
    """Further rounds of the proof while the noise rule needs them and the budget allows (``rounds``): the answer's
    winner, tie and lines become the rounds' pooled verdict. Returns the rounds' directories after the first."""
    reference, done, dirs = answer.get("winner"), [first], []
    by = {x.name: x for x in cands}
    while reference and len(done) < req.max_rounds and (len(done) == 1 or answer["tie"]):
        names = rounds.contenders(cands, answer, done[-1])
        cost = (len(names) + 1) * (startup + req.steps * step_s)  # the A/A control too
        if not names:
            break
        if time.monotonic() - t1 + cost > req.budget_s:
            say(f"tune 3/3: no further round: about {cost:.0f} s to measure {', '.join(names)} again, "
                f"{max(0.0, req.budget_s - (time.monotonic() - t1)):.0f} s of the budget left")
            break
        prev = list(done[-1].get("order") or [])  # the previous round's order, reversed: drift favours no one
        order = [n for n in prev if n in names][::-1] + [n for n in names if n not in prev]
        where = os.path.join(req.out, f"proof-{len(done) + 1}")
        say(f"tune 3/3: round {len(done) + 1} ({'to resolve a tie' if answer['tie'] else 'to confirm the lead'}): "
            f"{' '.join(order)}, {req.steps} steps each -> {where}")
        proof = dataclasses.replace(choose.proving_comparison(req.comparison, [by[n] for n in order], req.steps),
                                    baseline=reference)
        runner(config.with_control(config.validate(proof)), where, t1 + req.budget_s)
        done.append({**(read_json_or_none(RunDir(where).summary) or {}), "order": order})
        dirs.append(where)
        pooled = rounds.combine(done, reference, cands)
        answer.setdefault("first_round_lines", answer["lines"])
        answer.update(winner=pooled["winner"], tie=pooled["tie"], pooled=pooled["pooled"],
                      lines=pooled["lines"] + [f"first round: {line}" for line in answer["first_round_lines"]
                                               if " vs " not in line])
    return dirs


def _write_answer(req: Request, cands: list[Candidate], answer: dict[str, Any]) -> None:
    """The winner's preset, the launch line and its settings into ``answer``; tune.md beside them."""
    c = req.comparison
    winner = next((x for x in cands if x.name == answer["winner"]), None)
    if winner is not None:
        path = os.path.join(req.out, "winner.toml")
        config.write_atomic(path, lambda fh: fh.write(choose.winner_toml(c, winner, c.source or c.name)))
        answer["preset"] = path
        answer["launch"] = f"shardscope run --preset {shlex.quote(path)} --headless"  # pasted into a shell
        answer["settings"] = {"strategy": winner.run.strategy, "options": winner.run.options,
                              "activation_checkpointing": winner.run.activation_checkpointing,
                              "precision": winner.run.precision or c.precision,
                              "code": winner.measured.get("code")}  # written by its rank 0 (engines/settings_code)
    answer["report"] = os.path.join(req.out, "tune.md")
    config.write_atomic(answer["report"], lambda fh: fh.write(choose.markdown(cands, answer, c.name)))
    proof = RunDir(answer["proof_dir"])
    if os.path.isfile(proof.summary):  # the proving comparison's report.md gains the search's section
        from shardscope.analysis.report import write_reports

        config.dump_json(proof.tune_result, {"preset": c.name, "answer": answer,
                                             "candidates": [choose.as_dict(x) for x in cands]})
        write_reports(proof.path)
