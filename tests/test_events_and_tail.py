"""Records round-trip; the tailer waits for torn lines and skips invalid ones."""

from __future__ import annotations

import json

from shardscope.core import events
from shardscope.orchestrator.tail import MetricsTailer


def test_record_round_trip(tmp_path):
    path = tmp_path / "metrics" / "rank0.jsonl"
    with events.RecordWriter(path, "ddp", 0) as w:
        w.write("start", world_size=2)
        w.write("step", step=0, loss=5.5, tokens_per_s=123.0, step_time_s=0.1)
    records, invalid = events.read_records(path)
    assert invalid == 0
    assert [r["kind"] for r in records] == ["start", "step"]
    for r in records:
        assert set(events.COMMON_KEYS) <= set(r) and r["v"] == events.SCHEMA_VERSION and r["run"] == "ddp"
    assert records[1]["loss"] == 5.5 and records[1]["step"] == 0


def test_unknown_kind_rejected():
    import pytest

    with pytest.raises(ValueError, match="unknown record kind"):
        events.make_record("bogus", "r", 0)


def test_tailer_torn_and_invalid_lines(tmp_path):
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    tailer = MetricsTailer(str(metrics))
    assert tailer.poll() == []
    f = metrics / "rank1.jsonl"
    line = events.encode(events.make_record("step", "r", 1, step=0, loss=1.0))
    with open(f, "w") as fh:
        fh.write(line + "not json\n" + '["a list"]\n' + line[:10])  # a torn last line
        fh.flush()
    got = tailer.poll()
    assert len(got) == 1 and tailer.invalid_lines == 2
    with open(f, "a") as fh:
        fh.write(line[10:])  # the torn line completes
    got = tailer.poll()
    assert len(got) == 1 and got[0]["loss"] == 1.0
    # a new rank file appearing later is picked up
    (metrics / "rank0.jsonl").write_text(line)
    assert [r["rank"] for r in tailer.poll()] == [1]  # the record says rank 1; the file is rank0's
    assert tailer.invalid_lines == 2


def test_decoder_handles_split_utf8_and_blank_lines():
    dec = events.LineDecoder()
    payload = (json.dumps({"kind": "step", "note": "é"}) + "\n\n").encode()
    out = dec.feed(payload[:12]) + dec.feed(payload[12:])
    assert out == [{"kind": "step", "note": "é"}] and dec.invalid == 0
