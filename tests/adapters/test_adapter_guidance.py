"""Guidance backend: fast tests on a tiny random Llama (same tokenizer as SmolLM2) and slow
end-to-end tests on SmolLM2, both compared with guidance's own transformers backend."""

from __future__ import annotations

import importlib
import json
import re
import sys
from typing import Any

import pytest

pytest.importorskip("guidance")

import torch  # noqa: E402
from guidance import assistant, gen, select, system, user  # noqa: E402
from guidance import json as gen_json  # noqa: E402

from fakes import TransformersLogitsEngine  # noqa: E402
from radix_backend.bench.baselines import guidance_transformers_baseline  # noqa: E402
from radix_backend.adapters.guidance import RadixGuidance, RadixGuidanceEngine  # noqa: E402
from radix_backend.errors import InvalidRequestError, MissingDependencyError  # noqa: E402
from radix_backend.model_executor.loader import hf_directory  # noqa: E402

SMALL_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "blue"]}},
                "required": ["ok", "color"], "additionalProperties": False}


def program(lm: Any) -> Any:
    """A greedy program touching select, regex gen, stop gen, max_tokens and captures."""
    lm += "Question: which color is the sky? Answer: " + select(["red", "green", "blue"], name="color")
    lm += "\nA number between 10 and 99: " + gen("num", regex=r"[1-9][0-9]", max_tokens=4)
    lm += "\nOne line about cats: " + gen("line", max_tokens=8, stop="\n")
    return lm


def chat_program(lm: Any) -> Any:
    with system():
        lm += "You are a terse assistant."
    with user():
        lm += "Say yes or no."
    with assistant():
        lm += select(["yes", "no"], name="answer") + gen("rest", max_tokens=3, stop="<|im_end|>")
    return lm


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from radix_backend.model_executor.loader import load_tokenizer, resolve_checkpoint

    return load_tokenizer(resolve_checkpoint(None))


@pytest.fixture(scope="module")
def tiny_model(tokenizer: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return LlamaForCausalLM(cfg).eval()


# ---------------------------------------------------------------- fast: tiny random model
def test_constrained_outputs_are_valid(tokenizer: Any, tiny_model: Any) -> None:
    lm = RadixGuidance(engine=TransformersLogitsEngine(tiny_model, tokenizer))
    out = program(lm)
    assert out["color"] in {"red", "green", "blue"}
    assert re.fullmatch(r"[1-9][0-9]", out["num"])
    assert out["line"] and "\n" not in out["line"]
    data = json.loads((lm + "JSON: " + gen_json("obj", schema=SMALL_SCHEMA, max_tokens=30))["obj"])
    assert isinstance(data["ok"], bool) and data["color"] in {"red", "blue"} and set(data) == {"ok", "color"}


def test_matches_guidance_transformers_backend(tokenizer: Any, tiny_model: Any) -> None:
    ours = RadixGuidance(engine=TransformersLogitsEngine(tiny_model, tokenizer))
    theirs = guidance_transformers_baseline(tiny_model, tokenizer)
    a, b = program(ours), program(theirs)
    assert (a["color"], a["num"], a["line"]) == (b["color"], b["num"], b["line"])
    assert str(a) == str(b)
    c, d = chat_program(ours), chat_program(theirs)
    assert str(c) == str(d)
    assert str(c).startswith("<|im_start|>system\nYou are a terse assistant.<|im_end|>\n<|im_start|>user\n")


def test_repeated_sequence_is_served_without_engine_call(tokenizer: Any, tiny_model: Any) -> None:
    fake = TransformersLogitsEngine(tiny_model, tokenizer)
    backend = RadixGuidanceEngine(fake)
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    first = backend.get_logits(ids)
    second = backend.get_logits(list(ids))
    assert len(fake.calls) == 1 and second["n_cached"] == len(ids)
    assert first["logits"].shape == (1, len(tokenizer))
    expected = tiny_model(input_ids=torch.tensor([ids])).logits[0, -1].detach().numpy()
    assert abs(first["logits"][0] - expected).max() < 1e-5
    with pytest.raises(InvalidRequestError):
        backend.get_logits([])


def test_engine_without_next_token_logits_is_rejected(tokenizer: Any) -> None:
    class NoLogits:
        pass

    no = NoLogits()
    no.tokenizer = tokenizer  # type: ignore[attr-defined]
    with pytest.raises(InvalidRequestError, match="next_token_logits"):
        RadixGuidance(engine=no)


def test_missing_guidance_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "guidance", None)
    monkeypatch.delitem(sys.modules, "radix_backend.adapters.guidance")
    with pytest.raises(MissingDependencyError, match=r"pip install 'radix-backend\[guidance\]'"):
        importlib.import_module("radix_backend.adapters.guidance")


# ---------------------------------------------------------------- slow: real engine
LONG_PREFIX = ("The following is a detailed field guide to the birds of the northern coast. " * 12 +
               "Each entry lists the bird's name, its colors and where it nests.\n")


@pytest.mark.slow
def test_real_programs_are_valid_and_share_the_cache(engine: Any) -> None:
    lm = RadixGuidance(engine=engine)
    out = program(lm)
    assert out["color"] in {"red", "green", "blue"} and re.fullmatch(r"[1-9][0-9]", out["num"])
    assert "\n" not in out["line"]
    data = json.loads((lm + "Reply in JSON: " + gen_json("obj", schema=SMALL_SCHEMA, max_tokens=30))["obj"])
    assert data["color"] in {"red", "blue"}
    assert chat_program(lm)["answer"] in {"yes", "no"}

    prefix_tokens = len(engine.encode(LONG_PREFIX))
    first = lm + LONG_PREFIX + "Q: Which bird is black and white? A: " + gen("a", max_tokens=6, stop="\n")
    assert first["a"] is not None
    before = engine.cache_stats()
    second = RadixGuidance(engine=engine) + LONG_PREFIX + "Q: Where do puffins nest? A: " + \
        gen("b", max_tokens=6, stop="\n")
    after = engine.cache_stats()
    assert second["b"] is not None
    computed = (after.prompt_tokens - before.prompt_tokens) - (after.cached_tokens - before.cached_tokens)
    new_tokens = len(engine.encode("Q: Where do puffins nest? A: "))
    # the second program recomputes none of the shared prefix: only its question and generated tokens
    assert computed <= new_tokens + 6 + 4, (computed, prefix_tokens)
    assert after.cached_tokens - before.cached_tokens >= prefix_tokens


@pytest.mark.slow
def test_real_results_match_guidance_transformers_backend(engine: Any) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(hf_directory(engine.checkpoint)), dtype=torch.float32).eval()
    theirs = guidance_transformers_baseline(hf, engine.tokenizer)
    ours = RadixGuidance(engine=engine)
    a, b = program(ours), program(theirs)
    assert (a["color"], a["num"], a["line"]) == (b["color"], b["num"], b["line"])
    assert str(chat_program(ours)) == str(chat_program(theirs))
