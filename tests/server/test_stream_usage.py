"""The streamed usage race, end to end: the scheduler pauses right after pushing a request's last
chunk (before it builds the request's output), so every consumer reads that chunk while the
request is still being finished. Each consumer must report the full counts."""

from __future__ import annotations

import asyncio
import time

import pytest

from radix_backend import SamplingParams
from radix_backend.scheduler.request import RequestHandle

PROMPT = "Count to ten: one two"
NEW = 6


@pytest.fixture
def slow_finish(monkeypatch):
    """Forced interleaving: after the final chunk is pushed, the scheduler sleeps before going on."""
    original = RequestHandle.push_chunk

    def push_chunk(self, chunk):
        original(self, chunk)
        if chunk.finish_reason is not None:
            time.sleep(0.2)  # the consumer wakes and reads the chunk now

    monkeypatch.setattr(RequestHandle, "push_chunk", push_chunk)


def test_engine_stream_usage(tiny_engine, slow_finish):
    last = list(tiny_engine.stream(PROMPT, SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=0)))[-1]
    assert (last.meta.prompt_tokens, last.meta.completion_tokens) == (len(tiny_engine.encode(PROMPT)), NEW)


def test_langchain_stream_usage(tiny_engine, slow_finish):
    pytest.importorskip("langchain_core")
    from radix_backend.adapters.langchain import RadixChatModel

    chat = RadixChatModel(engine=tiny_engine, max_tokens=NEW, temperature=0, model_kwargs={"ignore_eos": True})
    chunks = list(chat.stream("hi"))
    usage = chunks[-1].usage_metadata
    assert usage["output_tokens"] == NEW and usage["input_tokens"] > 0

    async def astream():
        return [c async for c in chat.astream("hi")]

    assert asyncio.run(astream())[-1].usage_metadata["output_tokens"] == NEW


def test_llama_index_stream_usage(tiny_engine, slow_finish):
    pytest.importorskip("llama_index.core")
    from llama_index.core.llms import ChatMessage

    from radix_backend.adapters.llama_index import RadixLlamaIndexLLM

    llm = RadixLlamaIndexLLM(engine=tiny_engine, max_new_tokens=NEW, sampling_kwargs={"ignore_eos": True})
    last = list(llm.stream_chat([ChatMessage(role="user", content="hi")]))[-1]
    assert last.additional_kwargs["completion_tokens"] == NEW and last.additional_kwargs["prompt_tokens"] > 0


def test_server_streamed_usage(tiny_engine, slow_finish):
    openai = pytest.importorskip("openai")
    from radix_backend.server import ServerThread, create_app

    with ServerThread(create_app(tiny_engine)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        chunks = list(client.completions.create(model="default", prompt=PROMPT, max_tokens=NEW, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == NEW
    assert chunks[-1].usage.prompt_tokens == len(tiny_engine.encode(PROMPT))
