"""Runs ``shardscope why``'s rounds as real comparisons and writes its result.

Each round is a comparison of its own under ``DIR/why/<run>/round<k>/`` (``analysis/why/variants.py`` builds
it), run by a ``Session`` like any other: round 1 holds the baseline and the run as they are (module probe on)
and one variant per suspect; round 2, only when no single change closes the gap, the baseline and pairs. The
rounds load ``DIR/init.safetensors`` (linked, else copied; without it the first run writes the same weights from
the seed) and the data stream is a pure function of (seed, step), so every re-run sees the original's weights and
tokens. The result goes to ``DIR/why/<run>/why.json`` and the comparison's report is written again, with a why
section. Used by the command line (``whyview.py``) and the app (key ``w``).
"""

from __future__ import annotations

import os
import shutil
import threading
from typing import Any, Callable

from shardscope import config
from shardscope.config import ConfigError, dump_json
from shardscope.orchestrator.preflight import claim_out_dir
from shardscope.presets import trust
from shardscope.profiling import state
from shardscope.analysis.why import verdict as why, variants as why_variants
from shardscope.analysis.why.verdict import Plan, WhyError
from shardscope.core.rundir import RunDir, read_json_or_none

Progress = Callable[[str], None]


def cached(plan: Plan) -> dict[str, Any] | None:
    """The result an earlier why of this run wrote, or None."""
    found = read_json_or_none(RunDir(plan.out_dir).why_result(plan.run))
    return found if isinstance(found, dict) and found.get("run") == plan.run else None


def describe_plan(plan: Plan) -> list[str]:
    """What the why will run and about how long it takes, one line each (printed before starting)."""
    if plan.within:
        return []
    est = plan.estimate
    lines = [f"{plan.run} vs {plan.baseline}: max |Δloss| {plan.original['max_abs']:.3g} > tolerance "
             f"{plan.tolerance:g}, first at step {plan.first_step}",
             f"round 1: {est['runs']} re-runs of {plan.steps} steps (same weights, tokens and world size): "
             f"{plan.baseline} and {plan.run} as they are (module probe on), then one change each:"]
    lines += [f"  {v.name}: {v.describe}" for v in plan.singles] or ["  (no setting differs from the baseline's: "
                                                                     "only the module comparison)"]
    n_pairs = len(why_variants.pairs(plan.singles, {}))
    if n_pairs:
        lines.append(f"round 2, only if no single change explains it: {plan.baseline} and up to {n_pairs} pairs")
    lines.append(f"estimate: about {est['seconds']:.0f} s for round 1 (from {est['basis']})")
    return lines


