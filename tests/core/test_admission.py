"""Admission policy and incremental detokenization on plain request objects (no model)."""

from __future__ import annotations

import pytest
import torch

from radix_backend.scheduler.admission import (DECODE_RESERVE_TOKENS, IN_BATCH_PREFIX_TOKENS, PrefillAdder, StepBudget,
                                     order_waiting)
from radix_backend.config import EngineConfig
from radix_backend.mem_cache.kv_manager import RequestSlots
from radix_backend.scheduler.request import Req, RequestHandle
from radix_backend.sampling_params import SamplingParams


def _req(prompt: list[int], *, cached: int = 0, node: object = None, kv_len: int | None = None,
         stop: list[str] | None = None) -> Req:
    params = SamplingParams(max_new_tokens=100, stop=stop or [])
    req = Req(rid=str(id(prompt)), prompt_ids=prompt, params=params, handle=RequestHandle("r", False),
              eos_token_ids=frozenset({0}), max_total_tokens=10_000)
    req.kv = RequestSlots(slots=torch.arange(cached if kv_len is None else kv_len), cached_len=cached, last_node=node)
    return req


def test_lpm_puts_the_longest_cached_prefix_first_and_is_stable():
    a, b, c, d = _req([1] * 10, cached=2), _req([2] * 10, cached=8), _req([3] * 10, cached=2), _req([4] * 10, cached=5)
    assert order_waiting([a, b, c, d], "lpm") == [b, d, a, c]


def test_dfs_weight_groups_requests_under_the_heaviest_node():
    shared, lone = object(), object()
    lone_long = _req([1] * 10, cached=9, node=lone)
    g1, g2, g3 = (_req([2, i], cached=c, node=shared) for i, c in ((1, 3), (2, 5), (3, 3)))
    assert order_waiting([lone_long, g1, g2, g3], "dfs-weight") == [g2, g1, g3, lone_long]


def test_fcfs_and_single_requests_keep_arrival_order():
    reqs = [_req([1], cached=0), _req([2], cached=9)]
    assert order_waiting(reqs, "fcfs") == reqs
    assert order_waiting(reqs[1:], "lpm") == reqs[1:]
    with pytest.raises(ValueError, match="schedule_policy"):
        EngineConfig(schedule_policy="random")


def test_step_budget_cuts_chunks_to_whole_pages():
    budget = StepBudget(prefill_tokens=10, page_size=4)
    assert budget.chunk_len(3) == 3  # fits whole: no rounding
    assert budget.chunk_len(25) == 8  # cut: to whole pages
    budget.spend(9)
    assert budget.chunk_len(25) == 0 and budget.chunk_len(1) == 1


def test_adder_reserves_decode_room_for_running_requests():
    running = [_req([5] * 4, kv_len=4) for _ in range(3)]  # decoding (prompt computed)
    adder = PrefillAdder(StepBudget(1000), running, max_running=8)
    new = _req([1] * 50)
    reserve = DECODE_RESERVE_TOKENS * 3
    assert adder.admissible_len(new, available_kv=reserve + 50) == 50
    assert adder.admissible_len(new, available_kv=reserve + 49) == 0


def test_adder_stops_at_the_seat_limit_and_the_token_budget():
    adder = PrefillAdder(StepBudget(60), [_req([9], kv_len=1)], max_running=3)
    first = _req([1] * 40)
    adder.admit(first, adder.admissible_len(first, 10_000))
    assert adder.has_room()
    second = _req([2] * 40)
    assert adder.admissible_len(second, 10_000) == 20  # the rest of the budget: a chunk
    adder.admit(second, 20)
    assert not adder.has_room()  # budget spent (and all 3 seats taken)
    assert adder.admitted == [first, second]


