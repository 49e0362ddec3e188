"""A fault inside the scheduler step that belongs to one request (its sampler row, its constraint,
its detokenization) fails that request only: every other request of the running batch finishes
with the tokens it gets when run alone, and no KV slot leaks."""

from __future__ import annotations

import pytest

from radix_backend import SamplingParams
from radix_backend.scheduler import constrained, request, sampling

POISON = 666_666  # the seed that marks the faulty request (greedy rows ignore their seed)
PROMPTS = ["The quick brown fox", "Once upon a time", "In a hole in the ground", "It was a bright cold day"]


class Poisoned(RuntimeError):
    pass


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True, **kw})


def _innocent_params() -> list[SamplingParams]:
    # one sampled row (its generator state must survive the failed batched attempt) and a constrained one
    return [_params(), _params(temperature=0.9, seed=7), _params(regex="[a-z ]{1,40}"), _params(logprobs=True, top_logprobs=2)]


def _run_alone(engine) -> list[list[int]]:
    return [engine.generate(p, params).token_ids for p, params in zip(PROMPTS, _innocent_params())]


def _run_with_poisoned(engine, poisoned: SamplingParams):
    handles = [engine.submit(p, params) for p, params in zip(PROMPTS, _innocent_params())]
    bad = engine.submit("Poisoned request here", poisoned)
    with pytest.raises(Poisoned):
        bad.wait(timeout=60)
    return [h.wait(timeout=60).token_ids for h in handles]


def _assert_no_leak(engine) -> None:
    assert engine.flush_cache()
    stats = engine.cache_stats()
    assert stats.slots_used == 0 and stats.slots_free == stats.slots_total


@pytest.fixture()
def alone(tiny_engine) -> list[list[int]]:
    tiny_engine.flush_cache()
    return _run_alone(tiny_engine)


def poison_sampler(monkeypatch, seed: int = POISON) -> None:
    """Make the scheduler's sampler raise `Poisoned` for any batch holding a row whose seed is `seed`
    (a sampled row: plain greedy rows take their argmax without it)."""
    real = sampling.sample

    def faulty(logits, rows):
        if any(r.params.seed == seed for r in rows):
            raise Poisoned("injected sampler fault")
        return real(logits, rows)

    monkeypatch.setattr(sampling, "sample", faulty)


def test_a_sampler_that_raises_for_one_row(tiny_engine, alone, monkeypatch) -> None:
    poison_sampler(monkeypatch)
    tiny_engine.flush_cache()
    # a sampled row: a greedy row with nothing to edit takes its argmax without the sampler
    assert _run_with_poisoned(tiny_engine, _params(seed=POISON, temperature=0.8)) == alone
    _assert_no_leak(tiny_engine)


def test_a_constraint_that_errors(tiny_engine, alone, monkeypatch) -> None:
    real = constrained.mask_logits

    def faulty(logits, constraints):
        if any(c is not None and c.poisoned for c in constraints):
            raise Poisoned("grammar engine fault")
        return real(logits, constraints)

    real_compile = type(tiny_engine.constraint_compiler).compile

    def compile_marking(self, params):
        c = real_compile(self, params)
        if c is not None:
            c.poisoned = params.seed == POISON
        return c

    monkeypatch.setattr(constrained, "mask_logits", faulty)
    monkeypatch.setattr(type(tiny_engine.constraint_compiler), "compile", compile_marking)
    tiny_engine.flush_cache()
    assert _run_with_poisoned(tiny_engine, _params(seed=POISON, regex="[0-9]+")) == alone
    _assert_no_leak(tiny_engine)


def test_detokenization_that_raises(tiny_engine, alone, monkeypatch) -> None:
    real = request.Req.detokenize

    def faulty(self, decode):
        if self.params.seed == POISON and len(self.output_ids) > 3:
            raise Poisoned("tokenizer fault")
        return real(self, decode)

    monkeypatch.setattr(request.Req, "detokenize", faulty)
    tiny_engine.flush_cache()
    assert _run_with_poisoned(tiny_engine, _params(seed=POISON)) == alone
    _assert_no_leak(tiny_engine)


def test_a_failing_stream_fails_alone(tiny_engine, alone, monkeypatch) -> None:
    real = request.Req.take_stream_chunk

    def faulty(self):
        if self.params.seed == POISON:
            raise Poisoned("stream fault")
        return real(self)

    monkeypatch.setattr(request.Req, "take_stream_chunk", faulty)
    tiny_engine.flush_cache()
    handles = [tiny_engine.submit(p, params, stream=True) for p, params in zip(PROMPTS, _innocent_params())]
    bad = tiny_engine.submit("Poisoned request here", _params(seed=POISON), stream=True)
    with pytest.raises(Poisoned):
        list(bad.iter_chunks())
    assert [h.wait(timeout=60).token_ids for h in handles] == alone
    _assert_no_leak(tiny_engine)


def test_a_kv_fault_while_finishing_fails_the_request_instead_of_hanging(tiny_llama_dir, monkeypatch) -> None:
    """A request whose KV cannot be released when it finishes (an accounting fault) is no longer
    queued: it still gets the error instead of waiting forever, and the engine keeps serving."""
    from radix_backend import Engine
    from radix_backend.mem_cache.kv_manager import KVManager
    from radix_backend.mem_cache.kv_pool import SlotAccountingError

    real = KVManager.cache
    armed = {"on": True}

    def faulty(self, held, ids, finished=False):
        if finished and armed["on"]:
            armed["on"] = False
            raise SlotAccountingError("injected fault while caching a finished request")
        return real(self, held, ids, finished=finished)

    monkeypatch.setattr(KVManager, "cache", faulty)
    with Engine(str(tiny_llama_dir), kv_cache_tokens=4096, device="cpu", dtype="float32") as engine:
        handle = engine.submit("Once upon a time", _params(max_new_tokens=4))
        with pytest.raises(SlotAccountingError, match="injected"):
            handle.wait(timeout=60)
        assert len(engine.generate("Once upon a time", _params(max_new_tokens=4)).token_ids) == 4
        armed["on"] = True  # the same fault while an abort releases a running request's KV
        handle = engine.submit("Once upon a time", _params(max_new_tokens=300))
        while not handle.done and engine.cache_stats().running_requests == 0:
            pass
        engine.abort(handle.rid)
        with pytest.raises(SlotAccountingError, match="injected"):
            handle.wait(timeout=60)
        assert len(engine.generate("Once upon a time", _params(max_new_tokens=4)).token_ids) == 4
