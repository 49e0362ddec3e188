"""Disk store of KV blocks: the persistent tier under the radix cache.

A token sequence is cut into blocks of `block_tokens` tokens from position 0; block j is named by
a hash chain, h_j = sha256(h_{j-1} + tokens of block j), seeded with the model's fingerprint
(weights sample, config, KV dtype, quantization, format version), as vLLM's block hashes and
SGLang's HiCache keys are. A block's name therefore says "the KV of exactly these tokens, after
exactly this prefix, from exactly this model"; another model's files are never looked up.

One file per block, `<dir>/<fingerprint[:16]>/<hash>.kvb`:

    b"RXKV" + version (u32) + payload length (u64) + crc32 of payload (u32) + payload

where the payload is safetensors (`k`, `v`: [layers, block_tokens, kv_heads, head_dim]; `tokens`)
with the fingerprint in its metadata. Files are read as untrusted input: only a regular file (no
link, FIFO or device: opened with O_NOFOLLOW | O_NONBLOCK) no larger than a block file can be, whose
length, crc, header, tensor names, shapes, dtypes, tokens and fingerprint all check out; anything
else is a miss with a warning and is removed. Files are written to a temporary name and renamed into
place, so a reader (another process included) never sees half a file. Directories are created
0700 and files 0600: the blocks hold users' prompt tokens.

Writes run on one background thread (copies of the KV are taken on the scheduler thread, which is
all the critical path pays); the directory is kept under `capacity_bytes` by deleting the least
recently used files (reads refresh a file's mtime). A write that fails (disk full, read-only)
turns writing off with one warning: the cache goes on in memory only.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import queue
import stat
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAGIC = b"RXKV"
_HEADER = struct.Struct("<4sIQI")  # magic, version, payload length, crc32
SUFFIX = ".kvb"
MAX_HEADER_BYTES = 1 << 16  # a block file's safetensors header is ~300 bytes
MAX_PENDING_BYTES = 1 << 30  # queued writes beyond this are dropped (the tier is best effort)
READ_THREADS = min(4, os.cpu_count() or 1)  # file reads and crc32 release the GIL


class CorruptEntry(Exception):
    """A block file that cannot be trusted (truncated, bit flips, another model's, bad header)."""


@dataclass
class DiskStats:
    """What the disk tier did since the engine started."""

    hit_tokens: int = 0  # tokens whose KV came from disk instead of being computed
    blocks_read: int = 0
    bytes_read: int = 0
    load_s: float = 0.0  # reading, checking and copying blocks into the KV pool
    blocks_written: int = 0
    bytes_written: int = 0
    blocks_dropped: int = 0  # writes skipped: queue full or writing turned off
    corrupt_entries: int = 0
    evicted_files: int = 0
    write_errors: int = 0


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """All of a tensor's bytes, for the fingerprint: a view, so hashing a large model copies nothing."""
    flat = tensor.detach().reshape(-1).contiguous().cpu()
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
              "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _read_file(path: Path, max_bytes: int) -> bytearray:
    """The whole file in one writable buffer (tensors are viewed over it without copying). Only a
    regular file of at most `max_bytes`: a link is not followed, a FIFO does not block the reader,
    a huge (or sparse) file is not allocated for."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with open(fd, "rb", closefd=True) as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise CorruptEntry("not a regular file")
        if info.st_size > max_bytes:
            raise CorruptEntry(f"{info.st_size} bytes, more than a block file holds ({max_bytes})")
        data = bytearray(info.st_size)
        if f.readinto(data) != info.st_size:
            raise CorruptEntry("file changed size while being read")
    return data


def _safetensors_views(data: bytearray, start: int) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Parse the safetensors document at `data[start:]` (8-byte header size, JSON header, data)
    and return its metadata and tensors viewing `data` (safetensors' own loader would copy)."""
    header_len = struct.unpack_from("<Q", data, start)[0]
    if header_len > MAX_HEADER_BYTES:
        raise ValueError(f"safetensors header of {header_len} bytes")
    header = json.loads(bytes(data[start + 8:start + 8 + header_len]))
    meta = header.pop("__metadata__", None) or {}
    base = start + 8 + header_len
    tensors = {}
    for name, info in header.items():
        dtype = _ST_DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        count = (end - begin) // torch.empty((), dtype=dtype).element_size()
        if base + end > len(data):
            raise ValueError(f"tensor {name} runs past the end of the file")
        flat = torch.frombuffer(data, dtype=dtype, count=count, offset=base + begin) if count else torch.empty(0, dtype=dtype)
        tensors[name] = flat.reshape(info["shape"])
    return meta, tensors


def model_fingerprint(state: dict[str, torch.Tensor], identity: dict[str, Any]) -> str:
    """Hex sha256 naming the model whose KV a store holds: every tensor's name, shape, dtype and
    all its bytes (two checkpoints that differ anywhere must not share KV; ~0.3 s per GB, paid only
    when the disk tier is on), plus `identity` (config, KV dtype, quantization mode...) and the
    file format version."""
    h = hashlib.sha256(json.dumps({"format": FORMAT_VERSION, **identity}, sort_keys=True, default=str).encode())
    for name in sorted(state):
        t = state[name]
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def block_hashes(tokens: Sequence[int], block_tokens: int, seed: str) -> list[str]:
    """Names of the whole blocks of `tokens` (hash chain seeded with `seed`)."""
    out: list[str] = []
    prev = bytes.fromhex(seed)
    for j in range(len(tokens) // block_tokens):
        block = tokens[j * block_tokens:(j + 1) * block_tokens]
        prev = hashlib.sha256(prev + struct.pack(f"<{block_tokens}q", *block)).digest()
        out.append(prev.hex())
    return out


@dataclass
class _Write:
    name: str
    tokens: list[int]
    k: torch.Tensor
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


@dataclass
class KVBlock:
    """One block read back (checked against its tokens): K/V [layers, block_tokens, kv_heads, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass
class _WriterState:
    pending_bytes: int = 0
    disabled_reason: str | None = None
    inflight: set[str] = field(default_factory=set)


class DiskKVStore:
    """Block files of one model under `root/<fingerprint[:16]>`; see the module docstring."""

    def __init__(self, root: str | os.PathLike[str], fingerprint: str, capacity_bytes: int,
                 block_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.fingerprint = fingerprint
        self.capacity_bytes = int(capacity_bytes)
        self.block_shape, self.dtype = tuple(block_shape), dtype  # every block's K and V: [layers, tokens, heads, dim]
        block_bytes = math.prod(self.block_shape) * torch.empty((), dtype=dtype).element_size()
        self.max_file_bytes = _HEADER.size + 8 + MAX_HEADER_BYTES + 2 * block_bytes + 8 * self.block_shape[1]
        self.dir = Path(root) / fingerprint[:16]
        self.stats = DiskStats()
        self._lock = threading.Lock()
        self._writer = _WriterState()
        self._known: set[str] = set()
        try:
            Path(root).mkdir(mode=0o700, parents=True, exist_ok=True)
            self.dir.mkdir(mode=0o700, exist_ok=True)
            self._known = {p.name[:-len(SUFFIX)] for p in os.scandir(self.dir) if p.name.endswith(SUFFIX)}
        except OSError as exc:
            self._disable_writes(f"cannot use {self.dir}: {exc}")
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="radix-kv-disk-reader")
        self._queue: queue.SimpleQueue[_Write | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write_loop, name="radix-kv-disk-writer", daemon=True)
        self._thread.start()

    # ---- lookup ---------------------------------------------------------------------------
    def path(self, name: str) -> Path:
        return self.dir / f"{name}{SUFFIX}"

    def has(self, name: str) -> bool:
        """On disk or queued for writing (files other processes wrote count once seen)."""
        with self._lock:
            if name in self._known or name in self._writer.inflight:
                return True
        if self.path(name).exists():
            with self._lock:
                self._known.add(name)
            return True
        return False

    def read(self, name: str, expected_tokens: Sequence[int]) -> KVBlock | None:
        """The block `name`, checked; None (a miss) when absent or untrustworthy."""
        path = self.path(name)
        try:
            data = _read_file(path, self.max_file_bytes)
            block = self._decode(data, expected_tokens)
        except FileNotFoundError:
            self._forget(name)
            return None
        except OSError as exc:
            if exc.errno != errno.ELOOP:  # permissions, I/O: leave the file, compute instead
                logger.warning("disk KV cache: cannot read %s (%s); computing instead", path, exc)
                return None
            self._drop_corrupt(name, CorruptEntry("a symbolic link, not a block file"))
            return None
        except Exception as exc:  # noqa: BLE001 - any malformed block is a miss, never an error for the request
            self._drop_corrupt(name, exc if isinstance(exc, CorruptEntry) else CorruptEntry(f"{type(exc).__name__}: {exc}"))
            return None
        try:
            os.utime(path)  # LRU recency, shared with other processes through the file system
        except OSError:
            pass
        with self._lock:
            self.stats.blocks_read += 1
            self.stats.bytes_read += len(data)
        return block

    def _drop_corrupt(self, name: str, exc: CorruptEntry) -> None:
        """Count and log an untrustworthy block file, then remove it (a later write replaces it)."""
        with self._lock:
            self.stats.corrupt_entries += 1
        logger.warning("disk KV cache: ignoring %s (%s); computing instead", self.path(name).name, exc)
        self._remove(name)

    def read_run(self, names: Sequence[str], tokens: Sequence[Sequence[int]]) -> list[KVBlock]:
        """The longest leading run of `names` that reads back intact (files read in parallel)."""
        blocks = list(self._readers.map(self.read, names, tokens))
        run = []
        for block in blocks:
            if block is None:
                break
            run.append(block)
        return run

    def _decode(self, data: bytearray, expected_tokens: Sequence[int]) -> KVBlock:
        """Check a block file's bytes and view its tensors in place (no copy)."""
        if len(data) < _HEADER.size:
            raise CorruptEntry("truncated header")
        magic, version, length, crc = _HEADER.unpack_from(data)
        payload = memoryview(data)[_HEADER.size:]
        if magic != MAGIC or version != FORMAT_VERSION:
            raise CorruptEntry(f"not a format-{FORMAT_VERSION} block file")
        if len(payload) != length:
            raise CorruptEntry(f"truncated: {len(payload)} of {length} payload bytes")
        if zlib.crc32(payload) != crc:
            raise CorruptEntry("checksum mismatch")
        try:
            meta, tensors = _safetensors_views(data, _HEADER.size)
        except Exception as exc:  # noqa: BLE001 - json, struct, shapes: all one thing, a bad payload
            raise CorruptEntry(f"bad safetensors payload: {exc}") from exc
        if not isinstance(meta, dict) or meta.get("fingerprint") != self.fingerprint:
            raise CorruptEntry("written by another model or format")
        if set(tensors) != {"k", "v", "tokens"}:
            raise CorruptEntry(f"tensors {sorted(tensors)}, not k, v, tokens")
        for kv in ("k", "v"):
            if tuple(tensors[kv].shape) != self.block_shape or tensors[kv].dtype != self.dtype:
                raise CorruptEntry(f"{kv} is {tuple(tensors[kv].shape)} {tensors[kv].dtype}, the pool's blocks "
                                   f"{self.block_shape} {self.dtype}")
        tokens = tensors["tokens"]
        if tokens.dtype != torch.int64 or tokens.tolist() != list(expected_tokens):
            raise CorruptEntry("tokens differ from the block's name")
        return KVBlock(tensors["k"], tensors["v"])

    # ---- writing --------------------------------------------------------------------------
    def put(self, name: str, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> bool:
        """Queue a block for writing (`k`, `v` must be the caller's own copies). False if dropped."""
        job = _Write(name, list(tokens), k, v)
        with self._lock:
            if name in self._known or name in self._writer.inflight:
                return True
            if self._writer.disabled_reason or self._writer.pending_bytes + job.nbytes > MAX_PENDING_BYTES:
                self.stats.blocks_dropped += 1
                return False
            self._writer.inflight.add(name)
            self._writer.pending_bytes += job.nbytes
        self._queue.put(job)
        return True

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued write has landed (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._writer.inflight:
                    return
            time.sleep(0.005)

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join(timeout=10)
        self._readers.shutdown(wait=False)

    @property
    def writes_disabled(self) -> str | None:
        return self._writer.disabled_reason

    def _write_loop(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                if not self._writer.disabled_reason:
                    self._write(job)
            except OSError as exc:
                self.stats.write_errors += 1
                self._disable_writes(f"writing {self.path(job.name)} failed: {exc}")
            except Exception:  # noqa: BLE001 - the writer thread must outlive one bad block
                self.stats.write_errors += 1
                logger.exception("disk KV cache: writing block %s failed", job.name)
            finally:
                with self._lock:
                    self._writer.inflight.discard(job.name)
                    self._writer.pending_bytes -= job.nbytes

    def _write(self, job: _Write) -> None:
        from safetensors.torch import save as save_safetensors

        payload = save_safetensors({"k": job.k.contiguous(), "v": job.v.contiguous(),
                                    "tokens": torch.tensor(job.tokens, dtype=torch.int64)},
                                   metadata={"fingerprint": self.fingerprint, "format": str(FORMAT_VERSION)})
        data = _HEADER.pack(MAGIC, FORMAT_VERSION, len(payload), zlib.crc32(payload)) + payload
        final = self.path(job.name)
        tmp = self.dir / f".tmp-{os.getpid()}-{uuid.uuid4().hex}"
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600),
                      "wb") as f:
                f.write(data)
            os.replace(tmp, final)  # atomic: readers see the old state or the whole file
        finally:
            tmp.unlink(missing_ok=True)  # only left behind when the write failed
        with self._lock:
            self._known.add(job.name)
        self.stats.blocks_written += 1
        self.stats.bytes_written += len(data)
        self._evict_over_capacity(keep=final)

    def _evict_over_capacity(self, keep: Path) -> None:
        """Delete least-recently-used block files (by mtime) until the directory fits its cap."""
        entries = []
        for entry in os.scandir(self.dir):
            if entry.name.endswith(SUFFIX):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                entries.append((st.st_mtime, entry.name, st.st_size))
        total = sum(size for _, _, size in entries)
        for _, filename, size in sorted(entries):
            if total <= self.capacity_bytes:
                break
            if filename == keep.name:
                continue
            self._remove(filename[:-len(SUFFIX)])
            self.stats.evicted_files += 1
            total -= size

    # ---- bookkeeping ----------------------------------------------------------------------
    def _forget(self, name: str) -> None:
        with self._lock:
            self._known.discard(name)

    def _remove(self, name: str) -> None:
        self._forget(name)
        try:
            self.path(name).unlink(missing_ok=True)
        except OSError:
            pass

    def _disable_writes(self, reason: str) -> None:
        with self._lock:
            if self._writer.disabled_reason:
                return
            self._writer.disabled_reason = reason
        logger.warning("disk KV cache: %s; continuing with the in-memory cache only", reason)
