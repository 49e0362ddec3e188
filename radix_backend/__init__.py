"""radix-backend: a RadixAttention inference engine that LangChain, LlamaIndex, Guidance and an
SGLang-style DSL share in one process."""

from .engine import CacheStats, Engine, get_engine
from .errors import (ConstraintError, InvalidRequestError, KVCacheTooSmallError, MissingDependencyError,
                     ModelLoadError, PromptTooLongError, RadixBackendError, RequestAbortedError)
from .outputs import ChoiceScore, GenerateOutput, RequestMeta, StreamChunk, TokenLogprob
from .sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "Engine", "get_engine", "CacheStats", "SamplingParams", "GenerateOutput", "StreamChunk", "ChoiceScore",
    "RequestMeta", "TokenLogprob", "RadixBackendError", "InvalidRequestError", "PromptTooLongError",
    "KVCacheTooSmallError", "ModelLoadError", "ConstraintError", "RequestAbortedError", "MissingDependencyError",
]
