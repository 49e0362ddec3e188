"""A file's content digest, read once per file identity.

Cache entries derived from a model file (its converted checkpoint, its tokenizer) are keyed by
what the file holds, not where it lies or when it was written: every fresh install of the same
wheel, or copy of the same GGUF, has a new mtime, and keying by it left one full conversion per
copy in the user cache. Hashing a multi-GB file takes seconds, so the digest is memoized under the
file's identity (path, size, mtime, inode) in the user cache; a replaced file has a new identity
and is hashed again.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

from ..paths import cache_dir

_DIGEST_BYTES = 16
_CHUNK = 1 << 22
_HEX = re.compile(rf"[0-9a-f]{{{2 * _DIGEST_BYTES}}}")


def content_digest(path: Path) -> str:
    """The blake2b digest (hex) of the file at `path`, memoized under its identity."""
    memo = _memo_path(path)
    try:
        text = memo.read_text().strip()
        if _HEX.fullmatch(text):
            return text
    except OSError:  # not memoized yet (or unreadable: recomputed, then rewritten)
        pass
    digest = _hash_file(path)
    _write_private(memo, digest)
    return digest


def _hash_file(path: Path) -> str:
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _memo_path(path: Path) -> Path:
    resolved = path.resolve()
    info = resolved.stat()
    identity = f"{resolved}\0{info.st_size}\0{info.st_mtime_ns}\0{info.st_ino}".encode()
    return cache_dir() / "digests" / hashlib.blake2b(identity, digest_size=_DIGEST_BYTES).hexdigest()


def _write_private(memo: Path, digest: str) -> None:
    """Written to a temp file and renamed, so a concurrent reader never sees half a digest."""
    memo.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=memo.parent)  # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(digest)
        os.replace(tmp, memo)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
