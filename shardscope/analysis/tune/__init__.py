"""``shardscope tune`` (room ``analysis.tune``): the fastest configuration that fits, searched by prediction and
proven by real runs.

Owns: ``space`` (the candidates: every registered strategy that can run the comparison's model, crossed with the
options that change speed or memory but not the mathematics), ``choose`` (pruning by the memory model and the
predictor, the verdict from the proving comparison's own noise rule, the winner as a preset).
May import: ``core``, ``presets``, ``config``, ``profiling``, ``analysis.predict``. Never torch, textual or the
orchestrator (``cli/tune.py`` runs the proving comparison).
Imported by: ``cli.tune``.
"""
