"""Code runs only from what the user named on this command line.

A comparison read from a run directory (``analysis/fold.load_comparison``) is data: its model's ``entry`` (a file or
a package of someone else's) and its ``described.import_root`` are never imported unless the user names them again,
with ``--trust-code`` for that directory, or with a ``--preset`` of their own. Like an editor's restricted mode for a
folder it has not been told to trust (VS Code's workspace trust): opening, reading, reporting and diffing a run
directory never run code; re-running its runs (``why``, the app's rerun and ``w``), probing them (``predict``,
``tune --calibrate``, ``report --calibrate --probe``) or tracing them (``estimate --traced``) do, and are refused with
one line that says what would run and how to allow it. Must not import torch.
"""

from __future__ import annotations

import os
from typing import Any

from shardscope.presets.files import ConfigError

_TRUSTED: set[str] = set()  # run directories this process's command line named with --trust-code
_ALL = {"on": False}  # --trust-code: every run directory this command line names


class UntrustedCode(ConfigError):
    """A comparison from a run directory whose model is code the user has not named on this command line."""


def trust_code_in(out_dir: str) -> None:
    """The user named ``out_dir`` with ``--trust-code``: the code its comparison names may run in this process."""
    _TRUSTED.add(os.path.realpath(out_dir))


def trust_all() -> None:
    """``--trust-code``: the code named by every run directory on this command line may run in this process."""
    _ALL["on"] = True


def is_trusted(out_dir: str) -> bool:
    """Whether this command line named ``out_dir`` with ``--trust-code``."""
    return _ALL["on"] or os.path.realpath(out_dir) in _TRUSTED


def refusal(c: Any) -> str:
    """"" when the comparison's model may be built here, else the one-line reason (what would run, how to allow)."""
    m = c.model
    if m.kind != "module" or not m.from_run_dir or is_trusted(m.from_run_dir):
        return ""
    return (f"{m.from_run_dir}: its comparison names code to run (model.entry = {m.entry!r}); shardscope runs code "
            "only from what this command line names: pass --trust-code to run it, or --preset with a preset of your "
            "own naming that module")


def require_trusted(c: Any) -> None:
    """Raise UntrustedCode when the comparison's model is code from a run directory the user has not trusted."""
    reason = refusal(c)
    if reason:
        raise UntrustedCode(reason)
