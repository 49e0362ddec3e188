"""Native Llama-family forward through the engine vs HF transformers greedy (tiny random models)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from radix_backend import Engine, SamplingParams

PROMPTS = ["Hello, my name is", "The weather today", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"]


def hf_greedy(model_dir, prompt_ids: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir", "tiny_mistral_dir", "tiny_llama_bias_dir",
                                     "tiny_mistral_window_dir", "tiny_phi3_dir", "tiny_phi4_dir", "tiny_granite_dir"])
def test_greedy_matches_hf(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    with Engine(str(model_dir), kv_cache_tokens=4096) as engine:
        params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
        outs = engine.generate(PROMPTS, params)
        for prompt, out in zip(PROMPTS, outs):
            assert out.token_ids == hf_greedy(model_dir, engine.encode(prompt), 12), prompt
        # second round: the prompts are now cached and must give the same tokens
        again = engine.generate(PROMPTS, params)
        assert [o.token_ids for o in again] == [o.token_ids for o in outs]
        assert all(o.meta.cached_tokens > 0 for o in again)


def test_padded_decode_graph_path_matches_eager(tiny_llama_dir):
    """The CUDA-graph decode path (run eagerly on CPU: static buffers, padding to captured sizes)."""
    prompts = PROMPTS + ["A longer prompt " * 10]
    params = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    with Engine(str(tiny_llama_dir), kv_cache_tokens=4096) as eager:
        expected = [o.token_ids for o in eager.generate(prompts, params)]
    with Engine(str(tiny_llama_dir), kv_cache_tokens=4096, cuda_graph=True, max_running_requests=8) as graphed:
        runner = graphed.runner.graph_runner
        assert runner is not None and runner.captured_sizes == [1, 2, 4, 8]
        calls = []
        original = runner.run
        runner.run = lambda *a: calls.append(a[2].batch_size) or original(*a)
        assert [o.token_ids for o in graphed.generate(prompts, params)] == expected
        assert 4 in calls  # the decode steps went through the padded path
