"""The DSL benchmark runs end to end (tiny random-weight model) and the naive HF baseline
produces the same greedy text as the engine."""

from __future__ import annotations

import pytest

from radix_backend import Engine


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    with Engine(str(tiny_llama_dir), kv_cache_tokens=8192, device="cpu", dtype="float32") as eng:
        yield eng


def test_dsl_bench_runs_and_naive_agrees(engine):
    from radix_backend.bench.dsl_bench import format_report, run

    result = run(engine=engine, workloads=("few_shot", "branching", "json"), num_items=2, num_branches=2)
    rows = result["workloads"]
    assert set(rows) == {"few_shot", "branching", "json"}
    for name, row in rows.items():
        assert row["agreement"] == 1.0, name  # same programs, greedy: same text with and without reuse
        assert row["dsl"]["computed_prompt_tokens"] < row["naive_hf"]["computed_prompt_tokens"], name
        assert row["speedup"] > 0
    assert rows["branching"]["dsl"]["cached_tokens"] > 0
    report = format_report(result)
    assert "naive_hf" in report and "speedup" in report


def test_dsl_bench_rejects_unknown_workload(engine):
    from radix_backend.bench.dsl_bench import run

    with pytest.raises(ValueError, match="unknown workload"):
        run(engine=engine, workloads=("nope",), naive=False)
