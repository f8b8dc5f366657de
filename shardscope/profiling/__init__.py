"""What measures (room ``profiling``).

Owns: the live fold of records into run states (``state``, with the per-rank ``stragglers`` watch and the
``loss_fold``), device sampling through NVML (``nvml``), reading profiler traces (``trace_reading``,
``collectives``, ``intervals``, ``traces``, ``trace_merge``, ``phases``), the memory model (``memory_model``,
``param_shapes``, ``estimate``, ``framework_fixes``) and the communication theory (``comm_theory``).
May import: ``core``, ``presets``, ``config``. Never torch (traces are JSON), textual or the rooms above.
Imported by: ``analysis``, ``orchestrator``, ``cli``, ``tui``.
"""
