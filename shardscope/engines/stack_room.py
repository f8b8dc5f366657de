"""Run the training loop with room on CPython's frame stack, wherever on the stack it is called from.

CPython (3.11 on) keeps its Python frames in chunks of a per-thread data stack: a call that does not fit in the
current chunk maps a new one (16 KiB or more), and the return that empties it unmaps it again. A loop whose calls
go back and forth across a chunk's end therefore maps, faults in and unmaps memory on every crossing: CPython
issue gh-142183 ("Calls across stack chunks perform badly"), fixed by caching one chunk in 3.13 and 3.14's later
releases, not in 3.11 or 3.12. Where the crossing falls depends on how deep the loop starts. A rank forked from
shardscope's preloaded torchrun agent starts under torchrun's own frames, a new interpreter near the top: seen on
a 2-core VM (benchmarks/RESULTS.md, 2026-11-28), parity's ZeRO-3 ranks took about 570 page faults a step in
``_PyThreadState_BumpFramePointerSlow`` when forked, none when started as new interpreters, and their forward
ran 15-16 ms against 10 ms. A strategy's figure must not depend on such luck.

``call`` runs a function inside a frame that reserves ``ROOM_SLOTS`` unused slots of operand stack (a code object
whose declared stack size is that much larger than it needs: CPython sizes a frame from it and never touches the
unused part). The frame does not fit the current chunk, so CPython maps a chunk for it: the smallest power of
two that holds the frame and 1,000 slots more (``push_chunk``), 1 MiB for this one on a 64-bit machine. The calls
made inside it are placed in what is left of that chunk, about ``ROOM_SLOTS`` slots (512 KiB), hundreds of frames
deeper than any training step goes, with no chunk boundary to cross. Pages the calls do not reach are never touched. Written by hand: no
library or interpreter option sets the data stack's chunk size.
"""

from __future__ import annotations

import types
from typing import Any, Callable, TypeVar

T = TypeVar("T")

ROOM_SLOTS = 1 << 16  # object pointers: 512 KiB of frames for the calls made inside ``call``


def _enter(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return fn(*args, **kwargs)


_code = _enter.__code__
_roomy = types.FunctionType(_code.replace(co_stacksize=_code.co_stacksize + ROOM_SLOTS), _enter.__globals__,
                            "_roomy_enter")


def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Return ``fn(*args, **kwargs)``, run with ``ROOM_SLOTS`` slots of CPython's frame stack free beneath it."""
    return _roomy(fn, args, kwargs)
