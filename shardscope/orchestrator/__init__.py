"""Runs a comparison (room ``orchestrator``): the session, launching torchrun jobs and following them.

Owns: ``Session`` (launch, supervise, settle each run, write the reports), the launcher, agents started ahead
(``prestart``) and the lifeline (nothing
outlives the orchestrator), verdicts (root cause, kills, disks, exits, stalls), several nodes (heartbeats,
the record server), SLURM scripts, replaying a run directory, device logging, preflight (room, the run
directory's lock), why's re-runs.
May import: ``core``, ``presets``, ``config``, ``profiling``, ``analysis``. Never torch or textual.
Imported by: ``cli`` and ``tui``.
"""
