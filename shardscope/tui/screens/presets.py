"""Choose a preset (built-in or a file), see its runs, edit common knobs, launch.

Every change re-validates through ``config.load_preset`` with ``--set``-style overrides; a
``ConfigError`` is shown next to the field it is about, never raised. A preset file is text from outside: its
names, description and values, and errors quoting them, are shown as text (``format.plain``/``literal``).
"""

from __future__ import annotations

import shlex

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, DataTable, Footer, Input, Label, OptionList, Select, Static
from textual.widgets.option_list import Option, OptionDoesNotExist

from shardscope.core import model_facts
from shardscope.config import Comparison, ConfigError, cpu_overrides, list_presets, load_preset, resolved_precision, \
    resolved_world_size
from shardscope.core.text import clean
from shardscope.tui.format import display_path, literal, plain
from shardscope.tui.screens.knobs import KNOBS, choices, current_value, overrides, route_error, without_source


WATCHABLE = "first-look"  # about a minute on 2 CPU cores: the default without a GPU, smoke, is over in seconds


def default_preset(host: object) -> str:
    """The preset highlighted when none is asked for: ``ddp-vs-fsdp`` with a GPU, else ``smoke``."""
    return "ddp-vs-fsdp" if host is not None and getattr(host, "device", "") == "cuda" else "smoke"


def listed(presets: list[tuple[str, str]], default: str) -> list[tuple[str, str]]:
    """The built-in presets in the list's order: by name, with ``WATCHABLE`` right under the highlighted default,
    so a first look sees the one slow enough to watch beside the quick check."""
    watch = [p for p in presets if p[0] == WATCHABLE]
    rest = [p for p in presets if p[0] != WATCHABLE]
    names = [name for name, _ in rest]
    if not watch or default not in names:
        return presets
    at = names.index(default) + 1
    return rest[:at] + watch + rest[at:]


