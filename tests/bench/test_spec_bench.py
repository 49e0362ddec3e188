"""`bench spec` runs both modes on the same prompts and reports what it measured (the figures in
BENCHMARKS.md come from full runs); every workload's prompts are built from real text."""

from __future__ import annotations

import json

import pytest

from radix_backend.bench import spec_bench


@pytest.mark.parametrize("workload", spec_bench.WORKLOADS)
def test_each_workload_builds_its_chats_from_real_text(workload: str) -> None:
    chats = spec_bench.build_messages(workload, 3)
    assert len(chats) == 3 and all(c and c[-1]["role"] == "user" for c in chats)
    if workload == "code-edit":
        assert all("def " in c[0]["content"] for c in chats)
    if workload == "tool-loop":
        listing = json.loads(chats[0][2]["content"].removeprefix("Tool result: "))
        assert listing and all(entry["name"].endswith(".py") and entry["bytes"] > 0 for entry in listing)


def test_both_modes_run_the_same_prompts_with_identical_outputs(engine) -> None:
    own_setting = engine.scheduler.speculative
    report = spec_bench.run(engine, workloads=("code-edit", "json-reemit"), prompts_per_workload=2, batches=(1, 2),
                            max_new_tokens=24, repeats=1)
    assert [(r["workload"], r["batch"]) for r in report["rows"]] == [
        ("code-edit", 1), ("code-edit", 2), ("json-reemit", 1), ("json-reemit", 2)]
    assert all(r["identical"] for r in report["rows"])
    assert all(r["plain"]["tokens"] == r["spec"]["tokens"] > 0 for r in report["rows"])
    assert sum(r["spec"]["accepted"] for r in report["rows"]) > 0
    assert all(r["plain"]["drafted"] == 0 for r in report["rows"])
    assert engine.scheduler.speculative == own_setting  # the engine's own setting is back
    table = spec_bench.format_report(report)
    assert "| code-edit | 2 |" in table and "NO" not in table
