"""What every other room leans on (room ``core``, the schema layer with ``presets`` and ``config``).

Owns: the record format (``events``), the run directory's file names (``rundir``: the one module that spells
them), the strategy registry (``registry``: the one place strategy names live), the record wire over TCP and its
secret (``record_wire``), the shared numbers (``numbers``: medians, differences, byte formats), sizes,
Hugging Face architecture values, the world-size/batch rule (``batch_follow``), disk room (``outspace``),
liveness checks, which rank a process is (``rank_process``), console noise, what every room asks of a run's
model whatever its kind (``model_facts``), the model check's torch-free side (``model_check``: a subprocess) and
the user's token files (``token_files``).
May import: nothing of shardscope outside ``core``; no torch, no textual.
Imported by: every room.
"""