class PresetsScreen(Screen):
    """The start screen: pick what to compare, adjust it, launch it."""

    BINDINGS = [
        Binding("s", "launch", "Start"),
        Binding("u", "tune", "Tune"),  # shardscope tune of this preset's model: the search shown live
        Binding("ctrl+o", "focus_path", "Open file"),
        Binding("q", "app.quit", "Quit"),
    ]

    def __init__(self, preset: str | None = None) -> None:
        super().__init__()
        self.initial = preset
        self.preset = ""  # name or path of the chosen preset
        self.base: Comparison | None = None  # the preset as written
        self.comparison: Comparison | None = None  # with the knobs applied, valid
        self.overrides: list[str] = []

    def compose(self) -> ComposeResult:
        """Lay out the preset list, its details and the knobs."""
        yield Static("[b]shardscope[/b] · choose a comparison", id="title")
        with Horizontal(id="presets-main"):
            with Vertical(id="preset-side"):
                yield OptionList(*[Option(_entry(name, desc), id=name)
                                   for name, desc in listed(list_presets(), default_preset(self.app.host))],
                                 id="preset-list")
                yield Input(placeholder="path/to/preset.toml ⏎", id="preset-path")
                yield Static("", id="preset-path-error", classes="field-error")
            with VerticalScroll(id="preset-detail"):
                yield Static(id="preset-desc")
                yield DataTable(id="preset-runs", cursor_type="none", zebra_stripes=True)
                with Grid(id="knobs"):
                    for knob in KNOBS:
                        yield Label(knob.label, classes="knob-label")
                        if knob.kind == "int":
                            yield Input(id=knob.field_id, type="integer", compact=True)
                        else:
                            yield Select([], id=knob.field_id, allow_blank=True, compact=True)
                        yield Static("", id=f"{knob.field_id}-error", classes="field-error")
                yield Static("", id="preset-error", classes="field-error")
                yield Static("", id="cli-line")
                yield Button("Start comparison (s)", id="launch", variant="primary")
        yield Footer()

    def on_mount(self) -> None:
        """Show the preset asked for on the command line, else the first built-in."""
        runs = self.query_one("#preset-runs", DataTable)
        runs.add_columns("run", "strategy", "world size", "precision", "options")
        default = default_preset(self.app.host)
        names = [name for name, _ in listed(list_presets(), default)]
        initial = self.initial or (default if default in names else names[0] if names else "")
        if initial in names:
            self.query_one("#preset-list", OptionList).highlighted = names.index(initial)
        elif initial:
            self.query_one("#preset-path", Input).value = initial
            self.choose(initial)
        self.query_one("#preset-list", OptionList).focus()

    # -- choosing a preset -----------------------------------------------------------------------

    @on(OptionList.OptionHighlighted, "#preset-list")
    def _highlighted(self, event: OptionList.OptionHighlighted) -> None:
        self.choose(str(event.option.id))

    @on(Input.Submitted, "#preset-path")
    def _path_submitted(self, event: Input.Submitted) -> None:
        path = event.value.strip()
        if not path:
            return
        presets = self.query_one("#preset-list", OptionList)
        if self.choose(path):
            if not _has_option(presets, path):
                presets.add_option(Option(_entry(path, "your preset file"), id=path))
            presets.highlighted = presets.get_option_index(path)  # the list shows the preset the form holds
            presets.focus()  # out of the text box: the footer's keys (s to start) act again

    def choose(self, name_or_path: str) -> bool:
        """Load a preset and fill the form; show its error instead if it does not load."""
        path_error = self.query_one("#preset-path-error", Static)
        try:
            base = load_preset(name_or_path, host=self.app.host)
        except ConfigError as err:
            path_error.update(plain(err))
            return False
        path_error.update("")
        self.preset, self.base, self.comparison, self.overrides = name_or_path, base, base, []
        shrunk = ""
        if base.size_profile == "cpu":  # the description gives the full sizes: say what a run here uses
            sizes = literal(", ".join(f"{k.removeprefix('model.')} {v}" for k, v in cpu_overrides(name_or_path).items()))
            shrunk = f"\n[yellow]No GPU here: its \\[cpu_overrides] shrink it ({sizes}); the runs and fields below " \
                     "are what will run.[/yellow]"
        what = Text.assemble(("model: ", "bold"), clean(model_facts.label(base.model)), ("\ndata: ", "bold"),
                             clean(model_facts.data_label(base.data, base.model)),
                             *[(clean("\nnote: " + line), "yellow") for line in base.adjustments])
        self.query_one("#preset-desc", Static).update(Text.assemble(  # plain strings in assemble: never markup
            Text.from_markup(f"[b]{literal(base.name)}[/b] — "), clean(base.description or "(no description)"),
            Text.from_markup(shrunk), "\n", what, "\n", (clean(display_path(base.source)), "dim")))
        for knob in KNOBS:
            value = current_value(base, knob.key)
            if knob.kind == "int":
                field = self.query_one(f"#{knob.field_id}", Input)
                field.type = "integer" if knob.applies(base) else "text"
                field.value, field.disabled = value, not knob.applies(base)
            else:
                select = self.query_one(f"#{knob.field_id}", Select)
                select.set_options([(plain(c), c) for c in choices(base, knob.key)])
                select.value = value
        self._show(base, {}, "")
        return True

    # -- knobs -----------------------------------------------------------------------------------

    @on(Input.Changed, "#knobs Input")
    @on(Select.Changed, "#knobs Select")
    def _knob_changed(self) -> None:
        self.revalidate()

    def values(self) -> dict[str, str]:
        """Return the text of every knob field."""
        out = {}
        for knob in KNOBS:
            widget = self.query_one(f"#{knob.field_id}")
            value = widget.value
            out[knob.key] = "" if value is Select.BLANK or value is None else str(value)
        return out

    def revalidate(self) -> None:
        """Turn the knobs into overrides, load the preset with them, show errors where they belong."""
        if self.base is None:
            return
        sets, errors = overrides(self.base, self.values())
        general = ""
        comparison = None
        if not errors:
            try:
                comparison = load_preset(self.preset, sets, host=self.app.host)
            except ConfigError as err:
                message = without_source(str(err))
                key = route_error(message)
                if key:
                    errors[key] = message
                else:
                    general = message
        self.overrides = sets
        self.comparison = comparison
        self._show(comparison or self.base, errors, general)

    def _show(self, comparison: Comparison, errors: dict[str, str], general: str) -> None:
        for knob in KNOBS:
            field = self.query_one(f"#{knob.field_id}")
            field.set_class(knob.key in errors, "-invalid")
            self.query_one(f"#{knob.field_id}-error", Static).update(plain(errors.get(knob.key, "")))
        self.query_one("#preset-error", Static).update(plain(general))
        table = self.query_one("#preset-runs", DataTable)
        table.clear()
        for run in comparison.runs:
            opts = ", ".join(f"{k}={v}" for k, v in run.options.items()) or "defaults"
            table.add_row(*map(plain, (run.name, run.strategy, str(resolved_world_size(comparison, run)),
                                       resolved_precision(comparison, run), opts)))  # str cells are markup
        valid = self.comparison is not None
        self.query_one("#launch", Button).disabled = not valid
        sets = " ".join(f"--set {shlex.quote(s)}" for s in self.overrides)  # a line to paste: every value quoted
        self.query_one("#cli-line", Static).update(
            f"[dim]same from a shell:[/dim] shardscope run --preset {literal(shlex.quote(self.preset))} {literal(sets)}".rstrip()
            if valid else "[dim]fix the fields marked in red to start[/dim]")

    # -- launch ----------------------------------------------------------------------------------

    @on(Button.Pressed, "#launch")
    def _launch_pressed(self) -> None:
        self.action_launch()

    def action_launch(self) -> None:
        """Start the comparison as configured (if it is valid)."""
        if self.comparison is None:
            self.notify("Fix the fields marked in red first.", severity="warning")
            return
        self.app.launch(self.comparison, self.preset, list(self.overrides))

    def action_tune(self) -> None:
        """Search the fastest configuration of this preset's model that fits (``shardscope tune``), shown live."""
        if self.comparison is None:
            self.notify("Fix the fields marked in red first.", severity="warning")
            return
        from shardscope.tui import source as sources
        from shardscope.tui.screens.tune import TuneScreen

        self.app.push_screen(TuneScreen(self.comparison, sources.default_out_dir(f"{self.comparison.name}-tune")))

    def show_launch_error(self, message: str) -> None:
        """Show why the comparison could not start, under the launch button."""
        self.query_one("#preset-error", Static).update(plain(message, "bold red"))

    def action_focus_path(self) -> None:
        """Move the cursor to the preset path field."""
        self.query_one("#preset-path", Input).focus()


def _entry(name: str, description: str, limit: int = 48) -> Text:
    """A preset's line in the list: its name and the start of its description, cut at a word (the
    whole description is beside the list for the highlighted preset)."""
    short = description
    if len(description) > limit:
        head = description[: limit - 1]
        short = (head.rsplit(" ", 1)[0] if " " in head else head).rstrip(" ,;:—-") + "…"
    return Text.assemble((clean(name), "bold"), "\n", (clean(short), "dim"))


def _has_option(option_list: OptionList, option_id: str) -> bool:
    try:
        option_list.get_option(option_id)
    except OptionDoesNotExist:
        return False
    return True
