"""SGLang-style frontend language on radix-backend: `import radix_backend.lang as sgl`.

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

    state = qa.run(question="What is the capital of France?", temperature=0)
    print(state["answer"])

Programs run on the process-shared engine unless `set_default_backend(...)` picks another backend.
"""

from .api import (CompiledFunction, SglFunction, assistant, assistant_begin, assistant_end, flush_cache, function, gen,
                  gen_int, gen_string, get_default_backend, get_server_info, image, select, set_default_backend,
                  system, system_begin, system_end, user, user_begin, user_end, video)
from .backends import BaseBackend, RadixEngineBackend
from .chat_template import ChatTemplate
from .choices import (ChoicesDecision, ChoicesSamplingMethod, greedy_token_selection, token_length_normalized,
                      unconditional_likelihood_normalized)
from .errors import ProgramError, StreamUsageError, UnknownVariableError, UnsupportedFeatureError
from .interpreter import ProgramState, ProgramStateGroup
from .tracer import TracerProgramState

__all__ = [
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
    if name == "RuntimeEndpoint":
        from .backends.runtime_endpoint import RuntimeEndpoint

        return RuntimeEndpoint
    raise AttributeError(f"module 'radix_backend.lang' has no attribute {name!r}")
