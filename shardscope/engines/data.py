"""Data: the global batch at step s is a pure function of (seed, s).

Every rank generates the whole global batch on CPU from a ``torch.Generator`` seeded from
(seed, s) and keeps its own contiguous slice, so every strategy sees the same tokens in the same
order whatever its layout. Tensor-parallel peers share a data-parallel rank, hence the same slice.
With gradient accumulation each rank's slice is split, in order, into ``grad_accum`` micro-batches.

``build_batches`` dispatches on ``data.kind`` through ``DATA_SOURCES`` (``"module:function"``
entries, imported lazily). Hook point for other data: add an entry whose function takes the
``Comparison`` and returns a ``BatchSource``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from shardscope.core import model_facts
from shardscope.engines.model import resolve

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), on CPU


@dataclass(frozen=True)
class BatchSource:
    """A deterministic global-batch generator.

    ``global_batch(step)`` returns (inputs, targets) for all ``global_batch`` samples of ``step``.
    ``tokens_per_sample`` is the sequence length for token models, 0 for images (the loop then
    reports samples/s instead of tokens/s).
    """

    global_batch: Callable[[int], Batch]
    tokens_per_sample: int
    # Several steps' global batches at once, stacked ([steps, global_batch, ...]), the same tokens as step by step:
    # where building them together is cheaper (the Markov chain is walked once for all of them).
    global_batches: Callable[[range], Batch] | None = None

    def stacked(self, steps: range) -> Batch:
        """The global batches of ``steps`` stacked along a new first dimension (``global_batches``, or step by
        step)."""
        if self.global_batches is not None:
            return self.global_batches(steps)
        inputs, targets = zip(*(self.global_batch(step) for step in steps))
        return torch.stack(inputs), torch.stack(targets)


def step_seed(seed: int, step: int, stream: int = 0) -> int:
    """Return the generator seed for (seed, step, stream): distinct, reproducible, 63-bit."""
    return (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB + 1) % (2**63 - 1)


# ------------------------------------------------------------------------------------------------
# Synthetic tokens: a fixed random first-order Markov chain with low-entropy transitions.

_BRANCHES = 4  # each token has this many likely successors...
_BRANCH_PROBS = (0.6, 0.25, 0.1, 0.05)  # ...with these probabilities (about 1.1 nats)
_NOISE = 0.05  # and with this probability the next token is uniform instead


def markov_table(vocab_size: int, seed: int) -> torch.Tensor:
    """Return the chain's successor table ``[vocab, _BRANCHES]`` (int64), fixed by ``seed``."""
    gen = torch.Generator().manual_seed(step_seed(seed, 0, stream=1))
    return torch.randint(vocab_size, (vocab_size, _BRANCHES), generator=gen)


def markov_batch(table: torch.Tensor, seed: int, step: int, batch: int, length: int) -> torch.Tensor:
    """Return ``[batch, length]`` tokens of the chain for ``step`` (pure function of its arguments)."""
    return markov_batches(table, seed, range(step, step + 1), batch, length)[0]


def markov_batches(table: torch.Tensor, seed: int, steps: range, batch: int, length: int) -> torch.Tensor:
    """Return ``[len(steps), batch, length]``: ``markov_batch`` of each step, the chain walked once for them all.

    Each step's draws come from its own generator, as one step's would; the walk costs one gather per offset from a
    row's last restart, whatever the number of rows. On one core (2026-11-29): smoke's global batch (8 x 65) 0.056
    ms a step in chunks of 128 steps against 0.58 ms alone; 8 x 2,049 1.5 ms in chunks of 4 against 2.5 ms, and
    slower again in chunks of 32 (the sort over every position grows faster than the gathers it saves)."""
    vocab = table.shape[0]
    probs = torch.tensor(_BRANCH_PROBS)
    draws = []
    for step in steps:
        gen = torch.Generator().manual_seed(step_seed(seed, step))
        choices = torch.multinomial(probs, batch * length, replacement=True, generator=gen).view(batch, length)
        noisy = torch.rand(batch, length, generator=gen) < _NOISE
        draws.append((choices, noisy, torch.randint(vocab, (batch, length), generator=gen)))
    choices, noisy, noise = (torch.cat(d) for d in zip(*draws))
    return _walk(table, choices, noisy, noise).view(len(steps), batch, length)


