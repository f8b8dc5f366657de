"""Hybrid sharding (HSDP): how a strategy's options split its data-parallel ranks into shard groups and replicas.

Kept apart from the registry (which re-exports both names) so that the registry stays a table of strategies.
Must not import torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def split_data_parallel(dp: int, *, shard: int = 0, replicas: int = 0, name: str = "hybrid sharding") -> tuple[int, int]:
    """Return (replicas, shard group size) for ``dp`` data-parallel ranks given one of the two.

    Raises ValueError, in one line starting with ``name``, when the size does not divide ``dp`` or leaves
    shard groups of one rank (FSDP1 would fall back to NO_SHARD within the group and skip the all-reduce
    across replicas; FSDP2 would have nothing to shard)."""
    size = shard if shard else dp // max(1, replicas)
    what = f"shard group size {shard}" if shard else f"replicate = {replicas}"
    if size < 1 or dp % size or (replicas and dp % replicas):
        raise ValueError(f"{name}: {what} must divide the {dp} data-parallel ranks")
    if size == 1 and dp > 1:
        raise ValueError(f"{name} with a shard group of 1 rank ({what}): nothing is sharded across the {dp} "
                         "replicas; use NO_SHARD or ddp instead")
    return dp // size, size


@dataclass(frozen=True)
class HybridSharding:
    """How a strategy's options ask for hybrid sharding (HSDP) over a 2-D ("replicate", "shard") mesh."""

    name: str  # what the messages call it
    option: str  # the option holding the size
    counts: str  # "shard": the option is the shard group's size (0 = the ranks of one node); "replicas": the groups
    when: tuple[str, tuple[Any, ...]] | None = None  # hybrid only while this option holds one of these values

    def groups(self, options: dict[str, Any], dp: int, ranks_per_node: int) -> tuple[int, int] | None:
        """(replicas, shard group size) these options ask for on ``dp`` data-parallel ranks; None when they
        ask for no hybrid sharding. Raises ValueError when the size does not divide ``dp``."""
        if self.when is not None and options.get(self.when[0]) not in self.when[1]:
            return None
        value = int(options.get(self.option) or 0)
        if self.counts == "replicas":
            return None if value <= 1 else split_data_parallel(dp, replicas=value, name=self.name)
        return split_data_parallel(dp, shard=value or min(dp, ranks_per_node), name=self.name)
