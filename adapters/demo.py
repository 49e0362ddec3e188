"""The adapters part of `radix-backend demo`: LangChain, LlamaIndex, Guidance, DSPy, pydantic-ai, smolagents and
Haystack calls over
one shared system prompt, on the engine the demo already holds. The first three reuse each other's
KV; DSPy writes its own system prompt (field descriptions first, the instructions after them), so
it shares little with them, and its line says so."""

from __future__ import annotations

from typing import Any

from radix_backend.engine_like import EngineLike


def _computed_and_cached(engine: EngineLike, before: Any) -> str:
    after = engine.cache_stats()
    prompt = after.prompt_tokens - before.prompt_tokens
    cached = after.cached_tokens - before.cached_tokens
    return f"{cached}/{prompt} prompt tokens from cache"


def run_adapter_demo(engine: EngineLike, system: str, max_tokens: int = 24) -> None:
    """Each framework is skipped (with the install hint) when its extra is missing."""
    question = "In one sentence, what is a radix tree?"
    try:
        from langchain_core.messages import HumanMessage, SystemMessage

        from .langchain import RadixChatModel

        before = engine.cache_stats()
        msg = RadixChatModel(engine=engine, max_tokens=max_tokens, temperature=0).invoke(
            [SystemMessage(system), HumanMessage(question)])
        print(f"   LangChain RadixChatModel -> {str(msg.content).strip()}  ({_computed_and_cached(engine, before)})")
    except ImportError as exc:
        print(f"   LangChain: skipped ({exc})")
    try:
        from llama_index.core.llms import ChatMessage

        from .llama_index import RadixLlamaIndexLLM

        before = engine.cache_stats()
        resp = RadixLlamaIndexLLM(engine=engine, max_new_tokens=max_tokens, temperature=0).chat(
            [ChatMessage(role="system", content=system), ChatMessage(role="user", content=question + " Be brief.")])
        print(f"   LlamaIndex RadixLlamaIndexLLM -> {str(resp.message.content).strip()}  "
              f"({_computed_and_cached(engine, before)})")
    except ImportError as exc:
        print(f"   LlamaIndex: skipped ({exc})")
    try:
        from guidance import assistant, select, system as g_system, user

        from .guidance import RadixGuidance

        before = engine.cache_stats()
        lm = RadixGuidance(engine=engine)
        with g_system():
            lm += system
        with user():
            lm += "Is a radix tree a kind of trie? Answer yes or no."
        with assistant():
            lm += select(["yes", "no"], name="answer")
        print(f"   Guidance RadixGuidance select -> {lm['answer']}  ({_computed_and_cached(engine, before)})")
    except ImportError as exc:
        print(f"   Guidance: skipped ({exc})")
    try:
        import dspy

        from .dspy import RadixLM

        before = engine.cache_stats()
        with dspy.context(lm=RadixLM(engine, cache=False, max_tokens=max_tokens * 4), adapter=dspy.JSONAdapter()):
            pred = dspy.Predict(dspy.Signature("question -> answer", system))(question=question)
        print(f"   DSPy RadixLM Predict -> {str(pred.answer).strip()}  ({_computed_and_cached(engine, before)})")
    except ImportError as exc:
        print(f"   DSPy: skipped ({exc})")
    try:
        from pydantic_ai import Agent

        from .pydantic_ai import RadixModel

        before = engine.cache_stats()
        result = Agent(RadixModel(engine), instructions=system).run_sync(question,
                                                                         model_settings={"max_tokens": max_tokens})
        print(f"   pydantic-ai Agent(RadixModel) -> {str(result.output).strip()}  "
              f"({_computed_and_cached(engine, before)})")
    except ImportError as exc:
        print(f"   pydantic-ai: skipped ({exc})")
    try:
        from .smolagents import RadixSmolModel

        before = engine.cache_stats()
        reply = RadixSmolModel(engine, max_tokens=max_tokens).generate(
            [{"role": "system", "content": system}, {"role": "user", "content": question}])
        print(f"   smolagents RadixSmolModel -> {str(reply.content).strip()}  ({_computed_and_cached(engine, before)})")
    except ImportError as exc:
        print(f"   smolagents: skipped ({exc})")
    try:
        from haystack.dataclasses import ChatMessage as HaystackMessage

        from .haystack import RadixChatGenerator

        before = engine.cache_stats()
        reply = RadixChatGenerator(engine, generation_kwargs={"max_tokens": max_tokens}).run(
            [HaystackMessage.from_system(system), HaystackMessage.from_user(question)])["replies"][0]
        print(f"   Haystack RadixChatGenerator -> {str(reply.text).strip()}  ({_computed_and_cached(engine, before)})")
    except ImportError as exc:
        print(f"   Haystack: skipped ({exc})")
