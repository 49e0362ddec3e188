"""Public DSL API, same names and behaviour as sglang.lang.api (`import radix_backend.lang as sgl`)."""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

from radix_backend.errors import InvalidRequestError
from radix_backend.sampling_params import SamplingParams

from .backends.base import BaseBackend
from .choices import ChoicesSamplingMethod, token_length_normalized
from .errors import ProgramError, StreamUsageError, UnsupportedFeatureError
from .interpreter import ProgramState, run_program, run_program_batch
from .ir import SglExpr, SglExprList, SglGen, SglRoleBegin, SglRoleEnd, SglSelect, to_expr
from .prefix import cache_common_prefix, constant_prefix
from .tracer import TracerProgramState, placeholder_arguments, trace_program

_default_backend: BaseBackend | None = None
_default_lock = threading.Lock()


def set_default_backend(backend: BaseBackend) -> None:
    if not isinstance(backend, BaseBackend):
        raise ProgramError(f"set_default_backend needs a BaseBackend (e.g. RadixEngineBackend(), RuntimeEndpoint(url)), got {type(backend).__name__}")
    global _default_backend
    _default_backend = backend


def get_default_backend() -> BaseBackend:
    """The backend programs run on when none is passed: the in-process shared engine unless set."""
    global _default_backend
    with _default_lock:
        if _default_backend is None:
            from .backends.engine_backend import RadixEngineBackend

            _default_backend = RadixEngineBackend()
        return _default_backend


def flush_cache(backend: BaseBackend | None = None) -> bool:
    return (backend or get_default_backend()).flush_cache()


def get_server_info(backend: BaseBackend | None = None) -> dict[str, Any]:
    return (backend or get_default_backend()).get_server_info()


# ---- programs --------------------------------------------------------------------------------


def _defaults(max_new_tokens: int, stop: str | list[str] | None, stop_token_ids: list[int] | None, temperature: float,
              top_p: float, top_k: int, min_p: float, frequency_penalty: float, presence_penalty: float,
              ignore_eos: bool, return_logprob: bool, top_logprobs_num: int) -> SamplingParams:
    p = SamplingParams(max_new_tokens=max_new_tokens, stop=stop, stop_token_ids=stop_token_ids, temperature=temperature,
                       top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
                       presence_penalty=presence_penalty, ignore_eos=ignore_eos, logprobs=return_logprob,
                       top_logprobs=top_logprobs_num)
    p.validate()
    return p


