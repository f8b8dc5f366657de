"""``shardscope predict`` (room ``analysis.predict``): a small model of a machine, fitted on a finished comparison,
and every run of a preset played out on it at any world size or on a GPU from the datasheet table.

Owns: ``predictor`` (a comparison's runs predicted: step time split into compute, exposed communication and the
rest, tokens/s, peak memory), ``work`` (what one optimizer step asks of a machine), ``schedule`` (a step played on
a compute thread and communication channels, per strategy), ``fit`` and ``comm_fit`` (the machine model and its
collectives), ``collectives`` (the collective calibration job), ``comm_cost`` and ``in_step`` (what real steps pay
for collectives on CPU), ``probe`` (each run's compute measured), ``devices`` (GPUs not owned) and ``report``
(summary.json's ``prediction`` section and report.md's "Predicted beside measured").
May import: ``core``, ``presets``, ``config``, ``profiling`` and ``analysis.fold``. Never torch (its measurements
run as subprocesses), textual or the orchestrator.
Imported by: ``analysis.report``, ``analysis.recommend_scale``, ``cli`` (predict, report, recommend) and ``tui``.
"""
