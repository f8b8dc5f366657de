"""The Textual app. Only this package imports textual; nothing here imports torch.

Start it with ``shardscope.tui.app.build_app`` (the command line and the tests both do).
"""
