"""What reads a comparison's records and writes for people (room ``analysis``).

Owns: replaying run directories (``fold``), summary.json and report.md (``summary``, ``report``), the PNGs
(``plots``), ``diff``, the recommendation, the strategy explainers, the divergence locator and root cause,
the straggler report, ``why`` (controlled re-runs: the plan, the variants and the verdict) and ``predict``
(the machine model fitted on a comparison and the per-strategy schedules).
May import: ``core``, ``presets``, ``config`` and ``profiling`` (what measures). Never torch, textual, the
orchestrator or the engines.
Imported by: ``orchestrator`` (the session writes the reports), ``cli`` and ``tui``.
"""
