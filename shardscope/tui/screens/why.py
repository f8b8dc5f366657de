"""Why the selected run's loss differs from the baseline's (key ``w`` on the dashboard): ``shardscope why`` in the
app. The plan and its estimate first, a line per re-run as it starts and ends, then the result.

The re-runs are real comparisons (``orchestrator/why_runs.py``) driven from a worker thread, which only posts
messages; closing the screen stops them.
"""

from __future__ import annotations

from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message
from textual.widgets import Footer, Markdown, Static

from shardscope.core.text import clean
from shardscope.orchestrator.why_runs import WhyRunner, describe_plan
from shardscope.analysis.why import verdict as why
from shardscope.analysis.why.verdict import WhyError
from shardscope.tui.screens.dialogs import RunnerScreen
from shardscope.tui.format import literal


class WhyProgress(Message):
    """A line of progress from the re-runs (posted from their threads)."""

    def __init__(self, line: str) -> None:
        super().__init__()
        self.line = line


class WhyDone(Message):
    """The why ended: its result, or the one line saying why it could not run."""

    def __init__(self, result: dict[str, Any] | None, error: str = "") -> None:
        super().__init__()
        self.result, self.error = result, error


class WhyScreen(RunnerScreen):
    """Runs a why of ``run`` in ``out_dir`` and shows its progress, then its result; escape or q closes it (and
    stops re-runs still going)."""

    BINDINGS = [Binding("escape,q,w", "close", "Close")]
    stop_note = "Stopping the why re-runs…"

    def __init__(self, out_dir: str, run: str) -> None:
        super().__init__()
        self.out_dir, self.run_name = out_dir, run
        self.lines: list[str] = []
        self.result: dict[str, Any] | None = None
        self.error = ""

    def compose(self) -> ComposeResult:
        """The progress lines above the result's markdown, in a scroll view."""
        with VerticalScroll(id="why"):
            yield Static(f"why {literal(self.run_name)}: reading {literal(self.out_dir)}…", id="why-progress")
            yield Markdown("", id="why-result", open_links=False)  # a link in a result from the files opens nothing
        yield Footer()  # the keys, and the way back

    def on_mount(self) -> None:
        """Plan the why and start it on a worker thread (a plan that cannot be made is shown instead)."""
        try:
            plan = why.load_plan(self.out_dir, self.run_name)
        except WhyError as err:
            self._finish(None, str(err))
            return
        except (OSError, ValueError, TypeError, KeyError, AttributeError, IndexError) as err:  # a damaged file
            self._finish(None, f"unreadable: {type(err).__name__}: {err}")
            return
        self.lines = describe_plan(plan)
        self.runner = WhyRunner(plan, progress=lambda line: self.post_message(WhyProgress(line)))
        self.running = True
        self._show()
        self._run(self.runner)

    @work(thread=True, exclusive=True, group="why")
    def _run(self, runner: WhyRunner) -> None:
        try:
            self.post_message(WhyDone(runner.run()))
        except WhyError as err:
            self.post_message(WhyDone(None, str(err)))
        except Exception as err:  # noqa: BLE001 - shown in the screen, never lost in a thread
            self.post_message(WhyDone(None, f"why failed: {err!r}"))

    def on_why_progress(self, message: WhyProgress) -> None:
        """Add a progress line."""
        self.lines.append(message.line)
        self._show()

    def on_why_done(self, message: WhyDone) -> None:
        """Show the result (or why there is none)."""
        self._finish(message.result, message.error)

    def _finish(self, result: dict[str, Any] | None, error: str) -> None:
        self.running = False
        self.result, self.error = result, error
        if error:
            self.lines.append(f"cannot explain: {error}")
        self._show()
        if result is not None:
            self.query_one("#why-result", Markdown).update(clean(why.markdown(result)))  # markdown, controls spelled

    def _show(self) -> None:
        state = "re-running… (escape stops)" if self.running else "done"
        # progress lines name runs, settings and errors from the files: text, never markup
        self.query_one("#why-progress", Static).update(
            "\n".join(literal(line) for line in [f"why {self.run_name}: {state}", *self.lines]))
