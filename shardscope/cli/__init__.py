"""The command line and its terminal views (room ``cli``).

Owns: the ``shardscope`` command (``main``: the app, ``run``, ``open``, ``report``, ``presets``, ``diff``,
``estimate``, ``slurm``, ``explain``, ``recommend``, ``predict``, ``why``, ``tune``, ``records-secret``), the headless live
table and final tables, and the rich views of diff, explain, recommend, predict and why.
May import: every other room (``tui`` only lazily, to open the app). Never torch at import.
Imported by: nobody but the entry points (``shardscope = shardscope.cli:main``, ``python -m shardscope``,
``python -m shardscope.cli``).
"""

from shardscope.cli.main import main

__all__ = ["main"]
