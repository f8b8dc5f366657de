"""The preset knobs a user may change before launch, turned into ``--set`` overrides.

Nothing here imports textual: the presets screen renders these, the tests check the rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shardscope.config import PRECISIONS, Comparison


@dataclass(frozen=True)
class Knob:
    """One editable setting: its dotted override key, its label and how its value is typed."""

    key: str
    label: str
    kind: str  # "int" | "choice"
    models: tuple[str, ...] = ()  # the model kinds whose [model] table has this key; () = every preset

    def applies(self, comparison: Comparison) -> bool:
        """True when the preset's model uses this knob's key (a Hugging Face config sets its own width)."""
        return not self.models or comparison.model.kind in self.models

    @property
    def field_id(self) -> str:
        """The widget id of this knob's input."""
        return "knob-" + self.key.replace(".", "-").replace("_", "-")


KNOBS = (
    Knob("steps", "steps", "int"),
    Knob("world_size", "world size", "int"),
    Knob("model.d_model", "model width (d_model)", "int", ("transformer", "vit")),
    Knob("model.n_layers", "layers (n_layers)", "int", ("transformer", "vit")),
    Knob("precision", "precision", "choice"),
    Knob("baseline", "baseline run", "choice"),
)

# Which knob a ConfigError message is about, first match wins; the rest go under the form.
_ROUTES = (
    (re.compile(r"model\.d_model|model\.n_heads"), "model.d_model"),
    (re.compile(r"model\.n_layers"), "model.n_layers"),
    (re.compile(r"precision"), "precision"),
    (re.compile(r"baseline"), "baseline"),
    (re.compile(r"world_size|global_batch|\bdp \("), "world_size"),
    (re.compile(r"(?<![\w.])steps\b"), "steps"),
)


NOT_USED = "(set by the model)"  # the text of a knob whose key the preset's model does not use


def current_value(comparison: Comparison, key: str) -> str:
    """Return the preset's value of a knob as the text shown in its field (``NOT_USED`` for a key its model does not
    use: a Hugging Face config's or a module's own width and depth)."""
    knob = next((k for k in KNOBS if k.key == key), None)
    if knob is not None and not knob.applies(comparison):
        return NOT_USED
    target: object = comparison
    for part in key.split("."):
        target = getattr(target, part)
    return str(target)


def choices(comparison: Comparison, key: str) -> list[str]:
    """Return the allowed values of a choice knob."""
    if key == "precision":
        return list(PRECISIONS)
    if key == "baseline":
        return [r.name for r in comparison.runs]
    return []


def overrides(base: Comparison, values: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """Return (``--set`` overrides for values that differ from ``base``, per-knob type errors)."""
    out: list[str] = []
    errors: dict[str, str] = {}
    for knob in KNOBS:
        text = values.get(knob.key, "").strip()
        if not knob.applies(base) or text == current_value(base, knob.key):
            continue
        if knob.kind == "int":
            if not re.fullmatch(r"-?\d+", text):
                errors[knob.key] = f"{knob.key} = {text!r}: expected an integer"
                continue
            out.append(f"{knob.key}={int(text)}")
        else:
            out.append(f'{knob.key}="{text}"')
    return out, errors


def route_error(message: str) -> str:
    """Return the knob key a ConfigError message is about, or "" for a general error."""
    for pattern, key in _ROUTES:
        if pattern.search(message):
            return key
    return ""


def without_source(message: str) -> str:
    """Drop the leading ``<preset file>: `` of a ConfigError message (the screen already names it)."""
    return re.sub(r"^.+?\.toml: ", "", message, count=1)