def _walk(table: torch.Tensor, choices: torch.Tensor, noisy: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The chain's tokens ``[rows, length]`` from its draws: every row a chain of its own."""
    # A position holds its noise token where the chain restarts (the first column, or a noisy draw), else the chain's
    # successor of the position before it: tokens[:, t] = table[tokens[:, t - 1], choices[:, t]]. Each position's
    # offset from its row's last restart orders the work: every position at offset k follows one at offset k - 1, so
    # one gather per offset fills all rows' segments at once. Column by column took one gather per column, 2,048
    # at seq_len 2048 (28 ms a global batch of 8 on one core); segments end on a noisy draw (p = _NOISE), so the
    # longest offset is about ln(rows x length) / _NOISE (~200). The tokens are the same either way.
    batch, length = choices.shape
    restart = noisy.clone()
    restart[:, 0] = True
    position = torch.arange(batch * length).view(batch, length)
    offset = (position - torch.where(restart, position, 0).cummax(dim=1).values).flatten()
    tokens = noise.clone()
    flat, order = tokens.view(-1), torch.argsort(offset, stable=True)
    sizes = torch.bincount(offset).tolist()
    groups = zip(order.split(sizes), (order - 1).split(sizes), choices.flatten()[order].split(sizes))
    next(groups)  # offset 0: the restarts, already their noise tokens
    for where, before, choice in groups:
        flat[where] = table[flat[before], choice]
    return tokens


def synthetic_source(comparison: Any) -> BatchSource:
    """Return the Markov-chain token source for ``comparison`` over the model's whole vocabulary (next-token
    targets)."""
    m, seed, n = comparison.model, comparison.seed, comparison.global_batch
    table = markov_table(model_facts.vocab_size(m), seed)

    def global_batch(step: int) -> Batch:
        tokens = markov_batch(table, seed, step, n, m.seq_len + 1)
        return tokens[:, :-1], tokens[:, 1:]

    def global_batches(steps: range) -> Batch:
        tokens = markov_batches(table, seed, steps, n, m.seq_len + 1)
        return tokens[..., :-1], tokens[..., 1:]

    return BatchSource(global_batch, m.seq_len, global_batches)


# ------------------------------------------------------------------------------------------------
# A user's tokens: a pre-tokenized file, a text file through its tokenizer (a token cache), or a text file's bytes.


def windows_source(tokens: Any, comparison: Any) -> BatchSource:
    """Windows of ``seq_len + 1`` of ``tokens`` (a 1-D torch tensor, or a numpy array memory-mapped from a token
    file: only the windows' pages are read) at positions drawn from (seed, s): inputs and next-token targets."""
    m, seed, n = comparison.model, comparison.seed, comparison.global_batch
    window = m.seq_len + 1
    offsets = torch.arange(window)
    length = int(tokens.shape[0])

    def global_batch(step: int) -> Batch:
        gen = torch.Generator().manual_seed(step_seed(seed, step))
        starts = torch.randint(length - window + 1, (n,), generator=gen)
        index = starts[:, None] + offsets
        if isinstance(tokens, torch.Tensor):
            batch = tokens[index].long()
        else:  # numpy: uint16/uint32 ids widened to int64, which torch indexes
            batch = torch.from_numpy(tokens[index.numpy()].astype("int64"))
        return batch[:, :-1], batch[:, 1:]

    return BatchSource(global_batch, m.seq_len)


def mapped_tokens(described: dict[str, Any]) -> Any:
    """The token file the data check described (``core/token_files.py``), memory-mapped as a 1-D numpy array."""
    import numpy as np

    return np.memmap(described["path"], dtype=described["dtype"], mode="r", offset=int(described["offset"]),
                     shape=(int(described["tokens"]),))


def tokens_source(comparison: Any) -> BatchSource:
    """Return windows of the user's token file (``data.kind = "tokens"``), as the data check described it."""
    return windows_source(mapped_tokens(comparison.data.described), comparison)


def text_source(comparison: Any) -> BatchSource:
    """Return windows of the UTF-8 file ``data.path``: its tokens through ``data.tokenizer`` (the token cache the
    data check wrote), else its bytes (vocab 256), positions drawn from (seed, s)."""
    d = comparison.data
    if d.tokenizer:
        return windows_source(mapped_tokens(d.described), comparison)
    with open(d.path, "rb") as fh:
        data = torch.frombuffer(bytearray(fh.read()), dtype=torch.uint8).long()
    return windows_source(data, comparison)


# data.kind -> "module:function(comparison) -> BatchSource". Imported lazily.
DATA_SOURCES: dict[str, str] = {
    "synthetic": "shardscope.engines.data:synthetic_source",
    "text": "shardscope.engines.data:text_source",
    "images": "shardscope.engines.images:image_source",
    "tokens": "shardscope.engines.data:tokens_source",
}


def make_source(comparison: Any) -> BatchSource:
    """Return the ``BatchSource`` for ``comparison.data.kind``; raises ValueError for an unknown kind."""
    entry = DATA_SOURCES.get(comparison.data.kind)
    if entry is None:
        raise ValueError(f"data.kind = {comparison.data.kind!r}: allowed: {', '.join(DATA_SOURCES)}")
    return resolve(entry)(comparison)


def rank_slice(batch: Batch, dp_size: int, dp_rank: int, grad_accum: int, dim: int = 0) -> list[Batch]:
    """Return this data-parallel rank's contiguous slice of ``batch`` as ``grad_accum`` micro-batches,
    in order (the samples along ``dim``: 1 for steps stacked along 0). Raises ValueError when the batch does not
    divide into dp_size x grad_accum."""
    inputs, targets = batch
    n = inputs.shape[dim]
    if n % (dp_size * grad_accum):
        raise ValueError(f"global batch {n} is not divisible by dp ({dp_size}) x grad_accum ({grad_accum})")
    per_rank = n // dp_size
    lo = dp_rank * per_rank
    x, y = inputs.narrow(dim, lo, per_rank), targets.narrow(dim, lo, per_rank)
    return list(zip(x.chunk(grad_accum, dim), y.chunk(grad_accum, dim)))


AHEAD_BYTES = 64 << 20  # a rank's batches of the whole run built before step 0 up to this size, else a chunk ahead
# Steps whose global batches are built together (``markov_batches``): up to this size and this many; 1 MiB is 128
# steps of smoke's shape, 4 of a batch of 8 x 2,048 tokens: near the fastest of each (see markov_batches).
CHUNK_BYTES = 1 << 20
CHUNK_STEPS = 256


def build_batches(comparison: Any, dp_size: int, dp_rank: int, *,
                  ahead: bool = False) -> tuple[Callable[[int], list[Batch]], BatchSource]:
    """Return (``micro_batches(step)``, source): this rank's micro-batches for a step, and the source.

    With ``ahead`` (a run's ranks), no step waits for its batch: every step's micro-batches are built before step 0
    when they fit ``AHEAD_BYTES`` (while the previous run tears down), else on a thread a chunk of steps ahead of
    the step that runs. Either way steps are built a chunk at a time (``BatchSource.stacked``: the Markov chain is
    walked once for up to ``CHUNK_STEPS`` steps). The tokens are the same (each step's global batch is still a pure
    function of (seed, step)); only this rank's slice is kept."""
    source = make_source(comparison)

    def micro_batches(step: int) -> list[Batch]:
        return rank_slice(source.global_batch(step), dp_size, dp_rank, comparison.grad_accum)

    if not ahead:
        return micro_batches, source

    def own(steps: range) -> list[Batch]:  # the slices alone, [len(steps), ...] each: the global batches are freed
        stacked = rank_slice(source.stacked(steps), dp_size, dp_rank, comparison.grad_accum, dim=1)
        return [(x.clone(), y.clone()) for x, y in stacked]

    steps = max(1, int(comparison.steps))
    first = own(range(1))
    size = sum(x.numel() * x.element_size() + y.numel() * y.element_size() for x, y in first)
    chunk = max(1, min(CHUNK_STEPS, CHUNK_BYTES // max(1, size * dp_size)))  # the global batches' size, about
    if size * steps <= AHEAD_BYTES:
        built = _all_steps(first, own, steps, chunk)
        return (lambda step: built(step) if 0 <= step < steps else micro_batches(step)), source
    ahead_of = _chunks_ahead(own, steps, chunk)
    return (lambda step: ahead_of(step) if 0 <= step < steps else micro_batches(step)), source


def _all_steps(first: list[Batch], own: Callable[[range], list[Batch]], steps: int,
               chunk: int) -> Callable[[int], list[Batch]]:
    """Every step's micro-batches built now, a chunk of steps at a time, into one tensor per position (the i-th
    micro-batch's inputs or targets, all steps), and ``micro_batches(step)`` that hands out views of step's rows. A
    few large allocations live for the run: kept as thousands of small tensors, each between the freed temporaries
    that built it (the chain's columns), they left the heap full of holes, and glibc's malloc spent 2-3 times longer
    on the training step's own allocations (``unlink_chunk``, ``malloc_consolidate``: 7.7% of a DDP rank's CPU,
    against 4.4% in a bare loop whose batches are one ``randint`` each; ``perf record``, 2026-11-29)."""
    stores = [torch.empty((steps, *t.shape[1:]), dtype=t.dtype, device=t.device) for pair in first for t in pair]
    for start in range(0, steps, chunk):
        these = range(start, min(steps, start + chunk))
        part = first if these == range(1) else own(these)
        for store, t in zip(stores, [t for pair in part for t in pair]):
            store[start:start + t.shape[0]].copy_(t)
    pairs = list(zip(stores[0::2], stores[1::2]))
    return lambda step: [(x[step], y[step]) for x, y in pairs]


def _chunks_ahead(own: Callable[[range], list[Batch]], steps: int, chunk: int) -> Callable[[int], list[Batch]]:
    """``micro_batches(step)`` for ``0 <= step < steps`` that hands out views of the chunk of steps that holds it,
    the next chunk built on a thread meanwhile (torch's CPU ops release the GIL). One build every ``chunk`` steps:
    built one step ahead, step by step, the thread took 10% of a core on smoke, and rank 0 waited 0.9 ms a step
    longer for a core than a bare loop's (tokens/s 0.916 of it at 20,000 steps; a chunk ahead 0.964: RESULTS.md,
    2026-11-29)."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardscope-batches")

    def steps_from(start: int) -> range:
        return range(start, min(steps, start + chunk))

    held: dict[str, Any] = {"start": 0, "parts": own(steps_from(0))}  # before step 0, as the next chunk is begun
    pending: dict[int, Any] = {chunk: pool.submit(own, steps_from(chunk))} if chunk < steps else {}

    def micro_batches(step: int) -> list[Batch]:
        start = step - step % chunk
        if held["start"] != start:
            fut = pending.pop(start, None)
            held["parts"] = fut.result() if fut is not None else own(steps_from(start))
            held["start"] = start
            for stale in [s for s in pending if s != start + chunk]:  # a step skipped (a restart): not needed
                pending.pop(stale).cancel()
        if start + chunk < steps and start + chunk not in pending:
            pending[start + chunk] = pool.submit(own, steps_from(start + chunk))
        i = step - start
        return [(x[i], y[i]) for x, y in held["parts"]]

    return micro_batches
