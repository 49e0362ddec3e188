"""`radix-backend demo` runs end to end (on the tiny Llama for speed) and, with its disk KV tier on,
a second run loads the prefixes the first one computed instead of recomputing them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from radix_backend.demo import run_demo


def test_demo_second_run_loads_prefixes_from_disk(tiny_llama_dir: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    disk = tmp_path / "kv"
    run_demo(model=str(tiny_llama_dir), device="cpu", kv_cache_tokens=8192, disk_cache_dir=disk)
    first = capsys.readouterr().out
    run_demo(model=str(tiny_llama_dir), device="cpu", kv_cache_tokens=8192, disk_cache_dir=disk)
    second = capsys.readouterr().out
    for out in (first, second):
        assert "few-shot batch" in out and "multi-turn chat" in out and "fork" in out and "overall:" in out
        for framework in ("LangChain RadixChatModel ->", "LlamaIndex RadixLlamaIndexLLM ->",
                          "Guidance RadixGuidance select ->", "DSPy RadixLM Predict ->"):
            assert framework in out, framework  # every framework ran on the demo's engine
    assert "loaded from disk" not in first
    loaded = re.search(r"\[few-shot batch[^\]]*\] prompt tokens \d+, served from cache \d+ \(\d+%\), (\d+) of them "
                       r"loaded from disk", second)
    assert loaded and int(loaded.group(1)) >= 256  # the few-shot system prompt came back from disk
    assert re.search(r"; (\d+) loaded from the disk tier", second).group(1) != "0"
