"""Block files are untrusted input: whatever sits in the disk tier's directory (damaged, crafted,
planted by another local user) is a miss or the exact block written, never a crash, a hang, a
huge allocation or another request's KV (radix_backend/mem_cache/kv_store.py)."""

from __future__ import annotations

import os
import random
import stat
import struct
import time
import zlib

import pytest
import torch
from safetensors.torch import save as save_safetensors

from radix_backend.mem_cache.kv_store import _HEADER, FORMAT_VERSION, MAGIC, SUFFIX, DiskKVStore, model_fingerprint

SHAPE = (2, 8, 2, 4)  # layers, block tokens, kv heads, head dim
TOKENS = list(range(100, 108))
NAME = "ab" * 32


@pytest.fixture
def store(tmp_path):
    s = DiskKVStore(tmp_path / "kv", "f" * 64, 1 << 30, block_shape=SHAPE, dtype=torch.float32)
    yield s
    s.close()


def written(store: DiskKVStore) -> tuple[torch.Tensor, torch.Tensor, bytes]:
    k, v = torch.randn(SHAPE), torch.randn(SHAPE)
    assert store.put(NAME, TOKENS, k, v)
    store.flush()
    return k, v, store.path(NAME).read_bytes()


def block_file(store: DiskKVStore, k: torch.Tensor, v: torch.Tensor, tokens=TOKENS, fingerprint=None) -> bytes:
    """A well-formed file (valid crc) with these tensors: what a crafted block looks like."""
    payload = save_safetensors({"k": k, "v": v.clone(), "tokens": torch.tensor(tokens, dtype=torch.int64)},
                               metadata={"fingerprint": fingerprint or store.fingerprint, "format": str(FORMAT_VERSION)})
    return _HEADER.pack(MAGIC, FORMAT_VERSION, len(payload), zlib.crc32(payload)) + payload


def test_files_are_private_to_the_user(store):
    written(store)
    assert stat.S_IMODE(store.dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(store.path(NAME).stat().st_mode) == 0o600


def test_a_crafted_block_of_another_shape_or_dtype_is_a_miss(store):
    """A [1,1,1,1] block with a valid checksum once served 63 stale pool slots as this prefix's KV."""
    for k in (torch.zeros(1, 1, 1, 1), torch.zeros(SHAPE, dtype=torch.float16), torch.zeros(2, 8, 2, 5)):
        store.path(NAME).write_bytes(block_file(store, k, k))
        assert store.read(NAME, TOKENS) is None
        assert not store.path(NAME).exists()  # removed, so the next write replaces it
    good = torch.ones(SHAPE)
    store.path(NAME).write_bytes(block_file(store, good, good, tokens=[t + 1 for t in TOKENS]))
    assert store.read(NAME, TOKENS) is None  # another prefix's block under this name


def test_fuzzed_block_files_are_misses_or_the_exact_block(store):
    k, v, original = written(store)
    rng = random.Random(0)
    mutations = 0
    for trial in range(600):
        data = bytearray(original)
        kind = trial % 6
        if kind == 0:  # random bytes flipped anywhere
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
        elif kind == 1:  # truncated
            data = data[:rng.randrange(len(data))]
        elif kind == 2:  # random garbage
            data = bytearray(rng.randbytes(rng.randrange(0, 4096)))
        elif kind == 3:  # a damaged safetensors header under a recomputed checksum: the parser stands guard
            payload = bytearray(data[_HEADER.size:])
            header_len = struct.unpack_from("<Q", payload)[0]
            for _ in range(rng.randint(1, 4)):
                payload[8 + rng.randrange(header_len)] = rng.randrange(256)
            data = bytearray(_HEADER.pack(MAGIC, FORMAT_VERSION, len(payload), zlib.crc32(payload)) + payload)
        elif kind == 4:  # a safetensors header length pointing anywhere
            payload = bytearray(data[_HEADER.size:])
            struct.pack_into("<Q", payload, 0, rng.choice([0, 7, 2 ** 63, len(payload) * 2, rng.randrange(1 << 20)]))
            data = bytearray(_HEADER.pack(MAGIC, FORMAT_VERSION, len(payload), zlib.crc32(payload)) + payload)
        else:  # header fields mutated
            data[:_HEADER.size] = _HEADER.pack(rng.choice([MAGIC, b"XXXX"]), rng.choice([FORMAT_VERSION, 0, 2 ** 32 - 1]),
                                               rng.randrange(1 << 64), rng.randrange(1 << 32))
        store.path(NAME).write_bytes(bytes(data))
        block = store.read(NAME, TOKENS)  # never raises
        if block is not None:
            assert torch.equal(block.k, k) and torch.equal(block.v, v)  # e.g. only header padding changed
        else:
            mutations += 1
    assert mutations > 550


def test_a_fifo_a_link_and_a_huge_sparse_file_are_refused_without_waiting_or_allocating(store, tmp_path):
    written(store)
    path = store.path(NAME)
    path.unlink()
    os.mkfifo(path)
    start = time.perf_counter()
    assert store.read(NAME, TOKENS) is None and time.perf_counter() - start < 5  # a FIFO hung the scheduler
    assert not path.exists()
    target = tmp_path / "elsewhere"
    target.write_bytes(b"secret")
    path.symlink_to(target)
    assert store.read(NAME, TOKENS) is None and target.read_bytes() == b"secret" and not path.is_symlink()
    with open(path, "wb") as f:  # 3 GiB of holes: reading it whole cost 3.3 GB of memory
        f.truncate(3 << 30)
    assert store.read(NAME, TOKENS) is None and not path.exists()


def test_the_fingerprint_covers_every_byte_of_every_tensor():
    weights = {"a": torch.randn(1000, 1000), "b": torch.randn(7)}
    base = model_fingerprint(weights, {"x": 1})
    changed = {"a": weights["a"].clone(), "b": weights["b"]}
    changed["a"][777, 123] += 1.0  # far from any sampled chunk
    assert model_fingerprint(changed, {"x": 1}) != base
    assert model_fingerprint(weights, {"x": 2}) != base and model_fingerprint(weights, {"x": 1}) == base


def test_block_files_end_in_the_suffix(store):
    written(store)
    assert [p.name for p in store.dir.iterdir()] == [NAME + SUFFIX]
