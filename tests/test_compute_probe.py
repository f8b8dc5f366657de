"""The compute probe's process group (``compute_probe.probe_backend``): a real group of one at world size 1, the
fake group, whose collectives return at once, at larger world sizes. Each case runs a real probe (a subprocess)."""

from __future__ import annotations

import dataclasses

from shardscope import config

CPU = config.HostInfo("cpu", 64, "test")


def test_a_one_rank_probe_uses_a_real_group_of_one_and_a_larger_one_the_fake_group():
    """At world size 1 the run's own collectives on a group of one (DDP's reducer copying every gradient into its
    buckets and all-reducing them) cost time that no schedule places, so the probe runs them on a real gloo group
    of one; at 2 ranks it stands in for the others with the fake group, whose collectives return at once."""
    from shardscope.analysis.predict.probe import probe_runs
    from shardscope.engines.compute_probe import probe_backend

    assert (probe_backend(1, "cpu"), probe_backend(1, "cuda"), probe_backend(2, "cpu")) == ("gloo", "nccl", "fake")
    whole = config.load_preset("smoke", [], host=CPU)
    c = dataclasses.replace(whole, runs=[whole.run("ddp")])
    for size, backend in ((1, "gloo"), (2, "fake")):
        got = probe_runs(c, world_size=size)["ddp"]
        assert "error" not in got, got
        assert got["raw"]["backend"] == backend and got["raw"]["world_size"] == size
        assert got["forward"] > 0 and got["backward"] > 0
