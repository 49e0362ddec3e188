"""The screened LM head (kernels/head_screen.py): every row's argmax, and the value there, equal the
exact 16-bit head's, for every low-bit type, on this CPU's build and the AVX2 and portable ones."""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch

from radix_backend.kernels import ggml, head_screen, native, q4

from test_ggml_types import random_tensor

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels did not build here")
ROWS, COLS = 200, 256  # 200 outputs: packed to 208, the padding never picked


def head_and_inputs(kind: int, m: int = 19) -> tuple[q4.PackedQ4, torch.Tensor, int]:
    """A packed head of `kind` and activations with an outlier channel, row 0 aimed at one output
    whose weights are copied into the last real output (the two tie: the first must win), row 1
    at the output next to the padding, row 2 all negative (the padding's zeros must not win).
    Returns the head, the activations and the tied output."""
    t = random_tensor(kind, ROWS, COLS, seed=kind)
    g = torch.Generator().manual_seed(kind)
    x = torch.randn(m, COLS, generator=g)
    x[:, 7] *= 40.0  # an outlier channel, as real hidden states have
    weights = ggml.dequantize(t)
    x[0] = weights[40] * 3.0
    x[1] = weights[ROWS - 2] * 3.0
    x[2] = -x[2].abs() - 1.0
    tied = int((weights[:ROWS - 1].double() @ x[0].double()).argmax())
    t.data[ROWS - 1] = t.data[tied]
    return ggml.pack(t), x, tied


def check_screened(got: torch.Tensor, full: torch.Tensor) -> None:
    full = full[:, :ROWS]
    picks = full.argmax(1)
    assert torch.equal(got.argmax(1), picks)
    rows = torch.arange(full.shape[0])
    assert torch.equal(got[rows, picks], full[rows, picks])  # the maximum itself, bit for bit
    assert torch.equal(got.amax(1), full.amax(1))  # nothing else above it


@pytest.mark.parametrize("kind", ggml.LOW_BIT_TYPES, ids=ggml.type_name)
def test_argmax_equals_the_exact_head(kind):
    packed, x, tied = head_and_inputs(kind)
    full = q4.q4_matmul(x, packed, threads=2, activation_bits=16)
    for threads in (1, 2, 3):  # 3: more parts than the pool may run
        got = head_screen.ScreenedHead(packed, ROWS)(x, threads)
        assert got.shape == (x.shape[0], ROWS)
        check_screened(got, full)
    assert full[0, tied] == full[0, ROWS - 1] and full[0, :ROWS].argmax() == tied  # the tie was real


def test_rows_that_are_not_finite_pick_as_the_exact_head():
    """An infinite activation makes NaN outputs (the row is recomputed whole, so torch's argmax
    finds the same first NaN); a NaN one is quantized alike at 8 and 16 bits (the bound holds)."""
    packed, x, _ = head_and_inputs(ggml.Q8_0, m=4)
    x[1, 5] = float("nan")
    x[2, 9] = float("inf")
    full = q4.q4_matmul(x, packed, threads=2, activation_bits=16)[:, :ROWS]
    got = head_screen.ScreenedHead(packed, ROWS)(x, 2)
    assert full[2].isnan().any()
    torch.testing.assert_close(got[2], full[2], rtol=0, atol=0, equal_nan=True)  # every output exact
    assert torch.equal(got.argmax(1), full.argmax(1))


def test_the_bound_holds_for_every_output():
    """The 8-bit product is within the table's bound of the 16-bit one (what the screening rests
    on), and the bound is not vacuous: few blocks get recomputed."""
    packed, x, _ = head_and_inputs(ggml.Q4_K, m=32)
    head = head_screen.ScreenedHead(packed, ROWS)
    y8 = q4.q4_matmul(x, packed, activation_bits=8)[:, :ROWS]
    y16 = q4.q4_matmul(x, packed, activation_bits=16)[:, :ROWS]
    groups = COLS // 32
    table = head.table(1)[: (ROWS + 15) // 16]
    s8 = x.abs().view(x.shape[0], groups, 32).amax(-1) / 127
    per_group = table[:, 16:].repeat_interleave(16, 0)[:ROWS]  # the block's largest factor: looser than any row's
    bound = s8 @ per_group.T
    assert ((y8 - y16).abs() <= bound).all()
    got = head(x, 1)
    exact = (got == y16).view(x.shape[0], -1).sum(1).float().mean()
    assert exact < ROWS / 2


def test_wrong_inputs_are_refused():
    packed, x, _ = head_and_inputs(ggml.Q4_0, m=3)
    with pytest.raises(ValueError, match="x must be"):
        head_screen.ScreenedHead(packed, ROWS)(x[:, :128])
    with pytest.raises(ValueError, match="unchained"):
        head_screen.ScreenedHead(packed, packed.out_features + 1)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set variants")
@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_other_instruction_sets_screen_alike(tmp_path, march):
    flags = tuple(f"-march={march}" if f == "-march=native" else f for f in native.FLAGS)
    try:
        lib = native.declare(ctypes.CDLL(str(native.build(native._compiler(), tmp_path, flags))))
    except OSError as exc:
        pytest.skip(f"cannot load the {march} build here: {exc}")
    for kind in (ggml.Q4_1, ggml.Q6_K, ggml.Q5_K):
        packed, x, _ = head_and_inputs(kind)
        struct = ctypes.byref(packed.as_struct())
        full = torch.empty(x.shape[0], packed.out_features)
        assert lib.rb_q4_matmul(struct, x.data_ptr(), x.shape[0], full.data_ptr(), 2, 16) == 0
        table = torch.empty(packed.out_features // 16, 16 + COLS // 32)
        assert lib.rb_q4_screen_table(struct, table.data_ptr(), 2) == 0
        got = torch.empty(x.shape[0], packed.out_features)
        assert lib.rb_q4_screened(struct, table.data_ptr(), x.data_ptr(), x.shape[0], ROWS, got.data_ptr(), 2) == 0
        check_screened(got[:, :ROWS], full)
