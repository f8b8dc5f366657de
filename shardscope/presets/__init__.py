"""Presets (room ``presets``, the schema layer with ``core`` and ``config``): the built-in TOML files and the
dataclasses, overrides and checks that turn one into a validated ``Comparison``.

Owns: ``schema`` (dataclasses, allowed values), ``files`` (reading a preset safely), ``overrides`` (``--set``),
``checks`` (validation, host and layout checks), ``inputs`` (the user's model and data, described and checked
before the start; the runs a strategy cannot run left out with the reason).
May import: ``core``. ``config`` (the root facade) loads presets through it.
Imported by: ``config`` and, for the dataclasses, every room.
"""
