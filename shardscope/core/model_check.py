"""The model check, seen from the torch-free side: describe a user's model once, before anything starts.

A Hugging Face model from a path and a module of the user's are built by ``engines/describe.py`` in a subprocess
(this process never imports torch or the user's code), with fake tensors, and come back as a description:
parameter shapes per unit, blocks, the model's own tensor-parallel plan, FLOPs and saved activation bytes of one
step. Any failure is one line for a ``ConfigError``. A description is cached per process, keyed by the model's
table and the files' sizes and times, so the app's form re-validates without starting torch again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

from shardscope.core.bounded import run_bounded

DESCRIBE_TIMEOUT_S = 300.0  # a 7B config takes seconds; importing torch and transformers on a loaded machine, more
_CACHE: dict[str, dict[str, Any]] = {}


# The deepest model the check builds within DESCRIBE_TIMEOUT_S: fake tensors cost nothing per byte but Python time
# per layer (a 1,024-layer Llama config took 261 s on this project's 2-core VM under load, 2026-12-02); the deepest
# published decoders have under 200.
MAX_CHECKED_LAYERS = 512
_DEPTH_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def _config_depth(path: str) -> int:
    """The decoder layers a config.json gives (0 when it says none or cannot be read: the check then says why)."""
    try:
        with open(path, encoding="utf-8") as fh:
            values = json.load(fh)
    except (OSError, ValueError, RecursionError):
        return 0
    if not isinstance(values, dict):
        return 0
    depths = [values[k] for k in _DEPTH_KEYS if isinstance(values.get(k), int) and not isinstance(values[k], bool)]
    depth = depths[0] if depths else 0
    return max(0, depth)


class ModelCheckError(ValueError):
    """The model cannot be used; ``str(err)`` is one line naming the key and what is wrong."""


def _files_stamp(model: Any) -> list[Any]:
    """Size and time of every file the description reads, so an edited file is described again."""
    paths = []
    if model.kind == "hf" and model.path:
        folder = model.path if os.path.isdir(model.path) else os.path.dirname(model.path)
        paths = [model.path] + ([os.path.join(folder, f) for f in sorted(os.listdir(folder))]
                                if os.path.isdir(folder) else [])
    elif model.kind == "module":
        paths = [model.entry.rpartition(":")[0]]
    stamp = []
    for path in paths:
        try:
            st = os.stat(path)
            stamp.append([path, st.st_size, st.st_mtime_ns])
        except OSError:
            stamp.append([path, None])
    return stamp


def _key_of(model: Any) -> str:
    return json.dumps({"what": model.kind in ("hf", "module") and
                       {**dataclasses.asdict(model), "described": None, "cwd": os.getcwd()},
                       "files": _files_stamp(model)}, sort_keys=True, default=str)


def where(model: Any) -> str:
    """The key and value the user gave for the model, for messages: ``model.path = '...'`` or ``model.entry = ...``."""
    return f"model.path = {model.path!r}" if model.kind == "hf" else f"model.entry = {model.entry!r}"


def precheck(model: Any) -> None:
    """What can be told without torch: the path exists and holds a config. Raises ModelCheckError."""
    if model.kind == "hf":
        if not os.path.exists(model.path):
            raise ModelCheckError(f"{where(model)}: no such file or directory")
        config = os.path.join(model.path, "config.json") if os.path.isdir(model.path) else model.path
        if not os.path.isfile(config):
            raise ModelCheckError(f"{where(model)}: no config.json in that directory (a Hugging Face model directory "
                                  "holds config.json and, for real weights, *.safetensors)")
        depth = _config_depth(config)
        built = model.hf_layers or depth
        if built > MAX_CHECKED_LAYERS:  # judged from the config's numbers, before anything is built
            raise ModelCheckError(f"{where(model)}: {built:,} decoder layers: more than the model check builds in its "
                                  f"time budget (at most {MAX_CHECKED_LAYERS}); set model.hf_layers to keep fewer")
    elif model.kind == "module":
        target, sep, attr = model.entry.rpartition(":")
        if not model.entry:
            raise ModelCheckError("model.entry: required for model.kind = 'module' ('package.module:function' or "
                                  "'./file.py:function')")
        if not sep or not target or not attr:
            raise ModelCheckError(f"{where(model)}: expected 'package.module:function' or './file.py:function'")
        if (target.endswith(".py") or os.sep in target) and not os.path.isfile(target):
            raise ModelCheckError(f"{where(model)}: no such file {target}")


def describe(model: Any, seed: int) -> dict[str, Any]:
    """The description of ``model`` (a ``ModelSpec`` of kind "hf" with a path, or "module"), from the cache or a
    subprocess. Raises ModelCheckError with a one-line reason."""
    precheck(model)
    key = _key_of(model)
    if key in _CACHE:
        return _CACHE[key]
    table = {k: v for k, v in dataclasses.asdict(model).items() if k != "described"}
    request = json.dumps({"model": table, "seed": seed})
    env = {**os.environ, "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONWARNINGS": "ignore"}
    result = run_bounded([sys.executable, "-c", _RUNNER, request], DESCRIBE_TIMEOUT_S, env=env)
    if result is None:
        raise ModelCheckError(f"{where(model)}: the model check ran past {DESCRIBE_TIMEOUT_S:.0f} s (building the "
                              "model with fake tensors)")
    answer = _last_json(result.stdout)
    if answer is None:
        tail = (result.stderr or result.stdout or "").strip().splitlines()
        raise ModelCheckError(f"{where(model)}: the model check failed (exit {result.returncode}): "
                              f"{tail[-1][:300] if tail else 'no output'}")
    if "error" in answer:
        raise ModelCheckError(f"{where(model)}: {answer['error']}")
    _CACHE[key] = answer["described"]
    return answer["described"]


# The request goes in as an argument, not standard input, so a user's module that reads stdin gets nothing.
_RUNNER = ("import io, sys; sys.stdin = io.StringIO(sys.argv[1]); "
           "from shardscope.core.bounded import hold_lifeline; hold_lifeline(); "
           "from shardscope.engines.describe import main; sys.exit(main())")


def _last_json(stdout: str) -> dict[str, Any] | None:
    for line in reversed((stdout or "").strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict) and ("described" in value or "error" in value):
            return value
    return None
