"""GGUF tensor types on our kernels: decoding equals gguf's dequantizer bit for bit, the low-bit
matmul equals the float64 product of the dequantized weights within its activation format's error,
on this CPU's build and on the AVX2 and portable ones."""

from __future__ import annotations

import ctypes
import dataclasses
import platform

import numpy as np
import pytest
import torch

from radix_backend.kernels import ggml, native, q4, quant, weight_arena

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built here")

TYPES = [*ggml.LOW_BIT_TYPES, ggml.Q8_0, ggml.F16, ggml.BF16, ggml.F32]
# fp16 fields at these byte offsets of a block (the rest of a random block is any bits)
_HALF_FIELDS = {ggml.Q4_0: (0,), ggml.Q5_0: (0,), ggml.Q8_0: (0,), ggml.Q4_1: (0, 2), ggml.Q5_1: (0, 2),
                ggml.Q4_K: (0, 2), ggml.Q5_K: (0, 2), ggml.Q6_K: (208,)}


def random_tensor(kind: int, rows: int, cols: int, seed: int = 0) -> ggml.RawTensor:
    """A tensor of random blocks: every code, sub-scale and sign bit pattern occurs, with finite
    fp16 scales of weight-like size."""
    rng = np.random.default_rng(seed)
    if kind in ggml.FLOAT_TYPES:
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        if kind == ggml.F16:
            return ggml.RawTensor("w", kind, rows, cols, values.astype(np.float16).view(np.uint8))
        if kind == ggml.BF16:
            return ggml.RawTensor("w", kind, rows, cols, (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8))
        return ggml.RawTensor("w", kind, rows, cols, values.view(np.uint8))
    per, nbytes = ggml.BLOCK[kind]
    raw = rng.integers(0, 256, size=(rows, cols // per, nbytes), dtype=np.uint8)
    for at in _HALF_FIELDS[kind]:
        halfs = rng.uniform(-0.05, 0.05, size=(rows, cols // per)).astype(np.float16)
        raw[..., at:at + 2] = halfs.view(np.uint8).reshape(rows, cols // per, 2)
    return ggml.RawTensor("w", kind, rows, cols, raw.reshape(rows, -1))


def gguf_reference(t: ggml.RawTensor) -> torch.Tensor:
    values = gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(t.ggml_type))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(t.rows, t.cols))


@pytest.mark.parametrize("kind", TYPES, ids=ggml.type_name)
def test_dequantize_equals_gguf_bit_for_bit(kind):
    t = random_tensor(kind, 48, 512, seed=kind)
    assert torch.equal(ggml.dequantize(t), gguf_reference(t))
    rows = np.array([5, 0, 47, 5])  # an embedding lookup dequantizes only the rows it reads
    assert torch.equal(ggml.dequantize(t, rows), gguf_reference(t)[torch.from_numpy(rows)])


@pytest.mark.parametrize("kind", ggml.NATIVE_ROW_TYPES, ids=ggml.type_name)
def test_native_embedding_lookup_equals_gguf_bit_for_bit(kind):
    """An embedding lookup read by one native call (csrc/ggml_rows.c) gives gguf's values, for every
    fp16 bit pattern (subnormal, infinite and NaN scales and values included), and refuses an id
    outside the table as the numpy lookup does."""
    t = random_tensor(kind, 48, 512, seed=kind)
    if kind in (ggml.F16, ggml.Q8_0):  # every fp16 bit pattern once, as values or as block scales
        patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.uint8)
        if kind == ggml.F16:
            t = ggml.RawTensor("w", kind, 128, 512, patterns.reshape(128, 1024).copy())
        else:
            blocks = t.data.reshape(48, 16, 34).copy()
            blocks[..., :2] = patterns[:48 * 16 * 2].reshape(48, 16, 2)
            t = ggml.RawTensor("w", kind, 48, 512, blocks.reshape(48, -1))
    embedding = quant.GGUFEmbedding(t)
    ids = torch.tensor([[5, 0], [t.rows - 1, 5]])
    got = embedding(ids)
    want = gguf_reference(t)[ids]
    assert got.shape == (2, 2, 512)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # NaNs compared by their bits
    whole = embedding(torch.arange(t.rows))
    assert torch.equal(whole.view(torch.int32), gguf_reference(t).view(torch.int32))
    with pytest.raises(IndexError, match="outside the"):
        embedding(torch.tensor([t.rows]))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.parametrize("kind", ggml.LOW_BIT_TYPES, ids=ggml.type_name)
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 300])
def test_low_bit_matmul_matches_float64(kind, rows):
    t = random_tensor(kind, 64, 512, seed=kind)
    packed = q4.pack(ggml.group_codes(t), bias=torch.randn(64))
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    want = x.double() @ gguf_reference(t).double().T + packed.bias.double()
    assert relative_error(q4.q4_matmul(x, packed, threads=2), want) < 1e-4  # 16-bit activations: ~2e-5
    assert relative_error(q4.q4_matmul(x, packed, threads=1, activation_bits=8), want) < 1.5e-2  # 8-bit: ~5e-3


