"""The native mixture-of-experts kernels (kernels/csrc/moe.c): routing against torch's softmax and
top-k, the experts against a float64 reference on the same weights, and a row's bits independent
of its batch-mates (one token takes the chained path, more tokens the grouped one)."""

from __future__ import annotations

import pytest
import torch

from radix_backend.kernels import moe_experts, native, q4
from radix_backend.kernels.moe_experts import NativeExperts, SharedExpert

from test_decode_stack import random_q4, relative_error

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU kernels unavailable (no C compiler)")

EXPERTS, HIDDEN, INTERMEDIATE = 6, 64, 96


def _experts(seed: int = 0) -> tuple[NativeExperts, list[torch.Tensor], list[torch.Tensor]]:
    """Packed experts and their exact fp64 weights (gate|up [2I, H], down [H, I])."""
    gate_up, down, exact_gate_up, exact_down = [], [], [], []
    for e in range(EXPERTS):
        gate, up = random_q4(INTERMEDIATE, HIDDEN, seed + 3 * e), random_q4(INTERMEDIATE, HIDDEN, seed + 3 * e + 1)
        d = random_q4(HIDDEN, INTERMEDIATE, seed + 3 * e + 2)
        gate_up.append(q4.chain([q4.pack_q4(w.codes, w.scale, w.minimum) for w in (gate, up)]))
        down.append(q4.pack_q4(d.codes, d.scale, d.minimum))
        exact_gate_up.append(torch.cat([gate.dequantize(), up.dequantize()]).double())
        exact_down.append(d.dequantize().double())
    return NativeExperts(gate_up, down), exact_gate_up, exact_down


def _reference(x, ids, weights, gate_up, down) -> torch.Tensor:
    out = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].tolist()):
            g, u = (x[t].double() @ gate_up[e].t()).split(INTERMEDIATE)
            out[t] += w * ((torch.nn.functional.silu(g) * u) @ down[e].t())
    return out


def test_route_picks_torch_top_k_of_the_softmax():
    logits = torch.randn(9, EXPERTS, generator=torch.Generator().manual_seed(1))
    for renormalise in (False, True):
        ids, weights = moe_experts.route(logits, 2, renormalise)
        probs = torch.softmax(logits, -1)
        want_weights, want_ids = torch.topk(probs, 2, dim=-1)
        if renormalise:
            want_weights = want_weights / want_weights.sum(-1, keepdim=True)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="top_k"):
        moe_experts.route(logits, EXPERTS + 1, False)


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("threads", [1, 2])
def test_experts_compute_with_the_exact_weights(tokens, threads):
    experts, gate_up, down = _experts()
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    ids, weights = moe_experts.route(torch.randn(tokens, EXPERTS, generator=gen), 3, True)
    got = experts(x, ids, weights, threads=threads, activation_bits=16)
    assert relative_error(got, _reference(x, ids, weights, gate_up, down)) < 1e-4
    assert relative_error(experts(x, ids, weights, threads=threads, activation_bits=8),
                          _reference(x, ids, weights, gate_up, down)) < 3e-2


@pytest.mark.parametrize("bits", [8, 16])
def test_a_rows_bits_do_not_depend_on_its_batch_mates(bits):
    """One token runs its experts chained, several grouped by expert: the same bits per row."""
    experts, _, _ = _experts(seed=7)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, HIDDEN, generator=gen)
    ids, weights = moe_experts.route(torch.randn(4, EXPERTS, generator=gen), 2, False)
    batch = experts(x, ids, weights, threads=2, activation_bits=bits)
    for t in range(4):
        alone = experts(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], threads=2, activation_bits=bits)
        assert torch.equal(alone, batch[t:t + 1])


@pytest.mark.parametrize("tokens", [1, 5])
def test_the_shared_expert_adds_its_sigmoid_gated_mlp(tokens):
    """Qwen2-MoE's shared expert: out + sigmoid(gate . x) * down(silu(x gate) * (x up)), against float64
    on the same weights; a gate that is not one fp32 row is refused."""
    gate, up, down = (random_q4(INTERMEDIATE, HIDDEN, 40), random_q4(INTERMEDIATE, HIDDEN, 41),
                      random_q4(HIDDEN, INTERMEDIATE, 42))
    gen = torch.Generator().manual_seed(tokens)
    router = torch.randn(1, HIDDEN, generator=gen)
    shared = SharedExpert(q4.chain([q4.pack_q4(w.codes, w.scale, w.minimum) for w in (gate, up)]),
                          q4.pack_q4(down.codes, down.scale, down.minimum), q4.DenseWeight(router, None))
    x, out = torch.randn(tokens, HIDDEN, generator=gen), torch.randn(tokens, HIDDEN, generator=gen)
    xd = x.double()
    mlp = (torch.nn.functional.silu(xd @ gate.dequantize().double().t()) * (xd @ up.dequantize().double().t())
           ) @ down.dequantize().double().t()
    want = out.double() + torch.sigmoid(xd @ router.double().t()) * mlp
    assert relative_error(shared(out, x, threads=2, activation_bits=16), want) < 1e-4
    with pytest.raises(ValueError, match="one-row fp32 gate"):
        SharedExpert(shared.gate_up, shared.down, q4.DenseWeight(torch.randn(2, HIDDEN), None))


def test_bad_expert_ids_are_refused():
    experts, _, _ = _experts()
    x = torch.randn(2, HIDDEN)
    with pytest.raises(ValueError, match="expert ids"):
        experts(x, torch.tensor([[0, EXPERTS], [1, 2]]), torch.ones(2, 2))
    with pytest.raises(ValueError, match="ids and weights"):
        experts(x, torch.tensor([[0, 1]]), torch.ones(1, 2))
