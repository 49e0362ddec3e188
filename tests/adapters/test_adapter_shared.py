"""One process, one engine: LangChain, LlamaIndex and Guidance reuse each other's KV for a shared
long system prompt (end-to-end on SmolLM2)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")
pytest.importorskip("guidance")

SYSTEM = ("You are the help desk of the Radix Lighthouse museum on Cape Verity. "
          "The museum opens at nine in the morning and closes at five in the afternoon, every day except Monday. "
          "Tickets cost twelve euros for adults and five euros for children; members enter for free. "
          "The lighthouse tower has 212 steps and a viewing gallery at the top. "
          "Answer visitors briefly and politely.")


def test_adapters_package_imports_no_framework() -> None:
    import subprocess
    import sys

    code = ("import sys, radix_backend.adapters as a; "
            "assert not {'langchain_core', 'llama_index', 'guidance'} & {m.split('.')[0] for m in sys.modules}; "
            "assert a.RadixChatModel.__module__ == 'radix_backend.adapters.langchain'; "
            "assert 'langchain_core' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _computed_and_served(engine: Any, run: Any) -> tuple[int, int]:
    """(prompt tokens the engine had to compute, prompt tokens served from the cache) during `run`."""
    before = engine.cache_stats()
    run()
    after = engine.cache_stats()
    served = after.cached_tokens - before.cached_tokens
    return after.prompt_tokens - before.prompt_tokens - served, served


@pytest.mark.slow
def test_three_frameworks_share_one_system_prompt_prefix(engine: Any) -> None:
    from guidance import assistant, gen, system, user
    from langchain_core.prompts import ChatPromptTemplate
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.core.llms import ChatMessage
    from llama_index.core.prompts import ChatPromptTemplate as LIChatPromptTemplate

    from radix_backend.adapters.guidance import RadixGuidance
    from radix_backend.adapters.langchain import RadixChatModel
    from radix_backend.adapters.llama_index import RadixLlamaIndexLLM

    engine.flush_cache()
    system_tokens = len(engine.encode(engine.apply_chat_template([{"role": "system", "content": SYSTEM}],
                                                                 add_generation_prompt=False)))

    # 1. LangChain computes the system prompt (nothing of it is cached yet).
    chain = ChatPromptTemplate.from_messages([("system", SYSTEM), ("user", "{q}")]) | \
        RadixChatModel(engine=engine, temperature=0, max_tokens=8)
    first = chain.invoke({"q": "When do you open?"})
    assert first.usage_metadata["input_token_details"]["cache_read"] < system_tokens // 2

    # 2. A LlamaIndex query engine with the same system prompt is served that prefix from the cache.
    qa = LIChatPromptTemplate(message_templates=[
        ChatMessage(role="system", content=SYSTEM),
        ChatMessage(role="user", content="Context:\n{context_str}\nQuestion: {query_str}")])
    index = VectorStoreIndex.from_documents([Document(text="The gift shop sells lighthouse models.")],
                                            embed_model=MockEmbedding(embed_dim=8))  # one doc: any vector
    query_engine = index.as_query_engine(llm=RadixLlamaIndexLLM(engine=engine, max_new_tokens=8),
                                         text_qa_template=qa, similarity_top_k=1)
    computed, served = _computed_and_served(engine, lambda: query_engine.query("What does the gift shop sell?"))
    assert served >= system_tokens - 1
    assert computed < 60  # the context and question only

    # 3. A guidance program with the same system role is served it too.
    def guidance_program() -> None:
        lm = RadixGuidance(engine=engine)
        with system():
            lm += SYSTEM
        with user():
            lm += "How many steps does the tower have?"
        with assistant():
            lm += gen("answer", max_tokens=6)
        assert lm["answer"] is not None

    # guidance asks for logits token by token; over the whole program only the user turn, the
    # assistant header and the generated tokens are computed, never the system prompt
    computed, served = _computed_and_served(engine, guidance_program)
    user_turn = len(engine.encode(engine.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How many steps does the tower have?"}],
        add_generation_prompt=True))) - system_tokens
    assert system_tokens > 60 and computed <= user_turn + 6 + 2, (computed, user_turn, system_tokens)


@pytest.mark.slow
def test_adapters_built_without_engine_share_the_process_engine(engine: Any) -> None:
    from radix_backend.adapters.guidance import RadixGuidance, RadixGuidanceEngine
    from radix_backend.adapters.langchain import RadixChatModel, RadixLLM
    from radix_backend.adapters.llama_index import RadixLlamaIndexLLM

    # engine= omitted: each adapter takes get_engine(model) (model=None: the embedded SmolLM2)
    assert RadixChatModel().engine is engine
    assert RadixLLM().engine is engine
    assert RadixLlamaIndexLLM().engine is engine
    assert RadixGuidance().radix_engine is engine
    assert isinstance(RadixGuidance().engine, RadixGuidanceEngine)  # guidance's own meaning of .engine
