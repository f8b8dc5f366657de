"""``shardscope why DIR RUN`` (room ``analysis.why``): why a run's loss leaves the baseline's, proven by controlled
re-runs.

Owns: ``verdict`` (the plan read from a finished comparison, the gaps each re-run measured, the cause named, the
report section), ``variants`` (the suspects of a run: one variant per setting moved back towards the baseline) and
``probe`` (module by module, where two re-runs' module probes first differ).
May import: ``core``, ``presets``, ``config``, ``profiling`` and ``analysis.fold``. Never torch, textual or the
orchestrator (``orchestrator/why_runs.py`` runs the re-runs).
Imported by: ``analysis.report``, ``orchestrator.why_runs``, ``cli`` (why) and ``tui`` (the why screen).
"""
