"""`bench restart` measures what it says, on the tiny model (the figures come from real runs on SmolLM2)."""

from __future__ import annotations

from pathlib import Path

from radix_backend.bench import restart_bench


def test_restart_bench_rows_on_the_tiny_model(tiny_llama_dir: Path, tmp_path: Path) -> None:
    result = restart_bench.measure(str(tiny_llama_dir), [300], llamacpp_python=None)
    (row,) = result["rows"]
    assert row["prompt_tokens"] == 300 and "llamacpp_cold" not in row  # a HF dir: llama.cpp needs a GGUF
    assert row["radix_cold"]["disk_hit_tokens"] == 0 and row["radix_write"]["disk_hit_tokens"] == 0
    assert row["radix_restart"]["disk_hit_tokens"] == row["radix_restart"]["cached_tokens"] == 256
    assert row["radix_restart"]["token"] == row["radix_cold"]["token"]
    table = restart_bench.format_table(result)
    assert "| 300 |" in table and "n/a" in table


def test_document_ids_have_the_asked_length(smollm2_tokenizer) -> None:
    assert len(restart_bench.document_ids(smollm2_tokenizer, 2000)) == 2000
