"""The rank side (room ``engines``): what runs inside each torchrun rank.

Owns: the worker entry point (``worker``; ``rank`` for a rank torchrun forks), the torchrun agent started ahead of its run (``agent``), the model, data and precision, one module per strategy (``ddp``,
``fsdp1``, ``fsdp2``, ``handwritten_fsdp``, ``deepspeed_zero``, ``autotp``, ``fsdp2_tp``) with its explainer
template (``<module>.<function>.md``), the shared training loop (``loop``), step timing, collective counting,
profiler capture, the watchdog, the stall dump, the module probe, fault injection, the initial weights, the
user's module (``user_module``: the only place a user's code is imported) and the model check (``describe``, run
as a subprocess before the start: a user's model described with fake tensors).
May import: ``core``, ``presets``, ``config``; torch, DeepSpeed, transformers. Never ``profiling``,
``analysis``, ``orchestrator`` or ``tui``.
Imported by: nobody in the orchestrator's process: torchrun starts ``shardscope.engines.worker``, the
orchestrator ``python -m shardscope.engines.agent``;
``cli`` runs ``engines.traced_estimate`` only in a subprocess of ``estimate --traced``; ``core.model_check`` runs
``engines.describe`` only in a subprocess.
"""