@pytest.mark.parametrize("kind", ggml.LOW_BIT_TYPES, ids=ggml.type_name)
def test_a_rows_output_does_not_depend_on_its_batch_mates(kind):
    """Row r's outputs are the same bits alone, in a partial tile, and in any tile of the 8-row
    layout (q4.h's q4_group_index; one row keeps a layout of its own), on 1 or 2 threads, and
    whether or not its tile reuses the quads an earlier tile of the chunk kept (the 19 rows take
    three tiles: q4_matmul.c's keeps_codes; the parts take at most two)."""
    t = random_tensor(kind, 48, 512, seed=kind)
    packed = q4.pack(ggml.group_codes(t))
    gen = torch.Generator().manual_seed(kind)
    x = torch.randn(19, 512, generator=gen) * torch.rand(19, 1, generator=gen) * 8
    x[:, 64:96], x[4] = 0.0, 0.0  # groups whose largest value is 0 (an 8-row tile's path and a single row's)
    for bits in (8, 16):
        whole = q4.q4_matmul(x, packed, threads=2, activation_bits=bits)
        for start, count in ((0, 1), (11, 1), (3, 2), (5, 9), (8, 11)):
            for threads in (1, 2):
                part = q4.q4_matmul(x[start:start + count], packed, threads=threads, activation_bits=bits)
                assert torch.equal(part, whole[start:start + count]), (ggml.type_name(kind), bits, start, count)


@pytest.mark.parametrize("kind", [ggml.Q4_1, ggml.Q6_K], ids=ggml.type_name)
def test_threads_share_the_work_units_of_a_matmul(kind):
    """The threads split a matmul into units (row chunks x runs of blocks, thread_pool.h's rb_units)
    and take each other's once theirs are done: any thread count, more than the cores included,
    writes every output once with the bits of one thread (prefill-sized rows span two row chunks)."""
    t = random_tensor(kind, 1024, 256, seed=3)
    packed = q4.pack(ggml.group_codes(t))
    want64 = gguf_reference(t).double()
    for rows in (1, 9, 300):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        one = q4.q4_matmul(x, packed, threads=1)
        assert relative_error(one, x.double() @ want64.T) < 1e-4
        for threads in (2, 3, 7):
            assert torch.equal(q4.q4_matmul(x, packed, threads=threads), one), (rows, threads)
            glu = q4.q4_glu(x, packed, 512, "silu", threads=threads)
            assert torch.equal(glu, q4.q4_glu(x, packed, 512, "silu", threads=1)), (rows, threads)
    assert q4.q4_matmul(torch.zeros(0, 256), packed, threads=2).shape == (0, 1024)


