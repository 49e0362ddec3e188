"""Freed heap memory kept for reuse (kernels/heap.py): a repeated prefill faults no pages in anew."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from radix_backend.config import EngineConfig
from radix_backend.kernels import heap

# A fresh process (the allocator's state depends on all that ran before): the embedded model,
# the same 1,024-token prefill four times over a flushed cache, page faults counted around each.
PREFILL_FAULTS = """
import json, resource, sys
from radix_backend import Engine, SamplingParams
with Engine(quantization="auto", retain_heap=sys.argv[1] == "1") as engine:  # the default path
    text = " ".join(f"Item {i}: the radix tree keeps every prefix it has seen." for i in range(200))
    prompt = engine.encode(text)[:1024]
    faults = []
    for _ in range(4):
        assert engine.flush_cache()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        engine.generate(input_ids=prompt, params=SamplingParams(max_new_tokens=1, temperature=0))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""


def prefill_faults(retain: bool) -> list[int]:
    done = subprocess.run([sys.executable, "-c", PREFILL_FAULTS, "1" if retain else "0"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_retained_by_default_and_switchable() -> None:
    assert EngineConfig().retain_heap is True
    assert EngineConfig.from_env({"RADIX_BACKEND_RETAIN_HEAP": "0"}).retain_heap is False


@pytest.mark.skipif(not heap.glibc(), reason="the thresholds are glibc's")
def test_repeated_prefill_faults_no_new_pages() -> None:
    """With glibc's defaults each 1,024-token prefill of the embedded model faulted 40-115 thousand
    pages in (its layers' tensors handed back to the OS and mapped again); with the heap retained
    (the default on the CPU) the repeated prefill, its KV slots reused, faults almost none."""
    faults = prefill_faults(retain=True)
    assert max(faults[2:]) < 2000, faults