class SglFunction:
    """A DSL program: a Python function whose first parameter is the program state `s`."""

    def __init__(self, func: Callable[..., Any], bind_arguments: dict[str, Any] | None = None) -> None:
        self.func = func
        self.name = getattr(func, "__name__", "program")
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
            raise ProgramError(f"@function {self.name}: the first parameter must be the program state, e.g. def {self.name}(s, ...)")
        self._signature = inspect.Signature(params[1:])
        self.arg_names = [p.name for p in params[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        self.bind_arguments = dict(bind_arguments or {})
        self._check_names(self.bind_arguments)
        functools.update_wrapper(self, func)

    def _check_names(self, kwargs: dict[str, Any]) -> None:
        accepts_any = any(p.kind is p.VAR_KEYWORD for p in self._signature.parameters.values())
        unknown = [k for k in kwargs if k not in self.arg_names]
        if unknown and not accepts_any:
            raise ProgramError(f"{self.name}() got unknown argument(s) {unknown}; it takes {self.arg_names}")

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """All arguments of one run by name, or a ProgramError naming what is wrong."""
        merged = {**self.bind_arguments, **kwargs}
        self._check_names(merged)
        try:
            bound = self._signature.bind(*args, **merged)
        except TypeError as exc:
            raise ProgramError(f"{self.name}(): {exc}; it takes {self.arg_names}") from None
        bound.apply_defaults()
        out = dict(bound.arguments)
        for p in self._signature.parameters.values():  # flatten *args/**kwargs back to call form
            if p.kind is p.VAR_KEYWORD:
                out.update(out.pop(p.name, {}))
            elif p.kind is p.VAR_POSITIONAL and out.pop(p.name, ()):
                raise ProgramError(f"{self.name}(): *{p.name} is not supported in DSL programs; use named arguments")
        return out

    def bind(self, **kwargs: Any) -> "SglFunction":
        return SglFunction(self.func, {**self.bind_arguments, **kwargs})

    def run(self, *args: Any, max_new_tokens: int = 128, stop: str | list[str] | None = None,
            stop_token_ids: list[int] | None = None, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
            min_p: float = 0.0, frequency_penalty: float = 0.0, presence_penalty: float = 0.0, ignore_eos: bool = False,
            return_logprob: bool = False, top_logprobs_num: int = 0, stream: bool = False,
            backend: BaseBackend | None = None, **kwargs: Any) -> ProgramState:
        """Run once; the sampling arguments are defaults for every gen that does not set its own.

        (There is no run-wide `seed`: forks would all sample the same text. Seed single gens.)"""
        defaults = _defaults(max_new_tokens, stop, stop_token_ids, temperature, top_p, top_k, min_p, frequency_penalty,
                             presence_penalty, ignore_eos, return_logprob, top_logprobs_num)
        arguments = self._bind(args, kwargs)
        return run_program(self, backend or get_default_backend(), arguments, defaults, stream=stream)

    def run_batch(self, batch_kwargs: list[dict[str, Any]], *, max_new_tokens: int = 128,
                  stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None, temperature: float = 1.0,
                  top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0, frequency_penalty: float = 0.0,
                  presence_penalty: float = 0.0, ignore_eos: bool = False, return_logprob: bool = False,
                  top_logprobs_num: int = 0, backend: BaseBackend | None = None,
                  num_threads: int | str = "auto", progress_bar: bool = False, cache_prefix: bool = True,
                  stream: bool = False) -> list[ProgramState]:
        """Run once per kwargs dict, concurrently; the engine batches the requests of all items."""
        if stream:
            raise StreamUsageError("run_batch() does not stream; call run(..., stream=True) for each program to stream")
        if not isinstance(batch_kwargs, (list, tuple)) or not all(isinstance(k, dict) for k in batch_kwargs):
            raise ProgramError("run_batch() takes a list of dicts of program arguments, e.g. [{'question': 'q1'}, ...]")
        defaults = _defaults(max_new_tokens, stop, stop_token_ids, temperature, top_p, top_k, min_p, frequency_penalty,
                             presence_penalty, ignore_eos, return_logprob, top_logprobs_num)
        arguments = [self._bind((), kw) for kw in batch_kwargs]
        backend = backend or get_default_backend()
        if cache_prefix:
            cache_common_prefix(self, backend, arguments)
        return run_program_batch(self, backend, arguments, defaults, num_threads=num_threads,
                                 progress_bar=progress_bar)

    def trace(self, *, backend: BaseBackend | None = None, **kwargs: Any) -> TracerProgramState:
        """IR graph of the program; arguments not given are placeholders. No model is called
        (`backend` is accepted for SGLang compatibility and unused)."""
        self._check_names(kwargs)
        return trace_program(self, placeholder_arguments(self, kwargs))

    def compile(self, *, backend: BaseBackend | None = None) -> "CompiledFunction":
        return CompiledFunction(self, backend or get_default_backend())

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def __repr__(self) -> str:
        return f"SglFunction({self.name}({', '.join(self.arg_names)}))"


class CompiledFunction:
    """A program traced once: its argument-independent prefix is cached before each run/batch."""

    def __init__(self, program: SglFunction, backend: BaseBackend) -> None:
        self.program = program
        self.backend = backend
        self.graph = program.trace()
        self.prefix = constant_prefix(self.graph, backend.get_chat_template())
        self._warm = False

    def _warm_prefix(self, force: bool) -> None:
        if self.prefix and (force or not self._warm):
            self.backend.cache_prefix(self.prefix)
            self._warm = True

    def run(self, *args: Any, **kwargs: Any) -> ProgramState:
        self._warm_prefix(force=False)
        return self.program.run(*args, backend=self.backend, **kwargs)

    def run_batch(self, batch_kwargs: list[dict[str, Any]], **kwargs: Any) -> list[ProgramState]:
        self._warm_prefix(force=True)  # cheap when still cached; re-inserts it if it was evicted
        kwargs.setdefault("cache_prefix", True)
        return self.program.run_batch(batch_kwargs, backend=self.backend, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)


def function(func: Callable[..., Any] | None = None) -> Any:
    """Decorator turning `def prog(s, ...)` into an SglFunction (`@function` or `@function()`)."""
    if func is None:
        return lambda f: SglFunction(f)
    return SglFunction(func)


# ---- expressions -----------------------------------------------------------------------------

_DTYPES: dict[Any, type | None] = {None: None, int: int, float: float, str: str, "int": int, "float": float, "str": str}


def gen(name: str | None = None, max_tokens: int | None = None, stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None, temperature: float | None = None, top_p: float | None = None,
        top_k: int | None = None, min_p: float | None = None, frequency_penalty: float | None = None,
        presence_penalty: float | None = None, ignore_eos: bool | None = None, return_logprob: bool | None = None,
        top_logprobs_num: int | None = None, seed: int | None = None, dtype: type | str | None = None,
        choices: list[str] | None = None, choices_method: ChoicesSamplingMethod | None = None,
        regex: str | None = None, json_schema: Any = None) -> SglExpr:
    """Generate into variable `name`. Unset arguments inherit the run's defaults.

    `choices=[...]` makes it a `select`; `dtype=int|float` constrains the text to a number (via a
    regex) and stores the parsed value; `regex` / `json_schema` constrain decoding in the engine.
    """
    if name is not None and (not isinstance(name, str) or not name):
        raise ProgramError(f"gen(name): name must be a non-empty str or None, got {name!r}")
    if choices is not None:
        return select(name, choices, 0.0 if temperature is None else temperature, choices_method or token_length_normalized)
    if dtype not in _DTYPES:
        raise ProgramError(f"gen({name!r}): dtype must be int, float or str, got {dtype!r}")
    fields = {"max_new_tokens": max_tokens, "stop": stop, "stop_token_ids": stop_token_ids, "temperature": temperature,
              "top_p": top_p, "top_k": top_k, "min_p": min_p, "frequency_penalty": frequency_penalty,
              "presence_penalty": presence_penalty, "ignore_eos": ignore_eos, "logprobs": return_logprob,
              "top_logprobs": top_logprobs_num, "seed": seed, "regex": regex, "json_schema": json_schema}
    overrides = {k: v for k, v in fields.items() if v is not None}
    try:
        SamplingParams(**overrides).validate()
    except (InvalidRequestError, TypeError) as exc:
        raise ProgramError(f"gen({name!r}): {exc}") from None
    return SglGen(name, overrides, _DTYPES[dtype])


def gen_int(name: str | None = None, **kwargs: Any) -> SglExpr:
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> SglExpr:
    return gen(name, dtype=str, **kwargs)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod = token_length_normalized) -> SglExpr:
    """Append the most likely of `choices` (scored with the shared prefix computed once)."""
    if (not isinstance(choices, (list, tuple)) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise ProgramError(f"select({name!r}): choices must be a non-empty list of non-empty strings, got {choices!r}")
    if not isinstance(choices_method, ChoicesSamplingMethod):
        raise ProgramError(
            f"select({name!r}): choices_method must be token_length_normalized, greedy_token_selection or "
            f"unconditional_likelihood_normalized, got {choices_method!r}"
        )
    return SglSelect(name, list(choices), float(temperature), choices_method)


def image(expr: Any) -> SglExpr:
    raise UnsupportedFeatureError(
        "image(): radix-backend serves text-only models (no vision encoder), so multimodal programs are not supported"
    )


def video(path: Any, num_frames: int = 0) -> SglExpr:
    raise UnsupportedFeatureError("video(): radix-backend serves text-only models, so video input is not supported")


def _role_common(role: str, expr: Any = None) -> SglExpr:
    if expr is None:
        return SglExprList([SglRoleBegin(role), SglRoleEnd(role)])
    return SglExprList([SglRoleBegin(role), to_expr(expr), SglRoleEnd(role)])


def system(expr: Any = None) -> SglExpr:
    return _role_common("system", expr)


def user(expr: Any = None) -> SglExpr:
    return _role_common("user", expr)


def assistant(expr: Any = None) -> SglExpr:
    return _role_common("assistant", expr)


def system_begin() -> SglExpr:
    return SglRoleBegin("system")


def system_end() -> SglExpr:
    return SglRoleEnd("system")


def user_begin() -> SglExpr:
    return SglRoleBegin("user")


def user_end() -> SglExpr:
    return SglRoleEnd("user")


def assistant_begin() -> SglExpr:
    return SglRoleBegin("assistant")


def assistant_end() -> SglExpr:
    return SglRoleEnd("assistant")
