"""The adapters benchmark runs end to end (tiny sizes) and its two sides agree on greedy outputs."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("guidance")


@pytest.mark.slow
def test_adapters_bench_small() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from radix_backend.bench import adapters_bench as ab
    from radix_backend.model_executor.loader import hf_directory
    from radix_backend.engine import get_engine

    engine: Any = get_engine()
    hf = AutoModelForCausalLM.from_pretrained(str(hf_directory(engine.checkpoint)), dtype=torch.float32).eval()
    baseline = ab.hf_chat_model(hf, engine.tokenizer, max_new_tokens=4)
    batch = ab.bench_langchain_batch(engine, baseline, num_questions=4, prefix_tokens=200, max_new_tokens=4)
    assert batch["calls"] == 4 and batch["agreement"] == "4/4"
    assert batch["cached_tokens"] >= 3 * 150  # the few-shot prefix is computed once for the batch
    chat = ab.bench_langchain_chat(engine, baseline, sessions=2, turns=2, max_new_tokens=4)
    assert chat["agreement"] == "4/4" and chat["cached_tokens"] > 0
    guided = ab.bench_guidance(engine, hf, programs=2)
    assert guided["agreement"] == "2/2"
    table = ab.format_results({"a": batch, "b": chat, "c": guided})
    assert "langchain-batch" in table and "guidance" in table


@pytest.mark.slow
def test_dspy_workload_runs_in_process_and_over_http() -> None:
    """The DSPy row: the same optimizer run on RadixLM and on dspy.LM over HTTP to a
    `radix-backend serve` process (both sides timed, the in-process side's cache counted)."""
    pytest.importorskip("dspy")
    from radix_backend.bench import adapters_bench as ab
    from radix_backend.engine import get_engine

    row = ab.bench_dspy(get_engine(), None, train=2, test=2)
    assert row["baseline"] == "dspy.LM over HTTP" and row["radix_s"] > 0 and row["hf_s"] > 0
    assert row["calls"] >= 2 and row["cached_tokens"] > 0  # DSPy resends its instructions: cache hits
    assert "dspy-bootstrap" in ab.format_results({"dspy": row})