class WhyRunner:
    """One why, run to its result: ``run()`` blocks; ``stop()`` (any thread) stops the active round."""

    def __init__(self, plan: Plan, *, device: str | None = None, progress: Progress = lambda line: None) -> None:
        self.plan, self.progress = plan, progress
        self.device = device
        self._session: Any = None
        self._stopped = threading.Event()

    def stop(self) -> None:
        """Stop the round under way (its runs end ``stopped``) and start no other."""
        self._stopped.set()
        if self._session is not None:
            self._session.stop_all()

    def run(self, *, again: bool = False) -> dict[str, Any]:
        """Run the rounds and return the result (also written to why.json); an earlier result is returned as it
        is unless ``again``. Raises WhyError for a directory or device why cannot use (one line)."""
        plan = self.plan
        if plan.within:
            return why.nothing_to_explain(plan)
        out = RunDir(plan.out_dir)
        if not again and (earlier := cached(plan)) is not None:
            return {**earlier, "cached": True}
        refused = trust.refusal(plan.comparison)  # re-runs build the model: someone's code only when named again
        if refused:
            raise WhyError(refused)
        held = out.lock()  # the comparison's own lock: no other command writes it meanwhile
        if held:
            raise WhyError(held)
        if os.path.isdir(out.why_dir(plan.run)):
            shutil.rmtree(out.why_dir(plan.run))  # why's own files of an earlier why of this run
        device = self._device()
        gaps: dict[str, dict[str, Any]] = {}
        first = self._round(1, plan.singles, device, probe=True)
        gaps.update(why.measure(first, plan.baseline))
        rounds = [(first, plan.singles)]
        res = why.result(plan, rounds, gaps, why.module_finding(first, plan))
        pairs = why_variants.pairs(plan.singles, {v.name: gaps.get(v.name, {}).get("max_abs") or float("inf")
                                                  for v in plan.singles})
        if res["status"] == "not explained" and pairs and not self._stopped.is_set():
            self.progress("no single change explains it: trying pairs")
            second = self._round(2, pairs, device, probe=False)
            gaps.update({k: v for k, v in why.measure(second, plan.baseline).items() if k != plan.baseline})
            rounds.append((second, pairs))
            res = why.result(plan, rounds, gaps, res["module"])
        if self._stopped.is_set():  # not kept: the next why of this run starts afresh
            return {**res, "status": "stopped", "cause": None, "message": "stopped before every re-run finished"}
        dump_json(out.why_result(plan.run), res)
        self._refresh_report()
        return res

    def _device(self) -> str:
        if self.device:
            return self.device
        from shardscope.orchestrator.devices import resolve_device

        try:
            return resolve_device(self.plan.comparison.launch.device)
        except ConfigError as err:
            raise WhyError(f"the re-runs cannot run on this machine: {err}") from None

    def _round(self, k: int, variants: list[why_variants.Variant], device: str, *, probe: bool) -> str:
        """Run round ``k`` to its end; return its directory."""
        plan, c = self.plan, self.plan.comparison
        out = RunDir(plan.out_dir).why_round(plan.run, k)
        comparison = why_variants.round_comparison(
            c, c.run(plan.baseline), c.run(plan.run), variants, steps=plan.steps,
            probe_step=plan.first_step if probe else None, name=f"why-{plan.run}"[:60] + f"-r{k}")
        try:
            comparison = config.validate(comparison)
        except ConfigError as err:
            raise WhyError(f"round {k}: {err}") from None
        names = [r.name for r in comparison.runs]
        claimed = claim_out_dir(out, 0, names)
        if claimed:
            raise WhyError(claimed)
        self._share_init(out)
        from shardscope.orchestrator.session import Session

        session = Session(comparison, out, device=device, sample_devices=False)
        total = len(names)
        session.subscribe(lambda updates: self._on_updates(k, names, total, updates))
        self.progress(f"round {k}: {total} runs of {plan.steps} steps in {out}")
        self._session = session
        if self._stopped.is_set():
            session.stop_all()
        session.start()
        try:
            while session.wait(0.5) is None:
                pass
        except KeyboardInterrupt:  # the command line's Ctrl-C: stop the runs, keep what was written
            self.stop()
            session.wait(120)
            raise
        finally:
            self._session = None
        return out

    def _on_updates(self, k: int, names: list[str], total: int, updates: list[state.Update]) -> None:
        for u in updates:
            if isinstance(u, state.StatusChanged) and u.status in (state.STARTING, *state.FINISHED):
                what = u.status + (f": {u.error}" if u.error else "")
                self.progress(f"round {k}: {u.run} ({names.index(u.run) + 1}/{total}) {what}")

    def _share_init(self, round_dir: str) -> None:
        """The comparison's initial weights, for the round's runs to load (a link, else a copy)."""
        src, dst = RunDir(self.plan.out_dir).init_weights, RunDir(round_dir).init_weights
        if not os.path.exists(src):
            self.progress(f"{src} is missing: the first re-run writes the weights again from the seed")
            return
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)

    def _refresh_report(self) -> None:
        """The comparison's report again, so its report.md carries the why section."""
        from shardscope.analysis.report import write_reports

        done = write_reports(self.plan.out_dir)
        if getattr(done, "failed", ""):
            self.progress(f"report: {done.failed}")
