"""The user's tokens, checked before anything starts (torch-free; numpy, read lazily, memory-mapped).

``data.kind = "tokens"`` reads a pre-tokenized file:
- llm.c's shard format: a header of 256 int32 (magic 20240520, version 1 = uint16 tokens, 2 = uint32, the token
  count) then the tokens; recognised by its magic whatever the file is called;
- a ``.npy`` array of uint16 or uint32 (its own header says which);
- anything else as raw tokens, nanoGPT's ``train.bin``: uint16 unless ``data.dtype = "uint32"``.

``data.kind = "text"`` with ``data.tokenizer`` (a ``tokenizer.json``, the ``tokenizers`` library) is tokenised
once into a uint32 cache under ``~/.cache/shardscope/tokens/`` (named by the hash of the text and the tokenizer, so
any later comparison reuses it) and then read like a token file.

``describe_tokens`` returns what the ranks need (``DataSpec.described``): where the tokens start, their dtype and
count, the file's content hash; it refuses, in one line, a file with fewer tokens than one global batch of
``seq_len + 1`` windows or an id outside the model's vocabulary.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

LLMC_MAGIC = 20240520
LLMC_HEADER_BYTES = 256 * 4
LLMC_DTYPES = {1: "uint16", 2: "uint32"}
FULL_SCAN_BYTES = 1 << 30  # every id is checked against the vocabulary up to this size; a sample beyond
SAMPLE_TOKENS = 1 << 22
FULL_HASH_BYTES = 4 << 30  # content hash of the whole file up to this size; of the size and sampled chunks beyond
HASH_CHUNK = 64 << 20
_CACHE: dict[str, dict[str, Any]] = {}


class DataCheckError(ValueError):
    """The data cannot be used; ``str(err)`` is one line."""


def content_hash(path: str) -> tuple[str, str]:
    """(sha256 hex, what it covers): the whole file, or for one over ``FULL_HASH_BYTES`` its size and its first,
    middle and last ``HASH_CHUNK`` bytes (said so)."""
    size = os.path.getsize(path)
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        if size <= FULL_HASH_BYTES:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
            return digest.hexdigest(), "whole file"
        digest.update(str(size).encode())
        for offset in (0, size // 2, max(0, size - HASH_CHUNK)):
            fh.seek(offset)
            digest.update(fh.read(HASH_CHUNK))
    return digest.hexdigest(), f"size and 3 chunks of {HASH_CHUNK >> 20} MiB"


def token_layout(path: str, dtype: str) -> dict[str, Any]:
    """Where the tokens of ``path`` start, their dtype, count and the file's format. Raises DataCheckError."""
    import numpy as np

    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(LLMC_HEADER_BYTES)
    if len(head) >= 12 and int.from_bytes(head[:4], "little") == LLMC_MAGIC:
        header = np.frombuffer(head.ljust(LLMC_HEADER_BYTES, b"\0"), dtype="<i4")
        version, count = int(header[1]), int(header[2])
        if version not in LLMC_DTYPES:
            raise DataCheckError(f"data.path = {path!r}: llm.c shard version {version}; known: 1 (uint16), 2 (uint32)")
        width = 2 if version == 1 else 4
        if LLMC_HEADER_BYTES + count * width > size:
            raise DataCheckError(f"data.path = {path!r}: llm.c header says {count:,} tokens, the file holds "
                                 f"{max(0, size - LLMC_HEADER_BYTES) // width:,}")
        return {"format": f"llm.c shard v{version}", "offset": LLMC_HEADER_BYTES, "dtype": LLMC_DTYPES[version],
                "tokens": count}
    if head[:6] == b"\x93NUMPY":
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as err:
            raise DataCheckError(f"data.path = {path!r}: not a readable .npy file ({err})") from None
        if array.dtype not in (np.dtype("<u2"), np.dtype("<u4")) or array.ndim != 1:
            raise DataCheckError(f"data.path = {path!r}: a .npy of {array.dtype} with {array.ndim} dimensions; "
                                 "allowed: one dimension of little-endian uint16 or uint32 token ids")
        return {"format": ".npy", "offset": int(array.offset), "dtype": array.dtype.name, "tokens": int(array.size)}
    kind = dtype or "uint16"
    width = 2 if kind == "uint16" else 4
    if size % width:
        raise DataCheckError(f"data.path = {path!r}: {size:,} bytes is not a whole number of {kind} tokens; set "
                             "data.dtype to the file's token width (uint16 or uint32)")
    return {"format": f"raw {kind}", "offset": 0, "dtype": kind, "tokens": size // width}


def _looks_like_text(path: str) -> bool:
    with open(path, "rb") as fh:
        head = fh.read(1 << 16)
    if b"\x00" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as err:
        return err.start > len(head) - 4  # a character cut at the end of the sample
    return True


def check_ids(path: str, layout: dict[str, Any], vocab: int) -> int:
    """The largest id of the file (of a sample for a file over ``FULL_SCAN_BYTES``); raises DataCheckError naming
    the first id at or above ``vocab``."""
    import numpy as np

    try:
        tokens = np.memmap(path, dtype=layout["dtype"], mode="r", offset=layout["offset"], shape=(layout["tokens"],))
    except (OSError, ValueError, MemoryError) as err:  # an address-space cap, a file that shrank: one line
        raise DataCheckError(f"data.path = {path!r}: cannot be memory-mapped ({type(err).__name__}: "
                             f"{(str(err).splitlines() or [''])[0][:200]}); the ranks read tokens that way") from None
    width = tokens.dtype.itemsize
    if layout["tokens"] * width <= FULL_SCAN_BYTES:
        parts = [(0, tokens)]
    else:
        step = max(1, layout["tokens"] // 16)
        parts = [(s, tokens[s:s + SAMPLE_TOKENS // 16]) for s in range(0, layout["tokens"], step)]
    top = 0
    for start, part in parts:
        if not len(part):
            continue
        high = int(part.max())
        if high >= vocab:
            at = start + int(np.argmax(part >= vocab))
            raise DataCheckError(f"data.path = {path!r}: token id {int(part[at - start]):,} at position {at:,} is "
                                 f"outside the model's vocabulary of {vocab:,} (ids 0..{vocab - 1})")
        top = max(top, high)
    return top


def describe_tokens(path: str, dtype: str, vocab: int, windows: int, window: int) -> dict[str, Any]:
    """What the ranks need to read ``path`` as tokens, checked: at least ``windows`` windows of ``window`` tokens
    and every id below ``vocab``. Raises DataCheckError."""
    if not os.path.isfile(path):
        raise DataCheckError(f"data.path = {path!r}: no such token file")
    st = os.stat(path)
    key = repr((path, st.st_size, st.st_mtime_ns, dtype, vocab, windows, window))
    if key in _CACHE:
        return _CACHE[key]
    layout = token_layout(path, dtype)
    if layout["format"].startswith("raw") and path.endswith((".txt", ".md")) and _looks_like_text(path):
        raise DataCheckError(f"data.path = {path!r}: a text file; for text use data.kind = 'text' (with "
                             "data.tokenizer for a tokenizer.json)")
    need = windows * window
    if layout["tokens"] < need:
        raise DataCheckError(f"data.path = {path!r}: {layout['tokens']:,} tokens ({layout['format']}); one global "
                             f"batch needs {windows} windows of seq_len + 1 = {window}: at least {need:,} tokens")
    top = check_ids(path, layout, vocab)
    digest, covers = content_hash(path)
    out = {**layout, "path": path, "max_id": top, "sha256": digest, "hashed": covers,
           "checked": "every id" if layout["tokens"] * (2 if layout["dtype"] == "uint16" else 4) <= FULL_SCAN_BYTES
           else f"a sample of {SAMPLE_TOKENS:,} ids"}
    _CACHE[key] = out
    return out


def is_binary(path: str) -> bool:
    """True for a file that is not UTF-8 text (a token file given as ``data.kind = "text"``)."""
    return not _looks_like_text(path)


def cache_dir() -> str:
    """Where tokenised text is kept: ``$XDG_CACHE_HOME/shardscope/tokens`` (``~/.cache`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "shardscope", "tokens")


def tokenize_text(text_path: str, tokenizer_path: str) -> tuple[str, int]:
    """(path of the uint32 token cache of ``text_path`` under ``tokenizer_path``, the tokenizer's vocabulary),
    tokenising once: the cache is named by both files' hashes, so a later comparison reuses it. Raises
    DataCheckError."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - transformers depends on tokenizers
        raise DataCheckError("data.tokenizer: needs the tokenizers library (pip install tokenizers)") from None
    if not os.path.isfile(tokenizer_path):
        raise DataCheckError(f"data.tokenizer = {tokenizer_path!r}: no such file")
    try:
        tokenizer = Tokenizer.from_file(tokenizer_path)
    except Exception as err:  # the library raises its own exception type
        raise DataCheckError(f"data.tokenizer = {tokenizer_path!r}: not a tokenizer.json the tokenizers library "
                             f"reads ({str(err).splitlines()[0][:200] if str(err) else type(err).__name__})") from None
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    key = hashlib.sha256()
    for path in (text_path, tokenizer_path):
        key.update(content_hash(path)[0].encode())
    cache = os.path.join(cache_dir(), f"{key.hexdigest()[:32]}.u32")
    if not os.path.exists(cache):
        import numpy as np

        with open(text_path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        try:
            ids = np.asarray(tokenizer.encode(text).ids, dtype=np.uint32)
        except Exception as err:  # noqa: BLE001 - the library raises its own type ("Missing [UNK] token")
            raise DataCheckError(f"data.tokenizer = {tokenizer_path!r}: could not encode {text_path}: "
                                 f"{(str(err).splitlines() or [type(err).__name__])[0][:200]}") from None
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = f"{cache}.{os.getpid()}.partial"
        ids.tofile(tmp)
        os.replace(tmp, cache)
    return cache, vocab
