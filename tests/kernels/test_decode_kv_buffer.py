"""The decode K/V buffer: consecutive decode steps append a column instead of gathering, and every
step's attention equals textbook attention over the pool, whatever happened in between."""

from __future__ import annotations

import math

import torch

from radix_backend.kernels.attention_base import AttentionMetadata
from radix_backend.kernels.decode_kv import DecodeKVBuffer
from radix_backend.kernels.torch_backend import TorchAttentionBackend

from test_shared_prefix_attention import HKV, HQ, D, reference

SCALE = 1 / math.sqrt(D)


def buffered_backend() -> TorchAttentionBackend:
    """The torch backend with the buffer used at any size (the engine's threshold skips small steps)."""
    backend = TorchAttentionBackend()  # the buffer serves the torch decode path
    backend.min_buffered_keys = 0
    return backend


class Pool:
    """A KV pool plus the slot list of each running request, driven one forward at a time."""

    def __init__(self, num_slots: int = 4096, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.k_cache = torch.randn(num_slots, HKV, D, generator=self.gen)
        self.v_cache = torch.randn(num_slots, HKV, D, generator=self.gen)
        self.free = torch.randperm(num_slots - 1, generator=self.gen).add(1).tolist()

    def new_request(self, length: int, shared: list[int] | None = None) -> list[int]:
        return list(shared or []) + [self.free.pop() for _ in range(length - len(shared or []))]

    def forward(self, backend: TorchAttentionBackend, requests: list[list[int]], extend: list[int]) -> None:
        """Run one forward where request i adds its last extend[i] slots; check it against the reference."""
        prefix = [len(r) - e for r, e in zip(requests, extend)]
        out_slots = torch.tensor([s for r, p in zip(requests, prefix) for s in r[p:]])
        tokens = sum(extend)
        q = torch.randn(tokens, HQ, D, generator=self.gen)
        k = torch.randn(tokens, HKV, D, generator=self.gen)
        v = torch.randn(tokens, HKV, D, generator=self.gen)
        meta = AttentionMetadata.build(prefix, extend, torch.tensor([s for r in requests for s in r]), out_slots, "cpu")
        backend.begin_forward(meta)
        out = backend.forward(q, k, v, self.k_cache, self.v_cache, meta, SCALE)
        expected = reference(q, self.k_cache, self.v_cache, requests, prefix, extend, SCALE)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)

    def decode(self, backend: TorchAttentionBackend, requests: list[list[int]]) -> None:
        for r in requests:
            r.append(self.free.pop())
        self.forward(backend, requests, [1] * len(requests))


def test_consecutive_decode_steps_append_and_stay_exact() -> None:
    pool, backend = Pool(), buffered_backend()
    requests = [pool.new_request(n) for n in (5, 40, 17)]  # ragged: padding columns are masked
    pool.forward(backend, requests, [len(r) for r in requests])
    for _ in range(6):
        pool.decode(backend, requests)
    assert backend.decode_kv.rebuilds == 1  # only the first decode step gathered


def test_buffer_grows_past_its_capacity() -> None:
    pool, backend = Pool(), buffered_backend()
    backend.decode_kv.growth = 2
    requests = [pool.new_request(n) for n in (3, 9)]
    for _ in range(7):
        pool.decode(backend, requests)
    assert backend.decode_kv.rebuilds == 3  # widths 10..16 with 2 spare columns: gathers at 10, 13, 16


def test_a_finished_request_an_extend_or_a_retraction_rebuilds() -> None:
    pool, backend = Pool(), buffered_backend()
    requests = [pool.new_request(n) for n in (8, 12, 20)]
    pool.decode(backend, requests)
    pool.decode(backend, requests)
    requests.pop(1)  # finished: the batch has other rows now
    pool.decode(backend, requests)
    assert backend.decode_kv.rebuilds == 2
    joined = pool.new_request(6)
    pool.forward(backend, requests + [joined], [1, 1, 6])  # a mixed step: not a decode
    requests.append(joined)
    pool.decode(backend, requests)
    assert backend.decode_kv.rebuilds == 3
    # request 0 retracted and replaced by one of the same length at other slots: same rows and
    # lengths one token longer, but one old slot differs -> the slot-by-slot check must notice
    requests[0] = list(requests[0])
    requests[0][3] = pool.free.pop()
    pool.decode(backend, requests)
    assert backend.decode_kv.rebuilds == 4


def test_decode_with_a_shared_prefix_uses_the_buffer_for_the_remainders() -> None:
    pool, backend = Pool(), buffered_backend()
    shared = pool.new_request(48)
    requests = [pool.new_request(48 + n, shared) for n in (3, 7, 1, 12)]
    for _ in range(4):
        pool.decode(backend, requests)
    assert backend.decode_kv.rebuilds == 1


def test_a_new_pool_tensor_is_never_read_from_old_copies() -> None:
    pool, backend = Pool(), buffered_backend()
    requests = [pool.new_request(n) for n in (9, 4)]
    pool.decode(backend, requests)
    pool.k_cache = pool.k_cache.clone().add_(0.5)  # same slots, other tensor, other values
    pool.v_cache = pool.v_cache.clone()
    pool.decode(backend, requests)  # exact against the new tensor (checked inside)


def test_over_the_byte_budget_layers_gather_every_step() -> None:
    pool, backend = Pool(), buffered_backend()
    backend.decode_kv = DecodeKVBuffer(max_bytes=0)
    requests = [pool.new_request(n) for n in (9, 4)]
    for _ in range(3):
        pool.decode(backend, requests)
    assert not backend.decode_kv._layers


def test_small_decode_steps_skip_the_buffer() -> None:
    """Below min_buffered_keys the step gathers as before (the buffer's small ops would cost more)."""
    pool, backend = Pool(), TorchAttentionBackend()  # the buffer serves the torch decode path
    backend.min_buffered_keys = 64
    small = [pool.new_request(n) for n in (5, 9)]  # 2 x 10 padded keys: plain path
    for _ in range(3):
        pool.decode(backend, small)
    assert backend.decode_kv.rebuilds == 0
    big = [pool.new_request(n) for n in (40, 30)]  # 2 x 41 keys: buffered
    for _ in range(3):
        pool.decode(backend, big)
    assert backend.decode_kv.rebuilds == 1
