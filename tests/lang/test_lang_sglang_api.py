"""SGLang 0.5.23's frontend API, on a scripted backend (no model): the names and keywords its
programs use, with SGLang's behaviour."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import radix_backend.lang as sgl
from radix_backend.lang import ir
from radix_backend.outputs import RequestMeta, StreamChunk, TokenLogprob

from test_lang_interpreter import FakeBackend


def test_regex_constants_are_sglangs():
    assert ir.REGEX_INT == r"[-+]?[0-9]+[ \n]*"
    assert ir.REGEX_FLOAT == r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
    assert ir.REGEX_BOOL == r"(True|False)"
    assert ir.REGEX_STR == r"\"[\w\d\s]*\""


def test_gen_takes_sglangs_keywords_in_sglangs_order():
    node = sgl.gen("x", 16, 4, 2, ["\n"], [7], r"\d", 0.5)  # name, max, min, n, stop, stop ids, stop_regex, temp
    assert node.overrides == {"max_new_tokens": 16, "min_new_tokens": 4, "stop": ["\n"], "stop_token_ids": [7],
                              "stop_regex": r"\d", "temperature": 0.5}
    assert node.options.n == 2
    node = sgl.gen("y", logprob_start_len=3, return_text_in_logprobs=True, return_logprob=True)
    assert node.options.logprob_start_len == 3 and node.options.return_text_in_logprobs
    with pytest.raises(sgl.ProgramError, match="n must be an int >= 1"):
        sgl.gen("z", n=0)
    with pytest.raises(sgl.ProgramError, match="stop_regex"):
        sgl.gen("z", stop_regex="(")


def test_min_tokens_and_stop_regex_reach_the_backend_from_gen_and_run():
    backend = FakeBackend()

    @sgl.function
    def prog(s):
        s += sgl.gen("a", min_tokens=5, stop_regex=[r"\.", "!"]) + sgl.gen("b")

    prog.run(backend=backend, stop_regex=r"\?", min_new_tokens=2)
    first, second = backend.params
    assert first.min_new_tokens == 5 and first.stop_regex == [r"\.", "!"]
    assert second.min_new_tokens == 2 and second.stop_regex == [r"\?"]  # the run's defaults


def test_n_samples_store_a_list_and_append_the_first():
    answers = iter(["one", "two", "three"])
    backend = FakeBackend(responder=lambda prompt, p: next(answers))

    @sgl.function
    def prog(s):
        s += "Q: " + sgl.gen("a", n=3)

    state = prog.run(backend=backend, temperature=0.7)
    assert state["a"] == ["one", "two", "three"] and state.text() == "Q: one"
    assert backend.batches == [["Q: "] * 3]  # one batch: the engine shares the prompt's KV


def test_run_level_n_is_the_default_of_every_gen():
    backend = FakeBackend()

    @sgl.function
    def prog(s):
        s += sgl.gen("a") + sgl.gen("b", n=1)

    state = prog.run(backend=backend, n=2)
    assert state["a"] == ["ok", "ok"] and state["b"] == "ok"


def test_forks_item_assignment_is_in_place_append():
    backend = FakeBackend(responder=lambda prompt, p: prompt[-1])

    @sgl.function
    def prog(s):
        forks = s.fork(2)
        for i in range(2):
            forks[i] += f"branch {i}:" + sgl.gen("x")
        forks += ["A", "B"]
        forks.join()

    state = prog.run(backend=backend)
    assert state["x"] == [":", ":"]
    with pytest.raises(sgl.ProgramError, match="can only store back"):
        group = sgl.ProgramStateGroup([prog.run(backend=backend), prog.run(backend=backend)])
        group[0] = group[1]


def test_run_batch_generator_style_yields_in_input_order():
    def slow_first(prompt, p):
        if prompt.endswith("0"):
            time.sleep(0.3)
        return prompt[-1]

    @sgl.function
    def prog(s, i):
        s += f"item {i}" + sgl.gen("echo")

    gen = prog.run_batch([{"i": i} for i in range(4)], backend=FakeBackend(responder=slow_first),
                         generator_style=True, num_threads=4)
    assert not isinstance(gen, list)
    assert [st["echo"] for st in gen] == ["0", "1", "2", "3"]
    with pytest.raises(sgl.ProgramError, match="unknown keyword"):
        prog.run_batch([{"i": 1}], backend=FakeBackend(), temprature=0)


def test_num_api_spec_tokens_is_accepted_and_refused_clearly_at_run():
    @sgl.function(num_api_spec_tokens=64)
    def prog(s):
        s += sgl.gen("a")

    assert prog.num_api_spec_tokens == 64
    with pytest.raises(sgl.UnsupportedFeatureError, match="num_api_spec_tokens"):
        prog.run(backend=FakeBackend())


def test_global_config_holds_the_default_backend_and_the_precache_switch():
    backend = FakeBackend()
    assert sgl.global_config.default_backend is None or isinstance(sgl.global_config.default_backend, sgl.BaseBackend)
    sgl.set_default_backend(backend)
    try:
        assert sgl.global_config.default_backend is backend and sgl.get_default_backend() is backend

        @sgl.function
        def prog(s, q):
            s += "A long shared instruction that every item of the batch starts with. " + q + sgl.gen("a")

        prog.run_batch([{"q": "x"}, {"q": "y"}])
        assert len(backend.cached) == 1
        sgl.global_config.enable_precache_with_tracing = False
        prog.run_batch([{"q": "x"}, {"q": "y"}])
        assert len(backend.cached) == 1
    finally:
        sgl.global_config.enable_precache_with_tracing = True
        sgl.global_config.default_backend = None
    assert isinstance(sgl.__version__, str) and sgl.__version__
    for name in ("verbosity", "skip_special_tokens_in_output", "enable_parallel_encoding"):
        assert hasattr(sgl.global_config, name)


def test_separate_reasoning_and_images_fail_clearly():
    with pytest.raises(sgl.UnsupportedFeatureError, match="reasoning"):
        sgl.separate_reasoning(sgl.gen("x"), model_type="deepseek-r1")


class _LogprobStreamBackend(FakeBackend):
    def generate_stream(self, prompt, params):
        for i, ch in enumerate("abcd"):
            time.sleep(0.01)
            lps = [TokenLogprob(token_id=100 + i, logprob=-float(i))] if params.logprobs else None
            last = i == 3
            yield StreamChunk(ch, [100 + i], "stop" if last else None,
                              RequestMeta(completion_tokens=4) if last else None, logprobs=lps)


def test_text_iter_with_meta_data_carries_running_counts_and_logprobs_so_far():
    """As SGLang's client reports a streamed gen: each piece's meta_info has the logprobs so far
    (cumulative) and running counts; the last one is the variable's meta_info."""
    @sgl.function
    def prog(s):
        s += sgl.gen("a", return_logprob=True)

    state = prog.run(backend=_LogprobStreamBackend(), stream=True)
    pieces = list(state.text_iter("a", return_meta_data=True))
    assert "".join(p for p, _ in pieces) == "abcd"
    last = pieces[-1][1]
    assert last["output_token_logprobs"] == [(-0.0, 100, None), (-1.0, 101, None), (-2.0, 102, None),
                                             (-3.0, 103, None)]
    for _, m in pieces:
        assert m["output_token_logprobs_length"] == len(m["output_token_logprobs"]) == m["completion_tokens"]
    assert [m["completion_tokens"] for _, m in pieces] == sorted(m["completion_tokens"] for _, m in pieces)
    assert last["completion_tokens"] == 4 and last["finish_reason"] == {"type": "stop", "matched": None}
    assert state.get_meta_info("a") == last

    async def collect():
        state = prog.run(backend=_LogprobStreamBackend(), stream=True)
        return [m async for m in state.text_async_iter("a", return_meta_data=True)]

    assert asyncio.run(collect())[-1][1]["completion_tokens"] == 4


def test_use_thread_false_runs_the_streamed_program_here():
    @sgl.function
    def prog(s):
        s += sgl.gen("a")

    state = prog.run(backend=FakeBackend(), stream=True, use_thread=False)
    assert state._run.thread is None and state._run.done.is_set()
    assert "".join(state.text_iter("a")) == "ok" and threading.active_count() >= 1
