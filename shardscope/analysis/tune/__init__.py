"""``shardscope tune`` (room ``analysis.tune``): the fastest configuration that fits, searched by prediction and
proven by real runs.

Owns: ``space`` (the candidates: every registered strategy that can run the comparison's model, crossed with the
options that change speed or memory but not the mathematics), ``choose`` (pruning by the memory model and the
predictor, the verdict from the proving comparison's own noise rule, the winner as a preset), ``search`` (one whole
search: calibration, pruning, proof within the budget, the answer; the comparisons run by the caller's runner).
May import: ``core``, ``presets``, ``config``, ``profiling``, ``analysis.predict``. Never torch, textual or the
orchestrator (``cli/tune.py`` and the app's tune screen run the comparisons).
Imported by: ``cli.tune``, ``tui.screens.tune``, ``analysis.markdown`` (``choose.report_section``: the proving
comparison's report.md shows the search it proved).
"""
