"""CUDA-graph capture and replay of the decode step, to hide per-kernel launch overhead (Triton).

Usage (the model runner, on CUDA, after the model and KV pool exist):

    def decode_fn(input_ids, positions, meta):        # -> logits [B, vocab]
        return model(input_ids, positions, kv_caches, backend, meta,
                     logits_indices=torch.arange(input_ids.shape[0], device=input_ids.device))

    runner = CudaGraphDecodeRunner(decode_fn, max_batch_size=64, max_kv_tokens=pool_slots, device="cuda")
    runner.capture()                                   # once; takes a few seconds
    logits = runner.run(input_ids, positions, meta) if runner.can_run(meta) else decode_fn(...)

`run` copies the batch into static buffers padded to the next captured batch size (1, 2, 4, 8,
16, 32, 64, ...), replays that size's graph and returns `logits[:B]`, a view of graph-owned
memory that the next `run` overwrites (copy it if you keep it; sampling right away is fine).
Padding requests have one token at position 0 whose KV slot is `pad_slot` (slot 0, which the KV
pool reserves for this), so padding never touches a real sequence.

Rules for `decode_fn`, so that a captured graph stays valid for other batches of the same size:
read batch data only from the given tensors and `meta`'s device tensors; use `meta`'s host lists
only for shapes (`batch_size`, `is_decode`); no host syncs (`.item()`, `.tolist()`); new tensors
are fine (they come from the graph's memory pool). The torch and Triton attention backends obey
this: Triton's decode kernel reads sequence lengths on the device. During capture the host lists
claim every request is `capture_seq_len` long (default `max_context_len`), so a backend that
sizes work from them (the torch backend pads to that length) stays correct for every replay.

On CPU, or with `use_graphs=False`, the same padding path runs eagerly: that is how the padding
logic is tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .attention_base import AttentionMetadata

DecodeFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... up to max_batch_size (always included)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes, bs = [], 1
    while bs < max_batch_size:
        sizes.append(bs)
        bs *= 2
    return sizes + [max_batch_size]


@dataclass
class StaticDecodeBuffers:
    """Device buffers sized for the largest batch; every graph reads its slice of them."""

    input_ids: torch.Tensor  # [Bmax]
    positions: torch.Tensor  # [Bmax]
    qo_indptr: torch.Tensor  # [Bmax+1] = arange (one token per request)
    kv_indptr: torch.Tensor  # [Bmax+1]
    kv_indices: torch.Tensor  # [max_kv_tokens + Bmax]
    prefix_lens: torch.Tensor  # [Bmax]
    extend_lens: torch.Tensor  # [Bmax] = 1
    seq_lens: torch.Tensor  # [Bmax]
    out_slots: torch.Tensor  # [Bmax]
    pad_ramp: torch.Tensor  # [Bmax] = 1..Bmax, kv_indptr tail for padding requests

    @classmethod
    def allocate(cls, max_batch_size: int, max_kv_tokens: int, device: torch.device) -> "StaticDecodeBuffers":
        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=device)
        ar = torch.arange(max_batch_size + 1, dtype=torch.int64, device=device)
        return cls(input_ids=zeros(max_batch_size), positions=zeros(max_batch_size), qo_indptr=ar.clone(),
                   kv_indptr=ar.clone(), kv_indices=zeros(max_kv_tokens + max_batch_size),
                   prefix_lens=zeros(max_batch_size), extend_lens=torch.ones_like(ar[1:]),
                   seq_lens=torch.ones_like(ar[1:]), out_slots=zeros(max_batch_size), pad_ramp=ar[1:].clone())

    def meta(self, bs: int, host_seq_len: int) -> AttentionMetadata:
        """Metadata over the first `bs` requests; host lists only fix shapes (see module doc)."""
        return AttentionMetadata(
            qo_indptr=self.qo_indptr[: bs + 1], kv_indptr=self.kv_indptr[: bs + 1], kv_indices=self.kv_indices,
            prefix_lens=self.prefix_lens[:bs], extend_lens=self.extend_lens[:bs], seq_lens=self.seq_lens[:bs],
            out_slots=self.out_slots[:bs], prefix_lens_cpu=[host_seq_len - 1] * bs, extend_lens_cpu=[1] * bs)

    def fill(self, padded_bs: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
             pad_slot: int) -> None:
        """Copy a real decode batch in and pad it to `padded_bs` (device copies only, no sync)."""
        bs, n = meta.batch_size, int(meta.kv_indices.shape[0])
        pad = padded_bs - bs
        self.input_ids[:bs].copy_(input_ids)
        self.positions[:bs].copy_(positions)
        self.kv_indptr[: bs + 1].copy_(meta.kv_indptr)
        self.kv_indices[:n].copy_(meta.kv_indices)
        self.seq_lens[:bs].copy_(meta.seq_lens)
        self.prefix_lens[:bs].copy_(meta.prefix_lens)
        self.out_slots[:bs].copy_(meta.out_slots)
        if pad:
            self.input_ids[bs:padded_bs].zero_()
            self.positions[bs:padded_bs].zero_()
            torch.add(self.pad_ramp[:pad], n, out=self.kv_indptr[bs + 1: padded_bs + 1])
            self.kv_indices[n: n + pad].fill_(pad_slot)
            self.seq_lens[bs:padded_bs].fill_(1)
            self.prefix_lens[bs:padded_bs].zero_()
            self.out_slots[bs:padded_bs].fill_(pad_slot)

    def fill_dummy(self, bs: int, pad_slot: int) -> None:
        """All-padding batch used for warm-up and capture."""
        self.input_ids[:bs].zero_()
        self.positions[:bs].zero_()
        self.kv_indptr[: bs + 1].copy_(self.qo_indptr[: bs + 1])
        self.kv_indices[:bs].fill_(pad_slot)
        self.seq_lens[:bs].fill_(1)
        self.prefix_lens[:bs].zero_()
        self.out_slots[:bs].fill_(pad_slot)


@dataclass
class _Captured:
    meta: AttentionMetadata
    output: torch.Tensor | None = None
    graph: "torch.cuda.CUDAGraph | None" = None


class CudaGraphDecodeRunner:
    """Captures `decode_fn` once per batch size and replays the smallest graph that fits a batch."""

    def __init__(self, decode_fn: DecodeFn, max_batch_size: int, max_kv_tokens: int, device: torch.device | str,
                 batch_sizes: Sequence[int] | None = None, max_context_len: int | None = None,
                 capture_seq_len: int | None = None, pad_slot: int = 0, use_graphs: bool | None = None) -> None:
        self.decode_fn = decode_fn
        self.device = torch.device(device)
        self.batch_sizes = sorted(set(batch_sizes or default_batch_sizes(max_batch_size)))
        if self.batch_sizes[0] < 1 or self.batch_sizes[-1] > max_batch_size:
            raise ValueError(f"batch_sizes must lie in 1..max_batch_size ({max_batch_size}), got {self.batch_sizes}")
        self.max_kv_tokens = max_kv_tokens
        self.max_context_len = max_context_len or max_kv_tokens
        self.capture_seq_len = capture_seq_len or self.max_context_len
        self.pad_slot = pad_slot
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; pass use_graphs=False to run the padded path eagerly")
        self.buffers = StaticDecodeBuffers.allocate(self.batch_sizes[-1], max_kv_tokens, self.device)
        self._captured: dict[int, _Captured] = {}
        self.graph_pool = None

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._captured)

    def padded_size(self, batch_size: int) -> int | None:
        """Smallest capture size >= batch_size, or None if the batch is too large."""
        return next((s for s in self.batch_sizes if s >= batch_size), None)

    def can_run(self, meta: AttentionMetadata) -> bool:
        if not self._captured or not meta.is_decode:
            return False
        padded = self.padded_size(meta.batch_size)
        if padded is None or padded not in self._captured:
            return False
        return (int(meta.kv_indices.shape[0]) + padded - meta.batch_size <= self.buffers.kv_indices.shape[0]
                and max(meta.seq_lens_cpu, default=0) <= self.max_context_len)

    def capture(self) -> None:
        """Warm up and capture every batch size, largest first, sharing one memory pool."""
        for bs in sorted(self.batch_sizes, reverse=True):
            meta = self.buffers.meta(bs, self.capture_seq_len)
            self.buffers.fill_dummy(bs, self.pad_slot)
            entry = _Captured(meta=meta)
            if self.use_graphs:
                entry.graph, entry.output = self._capture_one(bs, meta)
            self._captured[bs] = entry

    def _capture_one(self, bs: int, meta: AttentionMetadata) -> tuple["torch.cuda.CUDAGraph", torch.Tensor]:
        ids, pos = self.buffers.input_ids[:bs], self.buffers.positions[:bs]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles Triton kernels, settles the allocator
                self.decode_fn(ids, pos, meta)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            output = self.decode_fn(ids, pos, meta)
        if self.graph_pool is None:
            self.graph_pool = graph.pool()
        torch.cuda.synchronize(self.device)
        return graph, output

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [B, ...] for a decode batch; check `can_run(meta)` first."""
        if not self.can_run(meta):
            raise ValueError(f"batch (size {meta.batch_size}, decode={meta.is_decode}) does not fit the captured "
                             f"graphs {self.captured_sizes}: call capture() first or run decode_fn directly")
        bs = meta.batch_size
        padded = self.padded_size(bs)
        assert padded is not None
        self.buffers.fill(padded, input_ids, positions, meta, self.pad_slot)
        entry = self._captured[padded]
        if entry.graph is not None:
            entry.graph.replay()
            assert entry.output is not None
            return entry.output[:bs]
        out = self.decode_fn(self.buffers.input_ids[:padded], self.buffers.positions[:padded], entry.meta)
        return out[:bs]
