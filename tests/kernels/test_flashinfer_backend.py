"""FlashInfer backend planning (page tables, shared-prefix cascade) on CPU, real FlashInfer on CUDA.

FlashInfer needs CUDA, so on CPU the backend runs against a small torch stand-in written from
FlashInfer's documented semantics (NHD paged KV, last_page_len, bottom-right aligned causal mask,
cascade levels merged by log-sum-exp). That checks everything this project computes: the page
tables it derives from the radix slot lists, the shared-prefix split and the plan arguments.
The stand-in's constructors and plan() methods take exactly the parameter names of
flashinfer-python 0.7.4 (checked against its source) and no catch-all, so a misspelled or
removed argument fails here rather than on the first GPU run.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import types

import pytest
import torch

from radix_backend.kernels.attention_base import AttentionMetadata
from radix_backend.kernels.torch_backend import TorchAttentionBackend

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
HAS_CUDA = torch.cuda.is_available()


# ----------------------------------------------------------------------------- FlashInfer stand-in

class _FakePrefill:
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False):
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        self.plan_args = None

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None,
             causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking=True):
        assert isinstance(q_data_type, torch.dtype) and isinstance(kv_data_type, torch.dtype)
        for t in (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len):
            assert t.dtype == torch.int32
        assert ((paged_kv_last_page_len >= 1) & (paged_kv_last_page_len <= page_size)).all()
        self.plan_args = dict(qo=qo_indptr.tolist(), indptr=paged_kv_indptr.tolist(),
                              indices=paged_kv_indices.tolist(), last=paged_kv_last_page_len.tolist(),
                              hq=num_qo_heads, hkv=num_kv_heads, dim=head_dim_qk, ps=page_size, causal=causal,
                              scale=sm_scale if sm_scale is not None else head_dim_qk ** -0.5)

    def run(self, q, paged_kv, return_lse=False):
        a = self.plan_args
        k_pages, v_pages = paged_kv
        assert k_pages.shape[1:] == (a["ps"], a["hkv"], a["dim"])
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32)
        group = a["hq"] // a["hkv"]
        for b in range(len(a["qo"]) - 1):
            pages = a["indices"][a["indptr"][b]:a["indptr"][b + 1]]
            kv_len = (len(pages) - 1) * a["ps"] + a["last"][b]
            keys = k_pages[pages].reshape(-1, a["hkv"], a["dim"])[:kv_len].float().repeat_interleave(group, 1)
            vals = v_pages[pages].reshape(-1, a["hkv"], a["dim"])[:kv_len].float().repeat_interleave(group, 1)
            qb = q[a["qo"][b]:a["qo"][b + 1]].float()
            scores = torch.einsum("qhd,khd->hqk", qb, keys) * a["scale"]
            if a["causal"]:
                qo_len = qb.shape[0]
                allowed = torch.arange(kv_len)[None, :] <= (kv_len - qo_len + torch.arange(qo_len))[:, None]
                scores = scores.masked_fill(~allowed, float("-inf"))
            lse[a["qo"][b]:a["qo"][b + 1]] = torch.logsumexp(scores, -1).transpose(0, 1)
            out[a["qo"][b]:a["qo"][b + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals).to(q.dtype)
        return (out, lse) if return_lse else out


class _FakeDecode(_FakePrefill):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph)
        self.use_tensor_cores = use_tensor_cores

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, o_data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
             non_blocking=True):
        qo = torch.arange(indptr.shape[0], dtype=torch.int32)
        super().plan(qo, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                     causal=False, sm_scale=sm_scale, q_data_type=q_data_type, kv_data_type=kv_data_type)


class _FakeCascade:
    def __init__(self, num_levels, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False):
        self.levels = [_FakePrefill(float_workspace_buffer, kv_layout) for _ in range(num_levels)]
        self.planned_with = None

    def plan(self, qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim, page_size, causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False,
             sm_scale=None, window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
             q_data_type="float16", kv_data_type=None):
        self.planned_with = [t.tolist() for t in qo_indptr_arr]
        for i, lvl in enumerate(self.levels):
            lvl.plan(qo_indptr_arr[i], paged_kv_indptr_arr[i], paged_kv_indices_arr[i], paged_kv_last_page_len[i],
                     num_qo_heads, num_kv_heads, head_dim, page_size,
                     causal=causal if i == len(self.levels) - 1 else False, sm_scale=sm_scale,
                     q_data_type=q_data_type, kv_data_type=kv_data_type)

    def run(self, q, paged_kv):
        out, lse = self.levels[-1].run(q, paged_kv, return_lse=True)
        out = out.float()
        for lvl in self.levels[:-1]:
            o2, l2 = lvl.run(q, paged_kv, return_lse=True)
            m = torch.maximum(lse, l2)
            w1, w2 = torch.exp(lse - m), torch.exp(l2 - m)
            out = (out * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]
            lse = m + torch.log(w1 + w2)
        return out.to(q.dtype)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    mod = types.ModuleType("flashinfer")
    mod.BatchPrefillWithPagedKVCacheWrapper = _FakePrefill
    mod.BatchDecodeWithPagedKVCacheWrapper = _FakeDecode
    mod.MultiLevelCascadeAttentionWrapper = _FakeCascade
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    return mod


# ----------------------------------------------------------------------------- batches

def paged_batch(prefix_lens, extend_lens, page_size, hq=4, hkv=2, dim=16, shared=0, seed=0,
                dtype=torch.float32, device="cpu"):
    """Requests on whole pages (page 0 reserved); the first `shared` tokens use the same pages."""
    g = torch.Generator().manual_seed(seed)
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    assert shared % page_size == 0
    pages_needed = sum(math.ceil((s - shared) / page_size) for s in seq) + shared // page_size
    num_pages = pages_needed + 3
    free = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()  # page 0 is the padding page
    shared_pages = [free.pop() for _ in range(shared // page_size)]
    kv, out = [], []
    for p, s in zip(prefix_lens, seq):
        own = [free.pop() for _ in range(math.ceil((s - shared) / page_size))]
        slots = [pg * page_size + o for pg in shared_pages + own for o in range(page_size)][:s]
        kv += slots
        out += slots[p:]
    meta = AttentionMetadata.build(prefix_lens, extend_lens, torch.tensor(kv, device=device),
                                   torch.tensor(out, device=device), device)
    rows = num_pages * page_size
    t = sum(extend_lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)
    return rnd(t, hq, dim), rnd(t, hkv, dim), rnd(t, hkv, dim), rnd(rows, hkv, dim), rnd(rows, hkv, dim), meta


def check_against_torch(backend, batch, atol=1e-5):
    q, k, v, kc, vc, meta = batch
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref = TorchAttentionBackend().forward(q, k, v, kc_ref, vc_ref, meta, 0.3)
    backend.begin_forward(meta)
    for _layer in range(2):  # planned once, reused by every layer
        out = backend.forward(q, k, v, kc, vc, meta, 0.3)
        torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)
    assert torch.equal(kc, kc_ref)


# ----------------------------------------------------------------------------- tests

def test_missing_flashinfer_raises_import_error_with_pip_command(monkeypatch) -> None:
    from radix_backend.kernels.flashinfer_backend import FlashInferAttentionBackend
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    with pytest.raises(ImportError, match="pip install flashinfer-python"):
        FlashInferAttentionBackend(device="cpu")


def test_build_page_table_page_size_1_and_4() -> None:
    from radix_backend.kernels.flashinfer_backend import build_page_table
    kv_indptr = torch.tensor([0, 3, 9])
    kv_indices = torch.tensor([5, 6, 7, 20, 21, 22, 23, 8, 9])
    t1 = build_page_table(kv_indptr, kv_indices, [3, 6], 1)
    assert t1.indptr.tolist() == [0, 3, 9] and t1.indices.tolist() == kv_indices.tolist()
    assert t1.last_page_len.tolist() == [1, 1]
    t4 = build_page_table(kv_indptr, kv_indices, [3, 6], 4)  # slots 20..23 = page 5, 8..9 = page 2
    assert t4.indptr.tolist() == [0, 1, 3] and t4.indices.tolist() == [1, 5, 2]
    assert t4.last_page_len.tolist() == [3, 2]
    tail = build_page_table(kv_indptr, kv_indices, [3, 6], 4, starts=[0, 4])
    assert tail.indices.tolist() == [1, 2] and tail.last_page_len.tolist() == [3, 2]
    with pytest.raises(ValueError, match="page-aligned"):
        build_page_table(kv_indptr, kv_indices, [3, 6], 4, starts=[0, 2])


def test_check_page_layout() -> None:
    from radix_backend.kernels.flashinfer_backend import check_page_layout
    *_, meta = paged_batch([6, 13], [1, 3], 4, seed=2)
    check_page_layout(meta.kv_indptr, meta.kv_indices, meta.seq_lens_cpu, 4)  # valid
    broken = meta.kv_indices.clone()
    broken[[1, 2]] = broken[[2, 1]]  # two tokens swapped inside a page
    with pytest.raises(ValueError, match="page layout"):
        check_page_layout(meta.kv_indptr, broken, meta.seq_lens_cpu, 4)


def test_shared_prefix_len_detection() -> None:
    from radix_backend.kernels.flashinfer_backend import shared_prefix_len
    *_, meta = paged_batch([40, 37, 52], [1, 1, 1], 1, shared=30)
    assert shared_prefix_len(meta, 1, 8) >= 30
    assert shared_prefix_len(meta, 1, 38) == 0  # shortest prefix (37) is below min_len
    *_, meta = paged_batch([40, 37, 52], [2, 1, 3], 4, shared=32)
    assert shared_prefix_len(meta, 4, 8) == 32
    *_, meta = paged_batch([40, 37, 52], [1, 1, 1], 1, shared=0)
    assert shared_prefix_len(meta, 1, 1) == 0


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("decode", [True, False])
def test_backend_matches_torch_with_fake_flashinfer(fake_flashinfer, page_size: int, decode: bool) -> None:
    from radix_backend.kernels.flashinfer_backend import FlashInferAttentionBackend
    extend = [1, 1, 1] if decode else [5, 1, 9]
    backend = FlashInferAttentionBackend(device="cpu", page_size=page_size, workspace_mb=1, debug_checks=True)
    check_against_torch(backend, paged_batch([0, 13, 6], extend, page_size, seed=page_size))
    assert backend._plan.kind == ("decode" if decode else "prefill")


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("decode", [True, False])
def test_cascade_path_for_shared_prefix(fake_flashinfer, page_size: int, decode: bool) -> None:
    from radix_backend.kernels.flashinfer_backend import FlashInferAttentionBackend
    backend = FlashInferAttentionBackend(device="cpu", page_size=page_size, workspace_mb=1,
                                         cascade_min_batch=3, cascade_min_prefix=16)
    extend = [1] * 4 if decode else [3, 1, 7, 2]
    batch = paged_batch([24, 30, 24, 41], extend, page_size, hq=6, hkv=2, shared=24, seed=7)
    check_against_torch(backend, batch)
    assert backend._plan.kind == "cascade" and backend._plan.shared_len == 24
    top_qo, unique_qo = backend._cascade.planned_with
    assert top_qo == [0, sum(extend)] and unique_qo == batch[-1].qo_indptr.tolist()


def test_cascade_skipped_below_thresholds(fake_flashinfer) -> None:
    from radix_backend.kernels.flashinfer_backend import FlashInferAttentionBackend
    batch = paged_batch([24, 30], [1, 1], 1, shared=24)
    backend = FlashInferAttentionBackend(device="cpu", cascade_min_batch=4, cascade_min_prefix=16, workspace_mb=1)
    check_against_torch(backend, batch)
    assert backend._plan.kind == "decode"


def test_decode_tensor_core_choice_follows_group_size(fake_flashinfer) -> None:
    from radix_backend.kernels.flashinfer_backend import FlashInferAttentionBackend
    backend = FlashInferAttentionBackend(device="cpu", workspace_mb=1)
    check_against_torch(backend, paged_batch([3, 4], [1, 1], 1, hq=8, hkv=2))
    check_against_torch(backend, paged_batch([3, 4], [1, 1], 1, hq=4, hkv=2))
    assert set(backend._decode) == {True, False}


def test_registry_passes_page_size(fake_flashinfer) -> None:
    from radix_backend.kernels import create_attention_backend
    backend = create_attention_backend("flashinfer", "cpu", page_size=8, workspace_mb=1)
    assert backend.name == "flashinfer" and backend.page_size == 8


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_FLASHINFER), reason="needs CUDA and flashinfer-python")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("extend", [[1, 1, 1, 1], [7, 1, 30, 2]])
def test_real_flashinfer_matches_torch(page_size, extend) -> None:
    from radix_backend.kernels.flashinfer_backend import FlashInferAttentionBackend
    backend = FlashInferAttentionBackend(device="cuda", page_size=page_size, cascade_min_batch=4,
                                         cascade_min_prefix=32)
    for shared in (0, 64):
        batch = paged_batch([64, 80, 100, 64], extend, page_size, hq=32, hkv=8, dim=128, shared=shared,
                            dtype=torch.float16, device="cuda")
        check_against_torch(backend, batch, atol=2e-3)


def test_gpu_check_correctness_section_plans_every_path(fake_flashinfer) -> None:
    """gpu_check's FlashInfer correctness checks (quick shapes) reach the decode, prefill and
    cascade plans, and the stand-in agrees with the torch reference on all of them."""
    from radix_backend.bench import gpu_check as gc
    report = gc.Report()
    gc.check_attention(report, "cpu", ["torch", "flashinfer"], quick=True)
    checks = [c["check"] for c in report.correctness]
    assert len(checks) == len(gc.correctness_shapes(quick=True)) + len(gc.cascade_cases(quick=True))
    assert all(c["ok"] for c in report.correctness), report.correctness
    assert {c[c.rindex("[") + 1:-1] for c in checks} == {"decode", "prefill", "cascade"}
