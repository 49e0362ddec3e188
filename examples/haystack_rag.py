"""A Haystack RAG pipeline on radix-backend: BM25 retrieval, a chat prompt, `RadixChatGenerator`.

The pipeline's fixed instructions and the retrieved passages are resent with every question; the
shared engine's radix cache computes each shared prefix once.

    python examples/haystack_rag.py
"""

from __future__ import annotations

import os

os.environ.setdefault("HAYSTACK_TELEMETRY_ENABLED", "False")

from haystack import Document, Pipeline  # noqa: E402
from haystack.components.builders import ChatPromptBuilder  # noqa: E402
from haystack.components.retrievers.in_memory import InMemoryBM25Retriever  # noqa: E402
from haystack.dataclasses import ChatMessage  # noqa: E402
from haystack.document_stores.in_memory import InMemoryDocumentStore  # noqa: E402

from radix_backend import get_engine  # noqa: E402
from radix_backend.adapters.haystack import RadixChatGenerator  # noqa: E402

DOCS = ["The Radix Lighthouse on Cape Verity was built in 1874 by the engineer Mara Quill.",
        "The Alder Orchard grows forty kinds of apples and opens its cider press every October.",
        "Cape Verity's ferry leaves the harbour at seven every morning and returns at dusk."]
TEMPLATE = [ChatMessage.from_system("Answer in one short sentence, using only the documents."),
            ChatMessage.from_user("Documents:\n{% for d in documents %}- {{ d.content }}\n{% endfor %}"
                                  "Question: {{ question }}")]


def main() -> None:
    engine = get_engine()
    store = InMemoryDocumentStore()
    store.write_documents([Document(content=d) for d in DOCS])
    rag = Pipeline()
    rag.add_component("retriever", InMemoryBM25Retriever(document_store=store, top_k=2))
    rag.add_component("prompt", ChatPromptBuilder(template=TEMPLATE, required_variables=["documents", "question"]))
    rag.add_component("llm", RadixChatGenerator(engine, generation_kwargs={"max_tokens": 40}))
    rag.connect("retriever.documents", "prompt.documents")
    rag.connect("prompt.prompt", "llm.messages")
    for question in ("Who built the lighthouse?", "When was the lighthouse built?", "What does the orchard grow?"):
        reply = rag.run({"retriever": {"query": question}, "prompt": {"question": question}})["llm"]["replies"][0]
        usage = reply.meta["usage"]
        print(f"{question} -> {reply.text.strip()!r} ({usage['prompt_tokens_details']['cached_tokens']}/"
              f"{usage['prompt_tokens']} prompt tokens from cache)")
    stats = engine.cache_stats()
    print(f"radix cache: {stats.cached_tokens}/{stats.prompt_tokens} prompt tokens reused ({stats.hit_rate:.0%})")


if __name__ == "__main__":
    main()
