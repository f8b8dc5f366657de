"""Issue 43: the one reader of records and JSON files against random values of every type and depth (seeded, so
every run checks the same thousands of cases): it returns a typed record or nothing, the fold takes whatever it
returns without raising, and a JSON file of any content is a value or one ValueError — never another exception."""

from __future__ import annotations

import json
import random

from shardscope.core.events import KINDS, decode_line
from shardscope.core.numbers import read_json
from shardscope.profiling.state import RunState

KEYS = ("v", "kind", "run", "rank", "t", "step", "loss", "local_loss", "tokens_per_s", "step_time_s", "grad_norm",
        "mem_peak_bytes", "status", "message", "spec", "startup", "collectives", "x")


def _value(rng: random.Random, depth: int):
    """A random JSON value: scalars of every type (huge and non-finite numbers too), lists and objects."""
    roll = rng.random()
    if depth <= 0 or roll < 0.45:
        return rng.choice([None, True, False, 0, -1, 2**63, 10**25, 1.5, float("nan"), float("inf"), -1e308, "",
                           "soon", "ddp", "step", rng.choice(KINDS), "\x1b]0;x\x07", "[b]x[/]", rng.randint(-9, 9)])
    if roll < 0.7:
        return [_value(rng, depth - 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(KEYS): _value(rng, depth - 1) for _ in range(rng.randint(0, 6))}


def _record(rng: random.Random):
    """A record-shaped object whose every field may be of any type."""
    out = {k: _value(rng, 3) for k in rng.sample(KEYS, rng.randint(0, len(KEYS)))}
    if rng.random() < 0.7:
        out["kind"] = rng.choice(KINDS)
    return out


def _lines(rng: random.Random, n: int):
    for i in range(n):
        pick = i % 5
        if pick == 0:
            yield json.dumps(_value(rng, 6))
        elif pick in (1, 2):
            yield json.dumps(_record(rng))
        elif pick == 3:
            deep = rng.randint(10, 200000)
            yield "[" * deep + "]" * deep if rng.random() < 0.5 else '{"a":' * deep + "1" + "}" * deep
        else:
            yield bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64))).decode("latin-1")


def test_decode_line_returns_a_typed_record_or_nothing_and_the_fold_never_raises():
    rng = random.Random(43)
    state = RunState(name="ddp", strategy="ddp", world_size=2)
    decoded = 0
    for line in _lines(rng, 3000):
        for raw in (line, line.encode("utf-8", "surrogatepass")):
            rec = decode_line(raw)
            if rec is None:
                continue
            assert isinstance(rec, dict) and "kind" in rec
            for key, types in (("rank", (int,)), ("step", (int,)), ("t", (int, float)), ("run", (str,))):
                assert rec.get(key) is None or type(rec[key]) in types, (key, rec)
            decoded += 1
            state.apply_record(rec)  # never raises: a figure of the wrong type is counted in unfoldable
    assert decoded > 100 and state.unfoldable > 0, (decoded, state.unfoldable)


def test_read_json_is_a_value_or_one_value_error(tmp_path):
    rng = random.Random(44)
    path = tmp_path / "summary.json"
    for line in _lines(rng, 600):
        path.write_text(line, encoding="utf-8", errors="surrogatepass")
        try:
            read_json(str(path))
        except ValueError:
            pass
