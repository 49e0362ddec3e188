"""Fused ops: torch paths vs plain formulas and HF Llama modules.

The Triton versions are checked against these torch versions in test_kernels_triton.py (under
TRITON_INTERPRET=1 in a subprocess, or compiled on CUDA).
"""

from __future__ import annotations


import pytest
import torch

from radix_backend.kernels import ops


# ----------------------------------------------------------------------------- torch vs formulas

@pytest.mark.parametrize("rows", [0, 1, 17, 300])
def test_linear_is_the_fp32_product_on_every_route(rows) -> None:
    """fp32 on the CPU takes oneDNN where torch has it (a different kernel than F.linear's BLAS);
    both, and the bf16 route, give the product within their format's rounding."""
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 3, 96, generator=g), torch.randn(40, 96, generator=g), torch.randn(40, generator=g)
    want = x.double() @ w.double().t() + b.double()
    got = ops.linear(x, w, b)
    assert got.shape == (rows, 3, 40) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ops.linear(x, w.t().contiguous().t()).double(), want - b.double(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ops.linear(x.bfloat16(), w.bfloat16()).double(), want - b.double(), rtol=0.05, atol=0.3)
    assert ops.onednn_linear_available() == (torch.backends.mkldnn.is_available()
                                             and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def test_rms_norm_matches_formula() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, 64, generator=g)
    w = torch.randn(64, generator=g)
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), expected, rtol=1e-5, atol=1e-6)


def test_fused_add_rms_norm_returns_sum_and_norm() -> None:
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(6, 32, generator=g), torch.randn(6, 32, generator=g)
    w = torch.rand(32, generator=g)
    x0, r0 = x.clone(), r.clone()
    normed, new_res = ops.fused_add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(new_res, x0 + r0)
    torch.testing.assert_close(normed, ops.rms_norm(x0 + r0, w, 1e-6))
    assert torch.equal(x, x0) and torch.equal(r, r0), "inputs must not be modified"


def test_silu_and_mul_matches_formula() -> None:
    x = torch.randn(4, 3, 10)
    gate, up = x[..., :5], x[..., 5:]
    torch.testing.assert_close(ops.silu_and_mul(x), gate * torch.sigmoid(gate) * up)
    with pytest.raises(ValueError, match="even"):
        ops.silu_and_mul(torch.randn(2, 3))


def test_rotary_matches_complex_rotation() -> None:
    """Neox RoPE is a complex rotation of (x1 + i x2) by angle pos * inv_freq."""
    g = torch.Generator().manual_seed(2)
    dim, base = 16, 500.0
    cache = ops.build_cos_sin_cache(ops.default_inv_freq(dim, base), max_pos=40)
    q, k = torch.randn(6, 3, dim, generator=g), torch.randn(6, 1, dim, generator=g)
    pos = torch.tensor([0, 1, 5, 17, 39, 2])
    q2, k2 = ops.apply_rotary(q, k, pos, cache)
    inv = 1.0 / base ** (torch.arange(0, dim, 2).float() / dim)
    angle = pos[:, None, None].float() * inv
    for x, y in ((q, q2), (k, k2)):
        z = torch.complex(x[..., : dim // 2], x[..., dim // 2:]) * torch.polar(torch.ones_like(angle), angle)
        torch.testing.assert_close(y, torch.cat([z.real, z.imag], -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q2[0], q[0])  # position 0 is the identity


def test_partial_rotary_passes_tail_through() -> None:
    cache = ops.build_cos_sin_cache(ops.default_inv_freq(8), max_pos=10)
    q, k = torch.randn(3, 2, 12), torch.randn(3, 2, 12)
    pos = torch.tensor([1, 2, 3])
    q2, k2 = ops.apply_rotary(q, k, pos, cache)
    assert torch.equal(q2[..., 8:], q[..., 8:]) and torch.equal(k2[..., 8:], k[..., 8:])
    full_q, _ = ops.apply_rotary(q[..., :8].contiguous(), k[..., :8].contiguous(), pos, cache)
    torch.testing.assert_close(q2[..., :8], full_q)


def test_bad_arguments_raise_value_error() -> None:
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm(torch.randn(2, 8), torch.randn(7))
    with pytest.raises(ValueError, match="residual"):
        ops.fused_add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8))
    cache = ops.build_cos_sin_cache(ops.default_inv_freq(8), 4)
    with pytest.raises(ValueError, match="rot_dim"):
        ops.apply_rotary(torch.randn(2, 1, 4), torch.randn(2, 1, 4), torch.tensor([0, 1]), cache)
    with pytest.raises(ValueError, match="positions"):
        ops.apply_rotary(torch.randn(2, 1, 8), torch.randn(2, 1, 8), torch.tensor([0]), cache)


# ----------------------------------------------------------------------------- torch vs HF

def _llama_config(**kw):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                       num_hidden_layers=1, vocab_size=32, max_position_embeddings=64, **kw)


def test_rms_norm_matches_hf_llama_rmsnorm() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    for dtype in (torch.float32, torch.bfloat16):
        norm = LlamaRMSNorm(64, eps=1e-5).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(64))
        x = torch.randn(3, 5, 64).to(dtype)
        expected = norm(x)
        # the torch path is HF's arithmetic, bit for bit; the native CPU kernel (fp32) sums the
        # squares in another order: within a float rounding of it
        torch.testing.assert_close(ops.rms_norm_torch(x, norm.weight.detach(), 1e-5), expected, rtol=0, atol=0)
        got = ops.rms_norm(x, norm.weight.detach(), 1e-5)
        assert got.dtype == dtype
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16}])
def test_rotary_matches_hf_llama(rope_scaling) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    kw = {"rope_theta": 10000.0} if rope_scaling is None else {"rope_scaling": dict(rope_scaling, rope_theta=10000.0)}
    config = _llama_config(**kw)
    rope = LlamaRotaryEmbedding(config)
    head_dim = 16
    T = 9
    q, k = torch.randn(T, 4, head_dim), torch.randn(T, 2, head_dim)
    pos = torch.tensor([0, 3, 4, 10, 20, 33, 50, 63, 7])
    cos, sin = rope(q, pos[None])  # [1, T, D]
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    cache = ops.build_cos_sin_cache(rope.inv_freq, 64, attention_scaling=rope.attention_scaling)
    q2, k2 = ops.apply_rotary(q, k, pos, cache)
    torch.testing.assert_close(q2, q_hf[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k2, k_hf[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_silu_and_mul_matches_hf_llama_mlp() -> None:
    from transformers.models.llama.modeling_llama import LlamaMLP
    mlp = LlamaMLP(_llama_config()).eval()
    x = torch.randn(4, 64)
    with torch.no_grad():
        gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], -1)
        torch.testing.assert_close(mlp.down_proj(ops.silu_and_mul(gate_up)), mlp(x), rtol=1e-5, atol=1e-6)


def test_the_kernel_settings_keep_triton_off(monkeypatch) -> None:
    from types import SimpleNamespace

    from radix_backend.kernels import settings

    monkeypatch.setattr(ops, "triton_available", lambda: True)
    cuda_tensor, cpu_tensor = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)
    assert ops._use_triton(cuda_tensor) and not ops._use_triton(cpu_tensor)
    with settings.overridden(triton_ops=False):
        assert not ops._use_triton(cuda_tensor)
    assert ops._use_triton(cuda_tensor)