def test_adder_defers_a_request_sharing_an_uncached_prefix_with_one_being_prefilled():
    prefix = list(range(100, 100 + IN_BATCH_PREFIX_TOKENS))
    adder = PrefillAdder(StepBudget(1000), [], max_running=8)
    first = _req(prefix + [1, 2])
    assert not adder.should_defer(first)
    adder.admit(first, 10)
    assert adder.should_defer(_req(prefix + [3, 4]))  # would recompute the 8 shared tokens
    assert not adder.should_defer(_req(prefix[:-1] + [7, 3, 4]))  # shares fewer than the threshold
    assert not adder.should_defer(_req(prefix + [3, 4], cached=IN_BATCH_PREFIX_TOKENS))  # cached already


def test_adder_counts_running_requests_still_prefilling():
    chunked = _req(list(range(200, 240)), kv_len=10)  # a running request mid-prompt
    adder = PrefillAdder(StepBudget(1000), [chunked], max_running=8)
    assert adder.should_defer(_req(list(range(200, 220))))


class _CountingDecode:
    """A byte-level decoder over a toy vocabulary that counts the tokens it is asked to decode."""

    def __init__(self, vocab: dict[int, bytes]) -> None:
        self.vocab, self.decoded = vocab, 0

    def __call__(self, ids: list[int]) -> str:
        self.decoded += len(ids)
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")


def test_detokenize_is_incremental_and_equals_decoding_the_whole_output():
    euro = "€".encode()  # three bytes, split over two tokens
    vocab = {1: b"Hello", 2: b" wor", 3: b"ld", 4: euro[:1], 5: euro[1:], 6: b"!"}
    decode = _CountingDecode(vocab)
    req = _req([7])
    texts = []
    for tok in [1, 2, 3, 4, 5, 6] * 20:
        req.append_token(tok)
        req.detokenize(decode)
        texts.append(req.text)
        assert req.text == decode.__class__(vocab)(req.output_ids)
    assert "\ufffd" in texts[3] and "\ufffd" not in texts[4]  # pending half char, then completed
    assert decode.decoded < 8 * len(req.output_ids)  # constant work per token, not quadratic


def test_detokenize_cuts_at_a_stop_string_split_across_tokens():
    vocab = {1: b"ab", 2: b"cS", 3: b"TOP", 4: b"more"}
    req = _req([7], stop=["STOP"])
    for tok in [1, 2, 3, 4]:
        req.append_token(tok)
        req.detokenize(_CountingDecode(vocab))
        if req.finished:
            break
    assert req.text == "abc" and req.finish_reason == "stop" and req.matched_stop == "STOP"
    assert req.output_ids == [1, 2, 3]


def test_min_new_tokens_ignores_stop_tokens_strings_and_regexes_until_reached():
    vocab = {1: b"a", 2: b"STOP", 3: b"\n", 0: b""}
    req = _req([7], stop=["STOP"])
    req.params.min_new_tokens = 4  # as vLLM: stop tokens are masked for tokens 1-4, stop texts checked from token 4
    req.params.stop_regex = [r"\n"]
    for tok in [0, 2, 3]:  # EOS, a stop string and a stop-regex match, all within the first 3 tokens
        req.append_token(tok)
        req.detokenize(_CountingDecode(vocab))
        assert not req.finished, tok
    assert req.stop_token_ids == {0} and req.below_min_tokens
    req.append_token(1)
    req.detokenize(_CountingDecode(vocab))
    assert not req.finished  # the early "\n" does not count later either
    req.append_token(3)
    req.detokenize(_CountingDecode(vocab))
    assert req.finish_reason == "stop" and req.matched_stop == r"\n"
    assert req.text == "STOP\na\n"  # a stop regex keeps its text, as SGLang does


def test_stop_regex_is_validated():
    from radix_backend.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="stop_regex.*not a valid regular expression"):
        SamplingParams(stop_regex="(unclosed").validate()
    assert SamplingParams(stop_regex="a+").stop_regex == ["a+"]


def test_suppress_tokens_masks_only_the_rows_given():
    import torch

    from radix_backend.scheduler.sampling import suppress_tokens

    logits = torch.zeros(2, 5)
    suppress_tokens(logits, {1: {0, 3, 99}})
    assert torch.isinf(logits[1, [0, 3]]).all() and torch.isfinite(logits[0]).all() and logits[1, 1] == 0
