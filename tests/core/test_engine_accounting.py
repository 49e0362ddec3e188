"""KV accounting, preemption, abort, concurrency and bad input on a tiny random model."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from radix_backend import (Engine, InvalidRequestError, KVCacheTooSmallError, ModelLoadError, PromptTooLongError,
                           RequestAbortedError, SamplingParams)

GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)


def _all_free(engine: Engine) -> bool:
    assert engine.flush_cache()
    stats = engine.cache_stats()
    return stats.slots_free == stats.slots_total and stats.cached_slots == 0


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    with Engine(str(tiny_llama_dir), kv_cache_tokens=4096, debug_slots=True) as eng:
        yield eng


def _prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    stems = ["Alpha beta gamma delta", "The history of Rome", "Recipe for bread:", "Q: what is love? A:"]
    return [f"{rng.choice(stems)} {' '.join(str(rng.randint(0, 50)) for _ in range(rng.randint(1, 30)))}" for _ in range(n)]


def test_mixed_requests_then_flush_free_every_slot(engine):
    prompts = _prompts(40)
    reference = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    handles = [engine.submit(p, SamplingParams(max_new_tokens=50, temperature=0.8, seed=i, ignore_eos=True))
               for i, p in enumerate(prompts)]
    for h in handles[::3]:
        engine.abort(h.rid)
    for i, h in enumerate(handles):
        try:
            h.wait(120)
        except RequestAbortedError:
            assert i % 3 == 0
    again = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    assert again == reference
    assert _all_free(engine)


def test_tiny_pool_preempts_instead_of_crashing(tiny_llama_dir):
    with Engine(str(tiny_llama_dir), kv_cache_tokens=256, debug_slots=True) as small, \
            Engine(str(tiny_llama_dir), kv_cache_tokens=8192) as big:
        prompts = _prompts(12, seed=1)
        params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
        expected = [o.token_ids for o in big.generate(prompts, params)]
        got = [o.token_ids for o in small.generate(prompts, params)]
        assert got == expected  # retracted requests resume and still produce the same tokens
        assert small.cache_stats().retractions > 0
        assert _all_free(small)


def test_request_larger_than_pool_is_rejected(tiny_llama_dir):
    with Engine(str(tiny_llama_dir), kv_cache_tokens=64) as small:
        with pytest.raises(KVCacheTooSmallError, match="kv_cache_tokens"):
            small.generate("word " * 100, SamplingParams(max_new_tokens=4))
        assert small.generate("hi", SamplingParams(max_new_tokens=4, temperature=0)).token_ids


def test_concurrent_threads_and_asyncio(engine):
    prompts = _prompts(64, seed=2)
    expected = {p: o.token_ids for p, o in zip(prompts, engine.generate(prompts, GREEDY))}
    results: dict[str, list[int]] = {}
    lock = threading.Lock()

    def worker(chunk: list[str]) -> None:
        for p in chunk:
            out = engine.generate(p, GREEDY, timeout=120)
            with lock:
                results[p] = out.token_ids

    threads = [threading.Thread(target=worker, args=(prompts[i:48:16],)) for i in range(16)]

    async def async_part() -> None:
        outs = await asyncio.gather(*(engine.agenerate(p, GREEDY) for p in prompts[48:]))
        for p, o in zip(prompts[48:], outs):
            results[p] = o.token_ids

    start = time.time()
    for t in threads:
        t.start()
    asyncio.run(async_part())
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads), "deadlock: a worker thread never returned"
    assert time.time() - start < 180
    assert results == expected


@pytest.mark.parametrize("call, error, match", [
    (lambda e: e.generate("", GREEDY), InvalidRequestError, "empty"),
    (lambda e: e.generate(input_ids=[], params=GREEDY), InvalidRequestError, "empty"),
    (lambda e: e.generate("hi", SamplingParams(max_new_tokens=-1)), InvalidRequestError, "max_new_tokens"),
    (lambda e: e.generate("hi", SamplingParams(top_p=0)), InvalidRequestError, "top_p"),
    (lambda e: e.generate(input_ids=[10 ** 9], params=GREEDY), InvalidRequestError, "vocabulary"),
    (lambda e: e.generate(input_ids=[5] * 3000, params=GREEDY), PromptTooLongError, "context window"),
    (lambda e: e.generate(messages=[{"content": "no role"}]), InvalidRequestError, "role"),
    (lambda e: e.generate("a", input_ids=[1]), InvalidRequestError, "exactly one"),
])
def test_bad_input_raises_typed_error_and_engine_keeps_serving(engine, call, error, match):
    with pytest.raises(error, match=match):
        call(engine)
    assert engine.generate("still alive?", GREEDY).token_ids


def test_unknown_model_path():
    with pytest.raises(ModelLoadError, match="does-not-exist"):
        Engine("/nonexistent/does-not-exist")


def test_shutdown_rejects_new_requests(tiny_llama_dir):
    from radix_backend.errors import EngineShutdownError
    eng = Engine(str(tiny_llama_dir), kv_cache_tokens=512)
    eng.shutdown()
    with pytest.raises(EngineShutdownError):
        eng.generate("hi", GREEDY)


def test_disabled_radix_cache_with_chunked_prefill(tiny_llama_dir, engine):
    prompts = _prompts(6, seed=3)
    expected = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    with Engine(str(tiny_llama_dir), kv_cache_tokens=2048, chunked_prefill_tokens=5, disable_radix_cache=True) as eng:
        assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == expected
        stats = eng.cache_stats()
        assert stats.cached_tokens == 0 and stats.slots_free == stats.slots_total


def test_params_of_the_wrong_type_is_a_typed_error(engine):
    with pytest.raises(InvalidRequestError, match="SamplingParams"):
        engine.generate("hi", {"max_new_tokens": 4})


def test_engine_hands_kv_to_the_tree_through_the_cache_methods(tiny_llama_dir, monkeypatch):
    """The hand-over the property tests in test_radix_cache.py exercise is the one the engine runs:
    chunked prefill calls cache_unfinished, finishing calls cache_finished, and nothing else
    inserts into the tree."""
    from radix_backend.mem_cache.radix_cache import RadixCache

    calls: list[str] = []
    for name in ("cache_finished", "cache_unfinished"):
        original = getattr(RadixCache, name)
        monkeypatch.setattr(RadixCache, name, lambda self, *a, _f=original, _n=name: (calls.append(_n), _f(self, *a))[1])
    inserts_outside: list[int] = []
    original_insert = RadixCache.insert

    def insert(self, token_ids, slots):
        import inspect
        if inspect.stack()[1].function != "_insert_request_kv":
            inserts_outside.append(len(token_ids))
        return original_insert(self, token_ids, slots)

    monkeypatch.setattr(RadixCache, "insert", insert)
    with Engine(str(tiny_llama_dir), kv_cache_tokens=2048, chunked_prefill_tokens=8, debug_slots=True) as eng:
        out = eng.generate(_prompts(1, seed=5)[0] + " and more words to chunk", GREEDY)
        assert out.meta.completion_tokens == 8
        assert "cache_unfinished" in calls and calls[-1] == "cache_finished"
        assert not inserts_outside
        assert _all_free(eng)


def test_final_stream_chunk_usage_is_complete_when_pushed_and_never_changes(engine, monkeypatch):
    """A consumer may read the last chunk the moment the scheduler pushes it (before the request's
    output is built): its counts must already be filled in, and later bookkeeping must not touch it."""
    from copy import deepcopy

    from radix_backend.scheduler.request import RequestHandle

    seen_at_push = []
    original = RequestHandle.push_chunk

    def push_chunk(self, chunk):
        if chunk.finish_reason is not None:
            seen_at_push.append((chunk, deepcopy(chunk.meta)))
        original(self, chunk)

    monkeypatch.setattr(RequestHandle, "push_chunk", push_chunk)
    prompt = "Count to ten: one two"
    chunks = list(engine.stream(prompt, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)))
    (chunk, snapshot), = seen_at_push
    assert snapshot.prompt_tokens == len(engine.encode(prompt)) and snapshot.completion_tokens == 6
    assert chunks[-1].meta == snapshot and chunk.meta == snapshot  # nothing changed it afterwards
    out = engine.generate(prompt, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))
    assert out.meta is not chunk.meta


def test_a_batch_arrives_as_one(engine, monkeypatch):
    """generate() hands its batch to the scheduler as one arrival, so the first forward admits all
    of it, however slowly the calling thread runs (posted one at a time, the scheduler thread could
    start a step on the first request alone)."""
    inbox = engine.scheduler._inbox
    post = inbox.post

    def slow_post(kind, payload=None):
        post(kind, payload)
        time.sleep(0.02)  # give the scheduler thread every chance to start a step in between

    monkeypatch.setattr(inbox, "post", slow_post)
    rng = random.Random(7)
    prompts = [[rng.randrange(1000, 20000) for _ in range(12)] for _ in range(6)]  # nothing shared
    engine.flush_cache()
    before = engine.cache_stats().forward_steps
    engine.generate(input_ids=prompts, params=SamplingParams(max_new_tokens=1, temperature=0))
    assert engine.cache_stats().forward_steps - before == 1
