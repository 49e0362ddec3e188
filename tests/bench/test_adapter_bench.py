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
def test_framework_programs_run_in_process_and_over_http() -> None:
    """Each framework's program with our adapter in process and with the framework's own OpenAI
    client over HTTP to a `radix-backend serve` process: both sides timed, greedy outputs equal
    (same engine and weights on both sides), the in-process side served from the cache."""
    for module in ("dspy", "pydantic_ai", "haystack", "smolagents", "instructor"):
        pytest.importorskip(module)
    from radix_backend.bench import adapters_bench as ab
    from radix_backend.bench import framework_http
    from radix_backend.engine import get_engine

    # a framework release whose OpenAI client needs a newer `openai` than the one installed is
    # skipped by the bench, with the reason
    runnable = [name for name, make in framework_http.PROGRAMS.items() if make().client_missing() is None]
    assert len(runnable) >= 4
    rows = framework_http.run(get_engine(), None, list(framework_http.PROGRAMS), 2)
    assert [r["workload"] for r in rows] == runnable
    for row in rows:
        assert row["baseline"] == f"{row['workload']} over HTTP to radix-backend serve"
        assert row["radix_s"] > 0 and row["hf_s"] > 0
        if row["workload"] != "dspy":  # DSPy over LiteLLM sends no JSON schema: the server decodes freely
            assert row["agreement"] == "2/2", row
        assert row["cached_tokens"] > 0, row  # each program resends its instructions
    assert runnable[0] in ab.format_results({r["workload"]: r for r in rows})
