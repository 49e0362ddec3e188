"""The weight arena: aligned, disjoint slices of huge-page chunks that outlive the arena."""

from __future__ import annotations

import gc

import torch

from radix_backend.kernels import weight_arena


def test_slices_are_aligned_disjoint_and_typed():
    arena = weight_arena.WeightArena(chunk_bytes=1 << 16)
    pieces = [arena.empty((n, 3), dtype) for n, dtype in ((5, torch.uint8), (7, torch.float32), (1000, torch.int8),
                                                          (4000, torch.float16), (2, torch.float32))]
    spans = []
    for p in pieces:
        assert p.data_ptr() % weight_arena.ALIGN == 0 and p.is_contiguous()
        spans.append((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert [p.dtype for p in pieces] == [torch.uint8, torch.float32, torch.int8, torch.float16, torch.float32]
    big = arena.empty((3 << 16,), torch.uint8)  # larger than a chunk: a chunk of its own
    assert big.numel() == 3 << 16


def test_slices_outlive_the_arena():
    with weight_arena.active(weight_arena.WeightArena()):
        kept = weight_arena.empty((256, 64), torch.float32)
    kept.fill_(2.5)
    gc.collect()
    assert float(kept.sum()) == 2.5 * 256 * 64


def test_empty_takes_from_the_active_arena_only():
    with weight_arena.active(weight_arena.WeightArena()):
        first = weight_arena.empty((10,), torch.uint8)
        second = weight_arena.empty((10,), torch.uint8)
    assert second.data_ptr() == first.data_ptr() + weight_arena.ALIGN  # bump-allocated, aligned
    assert second.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    outside = weight_arena.empty((10,), torch.uint8)
    assert outside.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()


def test_relocate_moves_parameters_keeping_values_and_ties():
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64, bias=True))
    model[1].weight = model[0].weight  # tied, as an LM head with its embedding
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    weight_arena.relocate(model)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) and p.data_ptr() != pointers[name]
        assert p.data_ptr() % weight_arena.ALIGN == 0 and isinstance(p, torch.nn.Parameter)
    assert model[1].weight is model[0].weight
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == 1  # one chunk holds them all
