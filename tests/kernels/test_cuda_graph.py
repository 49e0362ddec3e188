"""CudaGraphDecodeRunner: padding to captured sizes (eager on CPU), graph capture/replay on CUDA."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from radix_backend.kernels.attention_base import AttentionMetadata
from radix_backend.kernels.cuda_graph import CudaGraphDecodeRunner, default_batch_sizes
from radix_backend.kernels.torch_backend import TorchAttentionBackend

HAS_CUDA = torch.cuda.is_available()


class TinyDecoder:
    """One attention layer over a KV cache: enough to see every padded buffer's effect on logits."""

    def __init__(self, backend, device="cpu", vocab=50, hq=4, hkv=2, dim=16, slots=200, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.backend, self.hq, self.hkv, self.dim = backend, hq, hkv, dim
        self.embed = torch.randn(vocab, hq * dim, generator=g).to(device)
        self.pos_embed = torch.randn(512, hq * dim, generator=g).to(device)
        self.wkv = torch.randn(hq * dim, 2 * hkv * dim, generator=g).to(device) / 8
        self.out = torch.randn(hq * dim, vocab, generator=g).to(device) / 8
        self.k_cache = torch.randn(slots, hkv, dim, generator=g).to(device)
        self.v_cache = torch.randn(slots, hkv, dim, generator=g).to(device)

    def __call__(self, input_ids, positions, meta):
        h = self.embed[input_ids] + self.pos_embed[positions]
        k, v = (h @ self.wkv).split(self.hkv * self.dim, dim=-1)
        n = h.shape[0]
        self.backend.begin_forward(meta)
        o = self.backend.forward(h.view(n, self.hq, self.dim), k.reshape(n, self.hkv, self.dim),
                                 v.reshape(n, self.hkv, self.dim), self.k_cache, self.v_cache, meta, 0.25)
        return o.reshape(n, -1) @ self.out


def decode_batch(seq_lens: list[int], device="cpu", seed=1):
    """Decode batch whose sequences use distinct slots >= 1 (slot 0 is the padding slot)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    slots = torch.randperm(150, generator=g)[:total] + 1
    ends = torch.tensor(seq_lens).cumsum(0) - 1
    meta = AttentionMetadata.build([s - 1 for s in seq_lens], [1] * len(seq_lens), slots.to(device),
                                   slots[ends].to(device), device)
    ids = torch.randint(0, 50, (len(seq_lens),), generator=g).to(device)
    pos = torch.tensor([s - 1 for s in seq_lens]).to(device)
    return ids, pos, meta


def test_default_batch_sizes() -> None:
    assert default_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert default_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert default_batch_sizes(1) == [1]
    with pytest.raises(ValueError):
        default_batch_sizes(0)


@pytest.mark.parametrize("seq_lens", [[5], [3, 9, 1], [7, 2, 11, 4, 6]])
def test_padded_eager_path_matches_direct_call(seq_lens) -> None:
    direct_model = TinyDecoder(TorchAttentionBackend())
    padded_model = TinyDecoder(TorchAttentionBackend())
    runner = CudaGraphDecodeRunner(padded_model, max_batch_size=8, max_kv_tokens=200, device="cpu",
                                   max_context_len=64)
    runner.capture()
    ids, pos, meta = decode_batch(seq_lens)
    assert runner.can_run(meta)
    got = runner.run(ids, pos, meta)
    ref = direct_model(ids, pos, meta)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # Real slots got the same K/V; padding only ever wrote the reserved slot 0.
    torch.testing.assert_close(padded_model.k_cache[1:], direct_model.k_cache[1:])
    torch.testing.assert_close(padded_model.v_cache[1:], direct_model.v_cache[1:])


def test_runs_several_batches_through_the_same_buffers() -> None:
    model, ref_model = TinyDecoder(TorchAttentionBackend()), TinyDecoder(TorchAttentionBackend())
    runner = CudaGraphDecodeRunner(model, max_batch_size=4, max_kv_tokens=200, device="cpu", max_context_len=64)
    runner.capture()
    for seed, lens in enumerate([[4, 4, 4, 4], [9], [2, 30, 5]]):
        ids, pos, meta = decode_batch(lens, seed=seed)
        torch.testing.assert_close(runner.run(ids, pos, meta), ref_model(ids, pos, meta), rtol=1e-5, atol=1e-5)


def test_can_run_rejects_what_does_not_fit() -> None:
    runner = CudaGraphDecodeRunner(TinyDecoder(TorchAttentionBackend()), max_batch_size=4, max_kv_tokens=40,
                                   device="cpu", max_context_len=32)
    _, _, small = decode_batch([3, 4])
    assert not runner.can_run(small)  # nothing captured yet
    runner.capture()
    assert runner.captured_sizes == [1, 2, 4] and runner.can_run(small)
    assert runner.padded_size(3) == 4 and runner.padded_size(5) is None
    assert not runner.can_run(decode_batch([2] * 5)[2])  # batch too large
    assert not runner.can_run(decode_batch([33])[2])  # longer than max_context_len
    assert not runner.can_run(decode_batch([20, 20, 20])[2])  # kv tokens exceed the buffer
    extend = AttentionMetadata.build([0], [3], torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3]), "cpu")
    assert not runner.can_run(extend)
    with pytest.raises(ValueError, match="does not fit"):
        runner.run(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), extend)


def test_graphs_need_cuda() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        CudaGraphDecodeRunner(lambda *a: None, max_batch_size=2, max_kv_tokens=8, device="cpu", use_graphs=True)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and importlib.util.find_spec("triton")), reason="needs CUDA and triton")
@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_cuda_graph_replay_matches_eager(backend_name) -> None:
    from radix_backend.kernels import create_attention_backend
    model = TinyDecoder(create_attention_backend(backend_name, "cuda"), device="cuda")
    ref_model = TinyDecoder(create_attention_backend(backend_name, "cuda"), device="cuda")
    runner = CudaGraphDecodeRunner(model, max_batch_size=8, max_kv_tokens=200, device="cuda", max_context_len=64)
    runner.capture()
    for seed, lens in enumerate([[5, 9, 3], [40], [1, 2, 3, 4, 5, 6, 7, 8]]):
        ids, pos, meta = decode_batch(lens, device="cuda", seed=seed)
        got = runner.run(ids, pos, meta).clone()
        torch.testing.assert_close(got, ref_model(ids, pos, meta), rtol=1e-4, atol=1e-4)