def _gate_up(kinds: tuple[int, int], half: int = 64, cols: int = 512) -> q4.PackedQ4:
    """A gate-then-up chain of two low-bit weights (the up half with a bias), each padded to whole
    16-row blocks."""
    return q4.chain([q4.pack(q4.pad_rows(ggml.group_codes(random_tensor(kind, half, cols, seed=kind + 7 * i))),
                             bias=torch.randn(-(-half // 16) * 16, generator=torch.Generator().manual_seed(i)) if i else None)
                     for i, kind in enumerate(kinds)])


@pytest.mark.parametrize("kinds", [(ggml.Q4_1, ggml.Q4_1), (ggml.Q5_0, ggml.Q6_K), (ggml.Q4_K, ggml.Q8_0)],
                         ids=lambda ks: "+".join(map(ggml.type_name, ks)))
def test_gated_mlp_pass_equals_the_matmul_then_the_activation(kinds):
    """q4_glu (the gate and up products and the activation in one pass) gives the bits of the
    matmul over the chain followed by the activation kernel, for any rows, threads, activation
    format and gate."""
    w = _gate_up(kinds)
    for rows in (1, 3, 8, 17, 300):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        for bits in (8, 16):
            for threads in (1, 2):
                both = q4.q4_matmul(x, w, threads=threads, activation_bits=bits)
                for activation, kernel in (("silu", native.silu_and_mul), ("gelu_tanh", native.gelu_tanh_and_mul)):
                    got = q4.q4_glu(x, w, 64, activation, threads=threads, activation_bits=bits)
                    assert torch.equal(got, kernel(both)), (rows, bits, threads, activation)


def test_gated_mlp_pass_declines_what_it_cannot_split():
    """Halves off a 16-row block boundary, or a size that is not the chain's, leave the caller the
    two-step path (None), never a wrong split."""
    x = torch.randn(4, 512)
    assert q4.q4_glu(x, _gate_up((ggml.Q4_1, ggml.Q4_1)), 48, "silu") is None
    assert q4.q4_glu(x, _gate_up((ggml.Q4_1, ggml.Q4_1), half=40), 40, "silu") is None


def test_chained_weights_of_mixed_types_equal_separate_calls():
    """A fused q/k/v whose parts have different types (Q4_K_M files) runs as one chained call."""
    parts = [q4.pack(ggml.group_codes(random_tensor(kind, n, 256, seed=n)))
             for kind, n in ((ggml.Q4_K, 64), (ggml.Q4_0, 32), (ggml.Q6_K, 32))]
    x = torch.randn(5, 256)
    separate = torch.cat([q4.q4_matmul(x, p) for p in parts], dim=1)
    fused = q4.chain(parts)
    assert fused.total_out == 128
    torch.testing.assert_close(q4.q4_matmul(x, fused, threads=2), separate, rtol=0, atol=0)


def test_rows_padded_to_blocks_of_16():
    t = random_tensor(ggml.Q6_K, 40, 256)
    packed = q4.pack(q4.pad_rows(ggml.group_codes(t)))
    x = torch.randn(2, 256)
    got = q4.q4_matmul(x, packed)[:, :40]
    assert relative_error(got, x.double() @ gguf_reference(t).double().T) < 1e-4
    assert torch.count_nonzero(q4.q4_matmul(x, packed)[:, 40:]) == 0


PACKED_FIELDS = ("codes", "params", "high", "super")


@pytest.mark.parametrize("kind", ggml.LOW_BIT_TYPES, ids=ggml.type_name)
@pytest.mark.parametrize("rows", [16, 40, 300])
def test_native_packer_equals_the_numpy_codes_packed(kind, rows):
    """A load decodes and packs the file's blocks natively (csrc/q4_pack.c, rows padded to 16):
    byte for byte what the numpy decoder's codes give through the codes packer, inside an arena
    small enough that the tensors span several chunks."""
    t = random_tensor(kind, rows, 512, seed=rows + kind)
    want = q4.pack(q4.pad_rows(ggml.group_codes(t)), bias=torch.ones(-rows % 16 + rows))
    with weight_arena.active(weight_arena.WeightArena(chunk_bytes=4096)):
        got = ggml.pack(t, bias=torch.ones(-rows % 16 + rows))
    for name in PACKED_FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        assert a is None or torch.equal(a, b), f"{ggml.type_name(kind)}: {name} differs"
    x = torch.randn(3, 512)
    assert torch.equal(q4.q4_matmul(x, got), q4.q4_matmul(x, want))


def test_q8_0_codes_of_minus_128_stay_exact():
    """A Q8_0 code of -128 (valid in the format, never written by llama.cpp) keeps exact products: it
    runs on the low-bit kernel where the build multiplies it exactly, else on the 8-bit kernel."""
    from radix_backend.kernels.quant import GGUFLinear

    t = random_tensor(ggml.Q8_0, 32, 256, seed=5)
    codes = ggml.group_codes(t)
    assert int(codes.codes.min()) == 0  # random blocks hold every code, -128 included
    exact = ggml.multiplies_exactly(t)
    assert exact == (native.library().rb_q4_smallest_8bit_code() == 0)
    blocks = t.blocks().copy()
    blocks[..., 2:][blocks[..., 2:] == 0x80] = 0x81  # no code of -128 left
    assert ggml.multiplies_exactly(dataclasses.replace(t, data=blocks.reshape(t.rows, -1)))
    layer = GGUFLinear([t])
    assert (layer.native_q4 is not None) == exact
    x = torch.randn(3, 256)
    assert relative_error(layer(x), x.double() @ gguf_reference(t).double().T) < 1.5e-2


def test_unsupported_type_is_named():
    with pytest.raises(ggml.UnsupportedTensorType, match="IQ2_XXS.*supported GGUF tensor types: F32"):
        ggml.check_supported(16, "blk.0.attn_q.weight")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set variants")
@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_other_instruction_sets_compute_the_same(tmp_path, march):
    """The AVX2-without-VNNI (haswell) and portable (x86-64) builds give this machine's results for
    every low-bit type and both activation formats, and each build gives a row the same bits alone
    as among 9 rows (three of the AVX2 build's 4-row tiles, whose chunk keeps the quads it unpacked:
    q4_matmul.c's keeps_codes)."""
    flags = tuple(f"-march={march}" if f == "-march=native" else f for f in native.FLAGS)
    try:
        lib = native.declare(ctypes.CDLL(str(native.build(native._compiler(), tmp_path, flags))))
    except OSError as exc:
        pytest.skip(f"cannot load the {march} build here: {exc}")
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(3))
    for kind in ggml.LOW_BIT_TYPES:
        codes = ggml.group_codes(random_tensor(kind, 32, 256, seed=kind))
        if kind == ggml.Q8_0:  # -128 (unsigned 0), which llama.cpp never writes: not multiplied exactly everywhere
            assert lib.rb_q4_smallest_8bit_code() == (1 if march == "haswell" else 0)
            codes.codes.clamp_(min=1)
        packed = q4.pack(codes, bias=torch.randn(32))
        got = torch.empty(9, 32)
        for bits in (16, 8):
            assert lib.rb_q4_matmul(ctypes.byref(packed.as_struct()), x.data_ptr(), 9, got.data_ptr(), 2, bits) == 0
            want = q4.q4_matmul(x, packed, activation_bits=bits)  # float sums in another order only
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()),
                                       msg=f"{ggml.type_name(kind)}, {bits}-bit activations")
            alone = torch.empty(1, 32)
            for row in (0, 8):
                one = x[row:row + 1].contiguous()
                assert lib.rb_q4_matmul(ctypes.byref(packed.as_struct()), one.data_ptr(), 1, alone.data_ptr(), 2, bits) == 0
                assert torch.equal(alone[0], got[row]), (ggml.type_name(kind), bits, row)
    w = _gate_up((ggml.Q5_0, ggml.Q6_K), cols=256)  # the gated MLP pass equals that build's two steps
    both, act, want = torch.empty(9, 128), torch.empty(9, 64), torch.empty(9, 64)
    assert lib.rb_q4_matmul(ctypes.byref(w.as_struct()), x.data_ptr(), 9, both.data_ptr(), 2, 8) == 0
    lib.rb_silu_and_mul_threads(both.data_ptr(), 9, 64, want.data_ptr(), 2)
    assert lib.rb_q4_glu(ctypes.byref(w.as_struct()), x.data_ptr(), 9, act.data_ptr(), 2, 8, 0) == 0
    assert torch.equal(act, want)


def test_native_packer_refuses_blocks_of_the_wrong_size():
    t = random_tensor(ggml.Q4_K, 32, 512)
    short = dataclasses.replace(t, data=t.data[:, :-1])
    with pytest.raises(ValueError, match="do not hold 32 x 512 Q4_K weights"):
        ggml.pack(short)
