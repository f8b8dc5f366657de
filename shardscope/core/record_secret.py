"""The record server's secret: made once per comparison, bound to it, proven without being sent.

``new_secret``/``write_secret`` make it (a 0600 file, never through a link), ``secret_from_env`` reads it on every
node, ``comparison_key`` binds it to one comparison and ``prove``/``proven`` answer a challenge with it
(``record_wire``'s protocol). Stdlib ``hmac``/``secrets``: nothing here needs more. Torch-free.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from collections.abc import Mapping
from typing import Any

SECRET_ENV = "SHARDSCOPE_RECORDS_SECRET"  # the comparison's secret, hex
SECRET_FILE_ENV = "SHARDSCOPE_RECORDS_SECRET_FILE"  # or: a file (mode 0600, owner only) holding that hex
SECRET_BYTES, MIN_SECRET_BYTES = 32, 16  # a new secret's length; the least one read back may have
_CONTEXT = b"shardscope-records-v1"


def new_secret() -> bytes:
    """A fresh random secret for one comparison (``SECRET_BYTES`` bytes from ``secrets``)."""
    return secrets.token_bytes(SECRET_BYTES)


def secret_text(secret: bytes) -> str:
    """The secret as the text ``SECRET_ENV`` and a secret file hold (lower-case hex)."""
    return secret.hex()


def write_secret(path: str | os.PathLike[str], secret: bytes) -> None:
    """Create ``path`` holding the secret as one line of hex, mode 0600; an existing file or a symlink there is
    refused (FileExistsError / OSError), so nothing else is overwritten and nothing readable is created."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as fh:
        os.fchmod(fd, 0o600)
        fh.write(secret_text(secret) + "\n")


def _parse_secret(text: str, where: str) -> bytes:
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(f"{where}: not a hex secret") from None  # the content is never repeated
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{where}: a secret needs at least {MIN_SECRET_BYTES} bytes ({2 * MIN_SECRET_BYTES} hex)")
    return secret


def read_secret(path: str | os.PathLike[str]) -> bytes:
    """The secret in ``path`` (written by ``write_secret``); refused when others may read or write the file or
    another user owns it (ValueError naming the file, never its content)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO there must not block the reader
    with os.fdopen(fd, "r", encoding="ascii", errors="replace") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077 or st.st_uid != os.getuid():
            raise ValueError(f"{os.fspath(path)}: a records secret must be a regular file, the owner's alone "
                             "(chmod 600)")
        return _parse_secret(fh.read(4096), os.fspath(path))


def secret_from_env(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The secret from ``SECRET_ENV`` (hex), else from the file ``SECRET_FILE_ENV`` names; None when neither is
    set. Raises ValueError (naming the variable, never the value) when it is malformed or the file unsafe."""
    env = os.environ if environ is None else environ
    if env.get(SECRET_ENV):
        return _parse_secret(env[SECRET_ENV], SECRET_ENV)
    if env.get(SECRET_FILE_ENV):
        return read_secret(env[SECRET_FILE_ENV])
    return None


def comparison_id(comparison: dict[str, Any]) -> str:
    """What names one comparison on every node (the same for each of its runs): its name, seed, global batch, world
    size and precision, and its launch's nodes, rendezvous and records endpoints and rendezvous id (under SLURM,
    from the job's id). A node of another comparison differs in one of them."""
    launch = comparison.get("launch") or {}
    keys = {k: comparison.get(k) for k in ("name", "seed", "global_batch", "world_size", "precision")}
    keys.update({k: launch.get(k) for k in ("nnodes", "rdzv_id", "rdzv_endpoint", "records_endpoint")})
    return hashlib.sha256(json.dumps(keys, sort_keys=True, default=str).encode()).hexdigest()


def comparison_key(secret: bytes | None, comparison: dict[str, Any]) -> bytes | None:
    """The key this comparison's nodes prove themselves with: the secret bound to ``comparison_id``, so a node of
    another comparison is refused even with the same secret file (and the secret itself is never used raw)."""
    if secret is None:
        return None
    return hmac.new(secret, b"shardscope-comparison|" + comparison_id(comparison).encode(), hashlib.sha256).digest()


def prove(secret: bytes, nonce: str, identity: dict[str, Any]) -> str:
    """The MAC answering ``nonce`` for ``identity`` (``{"hello": ...}`` or ``{"beat": ..., "node": N}``)."""
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return hmac.new(secret, b"|".join((_CONTEXT, nonce.encode(), canonical)), hashlib.sha256).hexdigest()


def proven(secret: bytes, nonce: str, identity: dict[str, Any], mac: Any) -> bool:
    """Whether ``mac`` is ``prove(secret, nonce, identity)`` (constant-time comparison)."""
    return isinstance(mac, str) and mac.isascii() and hmac.compare_digest(prove(secret, nonce, identity), mac)
