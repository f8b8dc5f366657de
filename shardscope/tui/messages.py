"""Messages posted to the app. The source's threads post exactly one message per batch."""

from __future__ import annotations

from textual.message import Message

from shardscope.profiling.state import Update


class UpdatesArrived(Message):
    """A batch of updates from the source (posted from its background thread)."""

    def __init__(self, updates: list[Update]) -> None:
        super().__init__()
        self.updates = updates


class RunSelected(Message):
    """The user picked a run (a card was clicked)."""

    def __init__(self, run: str) -> None:
        super().__init__()
        self.run = run


class CommAnalysed(Message):
    """A run's traces were analysed (posted from a worker thread). ``seq`` orders the app's own analyses of
    one run: workers run side by side, and an older one finishing last must not replace a newer result."""

    def __init__(self, run: str, analysis: dict, seq: int | None = None) -> None:
        super().__init__()
        self.run = run
        self.analysis = analysis
        self.seq = seq
