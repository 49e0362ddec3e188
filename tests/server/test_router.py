"""Data-parallel router: the approximate radix tree, the routing policy, and 2 CPU replicas on a
multi-turn chat workload where cache-aware routing must beat round-robin on cache hit rate."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radix_backend.errors import InvalidRequestError
from radix_backend.utils import common_prefix_len
from radix_backend.server.router import ApproxRadixTree, Router
from radix_backend.sampling_params import SamplingParams

from fakes import CharEngine

# ---------------------------------------------------------------------------- approximate tree


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=12),
       st.lists(st.integers(0, 3), max_size=12))
def test_tree_match_is_longest_common_prefix(keys, query) -> None:
    tree = ApproxRadixTree()
    for k in keys:
        tree.insert(k)
    assert tree.match(query) == max(common_prefix_len(k, query) for k in keys)
    # size counts each stored token once (shared prefixes are stored once)
    distinct = {tuple(k[:i]) for k in keys for i in range(1, len(k) + 1)}
    assert tree.size == len(distinct)


def test_tree_evicts_least_recently_used_leaves() -> None:
    tree = ApproxRadixTree(capacity_tokens=10)
    tree.insert([1, 2, 3, 4])
    tree.insert([1, 2, 9, 9])  # shares [1, 2]
    assert tree.size == 6
    tree.match([1, 2, 3, 4])  # [9, 9] is now the least recently used leaf
    tree.insert([7, 7, 7, 7, 7])
    assert tree.size <= 10
    assert tree.match([1, 2, 3, 4]) == 4 and tree.match([1, 2, 9, 9]) == 2 and tree.match([7, 7, 7, 7, 7]) == 5
    tree.clear()
    assert tree.size == 0 and tree.match([1]) == 0


# ---------------------------------------------------------------------------- routing policy


def test_cache_aware_follows_prefix_and_rebalances() -> None:
    router = Router([CharEngine(), CharEngine()], balance_abs_threshold=2)
    a = router.choose(router.routing_key("alpha: hello"))
    b = router.choose(router.routing_key("beta: hello"))
    assert a != b  # no useful match (< half the prompt): the emptier replica takes the new prefix
    router.release(a, router.routing_key("alpha: hello"), [1, 2])
    router.release(b, router.routing_key("beta: hello"))
    for _ in range(3):
        assert router.choose(router.routing_key("alpha: hello, more")) == a
    # replica a now has 3 in flight, b none: the imbalance (> 2) wins over the prefix match
    assert router.choose(router.routing_key("alpha: hello, again")) == b
    assert router.stats().load[a] == 3


def test_round_robin_and_bad_arguments() -> None:
    router = Router([CharEngine(), CharEngine(), CharEngine()], policy="round_robin")
    assert [router.choose([1, 2, 3]) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    with pytest.raises(InvalidRequestError, match="policy"):
        Router([CharEngine()], policy="random")
    with pytest.raises(InvalidRequestError):
        Router([])


# ---------------------------------------------------------------------------- 2 CPU replicas


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir):
    from radix_backend.engine import Engine

    engines = [Engine(str(tiny_llama_dir), kv_cache_tokens=8192, seed=0) for _ in range(2)]
    yield engines
    for e in engines:
        e.shutdown()


def _multi_turn(router: Router, n_conversations: int = 8, n_turns: int = 4) -> tuple[float, list[list[str]]]:
    """Concurrent chats, each turn resending the whole history; returns (hit rate, transcripts)."""
    system = {"role": "system", "content": "You are a helpful assistant who answers briefly and precisely."}
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    totals = {"prompt": 0, "cached": 0}

    async def conversation(c: int) -> list[str]:
        rng = random.Random(c)  # per conversation: prompts must not depend on completion order
        history = [system]
        answers = []
        for t in range(n_turns):
            words = " ".join(rng.choice(["apple", "river", "stone", "cloud", "engine", "paper"]) for _ in range(6))
            history.append({"role": "user", "content": f"Conversation {c}, turn {t}: tell me about {words}."})
            out = await router.agenerate(messages=history, params=params)
            totals["prompt"] += out.meta.prompt_tokens
            totals["cached"] += out.meta.cached_tokens
            history.append({"role": "assistant", "content": out.text})
            answers.append(out.text)
        return answers

    async def main() -> list[list[str]]:
        return list(await asyncio.gather(*(conversation(c) for c in range(n_conversations))))

    transcripts = asyncio.run(main())
    return totals["cached"] / totals["prompt"], transcripts


def test_cache_aware_beats_round_robin_on_multi_turn(replicas) -> None:
    results = {}
    for policy in ("round_robin", "cache_aware"):
        for e in replicas:
            assert e.flush_cache()
        router = Router(replicas, policy=policy)
        results[policy] = _multi_turn(router)
        assert sum(router.stats().requests) == 32 and router.stats().load == [0, 0]
    rr_hit, rr_text = results["round_robin"]
    ca_hit, ca_text = results["cache_aware"]
    print(f"hit rate: cache_aware {ca_hit:.3f}, round_robin {rr_hit:.3f}")
    assert ca_text == rr_text  # greedy: routing changes where, never what
    assert ca_hit > rr_hit + 0.08, (ca_hit, rr_hit)
    assert (1 - ca_hit) < 0.85 * (1 - rr_hit)  # prompt tokens recomputed: clearly fewer
    assert min(router.stats().requests) >= 8  # both replicas serve: affinity did not pin everything on one


def test_router_behind_the_server(replicas) -> None:
    from radix_backend.server import ServerThread, create_app

    router = Router(replicas)
    with ServerThread(create_app(router, served_model_name="tiny")) as srv:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
            events = [ln for ln in r.iter_lines() if ln.startswith("data:")]
        assert r.status_code == 200 and events[-1] == "data: [DONE]"
        r = httpx.post(srv.url + "/generate", json={"text": ["a b c", "d e f"], "sampling_params": {"max_new_tokens": 3}})
        assert [len(x["output_ids"]) for x in r.json()] == [3, 3]
        info = httpx.get(srv.url + "/get_server_info").json()
        assert info["dp_size"] == 2
        stats = router.cache_stats()
        assert stats.slots_total == sum(e.cache_stats().slots_total for e in replicas)
    assert router.stats().load == [0, 0]
