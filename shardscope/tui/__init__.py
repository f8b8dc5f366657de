"""The Textual app (room ``tui``). Only this package imports textual; nothing here imports torch.

Owns: the app (``app.build_app``; the command line and the tests both start it there), its screens
(presets, dashboard, report, explain, why) and widgets (run cards, charts, devices, communication, console,
rank timing), the board that folds updates for the screens.
May import: ``core``, ``presets``, ``config``, ``profiling``, ``analysis``, ``orchestrator``.
Imported by: ``cli`` only (lazily, to open the app).
"""
