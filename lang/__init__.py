"""SGLang-style frontend language on radix-backend: `import radix_backend.lang as sgl`.

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

    state = qa.run(question="What is the capital of France?", temperature=0)
    print(state["answer"])

Programs run on the process-shared engine unless `set_default_backend(...)` picks another backend.
"""

from importlib.metadata import PackageNotFoundError, version as _version

from .api import (CompiledFunction, SglFunction, assistant, assistant_begin, assistant_end, flush_cache, function, gen,
                  gen_int, gen_string, get_default_backend, get_server_info, image, select, separate_reasoning,
                  set_default_backend, system, system_begin, system_end, user, user_begin, user_end, video)
from .backends import BaseBackend, RadixEngineBackend
from .chat_template import ChatTemplate
from .choices import (ChoicesDecision, ChoicesSamplingMethod, greedy_token_selection, token_length_normalized,
                      unconditional_likelihood_normalized)
from .errors import ProgramError, StreamUsageError, UnknownVariableError, UnsupportedFeatureError
from .global_config import GlobalConfig, global_config
from .interpreter import ProgramState, ProgramStateGroup
from .tracer import TracerProgramState

try:
    __version__ = _version("radix-backend")
except PackageNotFoundError:  # a source tree without an install
    __version__ = "0.0.0"

__all__ = [
    "__version__", "global_config", "GlobalConfig", "Runtime", "Engine", "separate_reasoning",
    "function", "gen", "gen_int", "gen_string", "select", "image", "video",
    "system", "user", "assistant", "system_begin", "system_end", "user_begin", "user_end", "assistant_begin",
    "assistant_end", "set_default_backend", "get_default_backend", "flush_cache", "get_server_info",
    "SglFunction", "CompiledFunction", "ProgramState", "ProgramStateGroup", "TracerProgramState",
    "BaseBackend", "RadixEngineBackend", "RuntimeEndpoint", "ChatTemplate",
    "ChoicesDecision", "ChoicesSamplingMethod", "token_length_normalized", "greedy_token_selection",
    "unconditional_likelihood_normalized",
    "ProgramError", "UnknownVariableError", "StreamUsageError", "UnsupportedFeatureError",
]


def __getattr__(name: str):
    """Heavier names load on first use (an HTTP client; a server process; an in-process engine)."""
    if name == "RuntimeEndpoint":
        from .backends.runtime_endpoint import RuntimeEndpoint

        return RuntimeEndpoint
    if name in ("Runtime", "Engine"):
        from . import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'radix_backend.lang' has no attribute {name!r}")
