"""Public DSL API, same names and behaviour as sglang.lang.api (`import radix_backend.lang as sgl`)."""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

from radix_backend.errors import InvalidRequestError
from radix_backend.sampling_params import SamplingParams

from .backends.base import BaseBackend
from .choices import ChoicesSamplingMethod, token_length_normalized
from .errors import ProgramError, StreamUsageError, UnsupportedFeatureError
from .async_bridge import run_in_greenlet
from .interpreter import ProgramState, run_program, run_program_async, run_program_batch, run_program_batch_async
from .global_config import global_config
from .ir import GenOptions, SglExpr, SglExprList, SglGen, SglRoleBegin, SglRoleEnd, SglSelect, to_expr
from .prefix import cache_common_prefix, constant_prefix
from .tracer import TracerProgramState, placeholder_arguments, trace_program

_default_lock = threading.Lock()


def _as_backend(backend: Any) -> Any:
    """SGLang lets a Runtime stand for its endpoint."""
    return getattr(backend, "endpoint", backend) if not isinstance(backend, BaseBackend) else backend


def set_default_backend(backend: BaseBackend) -> None:
    backend = _as_backend(backend)
    if not isinstance(backend, BaseBackend):
        raise ProgramError(f"set_default_backend needs a BaseBackend (e.g. RadixEngineBackend(), RuntimeEndpoint(url)), got {type(backend).__name__}")
    global_config.default_backend = backend


def get_default_backend() -> BaseBackend:
    """The backend programs run on when none is passed: the in-process shared engine unless set."""
    with _default_lock:
        if global_config.default_backend is None:
            from .backends.engine_backend import RadixEngineBackend

            global_config.default_backend = RadixEngineBackend()
        return global_config.default_backend


def flush_cache(backend: BaseBackend | None = None) -> bool:
    return (_as_backend(backend) or get_default_backend()).flush_cache()


def get_server_info(backend: BaseBackend | None = None) -> dict[str, Any]:
    return (_as_backend(backend) or get_default_backend()).get_server_info()


# ---- programs --------------------------------------------------------------------------------


# SGLang's run()/run_batch() sampling keywords and their defaults: every gen's unless it sets its own
RUN_SAMPLING_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128, "min_new_tokens": 0, "n": 1, "stop": None, "stop_token_ids": None, "stop_regex": None,
    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "ignore_eos": False, "return_logprob": None, "logprob_start_len": None, "top_logprobs_num": None,
    "return_text_in_logprobs": None,
}


def _run_defaults(where: str, values: dict[str, Any]) -> tuple[SamplingParams, GenOptions]:
    """A run's default SamplingParams and GenOptions from its sampling keywords."""
    v = {**RUN_SAMPLING_DEFAULTS, **values}
    try:
        p = SamplingParams(max_new_tokens=v["max_new_tokens"], min_new_tokens=v["min_new_tokens"], stop=v["stop"],
                           stop_token_ids=v["stop_token_ids"], stop_regex=v["stop_regex"], temperature=v["temperature"],
                           top_p=v["top_p"], top_k=v["top_k"], min_p=v["min_p"],
                           frequency_penalty=v["frequency_penalty"], presence_penalty=v["presence_penalty"],
                           ignore_eos=v["ignore_eos"], logprobs=bool(v["return_logprob"]),
                           top_logprobs=v["top_logprobs_num"] or 0,
                           skip_special_tokens=global_config.skip_special_tokens_in_output)
        p.validate()
    except InvalidRequestError as exc:
        raise ProgramError(f"{where}: {exc}") from None
    options = GenOptions(n=v["n"], logprob_start_len=v["logprob_start_len"],
                         return_text_in_logprobs=bool(v["return_text_in_logprobs"]))
    _check_options(where, options)
    return p, options


def _check_options(where: str, options: GenOptions) -> None:
    if options.n is not None and (not isinstance(options.n, int) or isinstance(options.n, bool) or options.n < 1):
        raise ProgramError(f"{where}: n must be an int >= 1, got {options.n!r}")
    start = options.logprob_start_len
    if start is not None and (not isinstance(start, int) or isinstance(start, bool)):
        raise ProgramError(f"{where}: logprob_start_len must be an int, got {start!r}")


def _split_sampling(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Take SGLang's sampling keywords out of run()'s kwargs; what is left are program arguments."""
    return {k: kwargs.pop(k) for k in list(kwargs) if k in RUN_SAMPLING_DEFAULTS}


class SglFunction:
    """A DSL program: a Python function whose first parameter is the program state `s`."""

    def __init__(self, func: Callable[..., Any], bind_arguments: dict[str, Any] | None = None,
                 num_api_spec_tokens: int | None = None) -> None:
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.name = getattr(func, "__name__", "program")
        if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
            raise ProgramError(
                f"@function {self.name}: write the program as a plain `def`; "
                "`await prog.run_async(...)` runs it on the event loop without blocking it")
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
        return SglFunction(self.func, {**self.bind_arguments, **kwargs}, self.num_api_spec_tokens)

    def _check_spec_tokens(self) -> None:
        if self.num_api_spec_tokens is not None:
            raise UnsupportedFeatureError(
                f"@function({self.name}, num_api_spec_tokens=...) is SGLang's speculative execution for OpenAI-style "
                "API backends; radix backends run every gen directly (and reuse the shared prefix from the radix "
                "cache), so drop num_api_spec_tokens")

    def run(self, *args: Any, stream: bool = False, backend: BaseBackend | None = None, use_thread: bool = True,
            **kwargs: Any) -> ProgramState:
        """Run once. SGLang's sampling keywords (`RUN_SAMPLING_DEFAULTS`: max_new_tokens, n, stop, stop_regex,
        temperature, ..., return_logprob, logprob_start_len) are defaults for every gen that does not set its
        own; the other keywords are program arguments. `stream=True` runs on a thread (text_iter reads it as
        it grows) unless `use_thread=False`, which runs it here first.

        (There is no run-wide `seed`: forks would all sample the same text. Seed single gens.)"""
        self._check_spec_tokens()
        defaults, options = _run_defaults(f"{self.name}.run()", _split_sampling(kwargs))
        arguments = self._bind(args, kwargs)
        return run_program(self, _as_backend(backend) or get_default_backend(), arguments, defaults, stream=stream,
                           options=options, use_thread=use_thread)

    async def run_async(self, *args: Any, stream: bool = False, backend: BaseBackend | None = None,
                        **kwargs: Any) -> ProgramState:
        """`run` for async code: the program runs on this event loop (no thread), every model call
        awaited, so many programs share one engine from one loop. With `stream=True` it returns at once:
        `async for piece in state.text_async_iter(name)`, `await state.wait()`. Cancelling the awaiting
        task aborts the program's requests."""
        self._check_spec_tokens()
        defaults, options = _run_defaults(f"{self.name}.run_async()", _split_sampling(kwargs))
        arguments = self._bind(args, kwargs)
        return await run_program_async(self, _as_backend(backend) or get_default_backend(), arguments, defaults,
                                       stream=stream, options=options)

    async def run_batch_async(self, batch_kwargs: list[dict[str, Any]], *, backend: BaseBackend | None = None,
                              max_concurrency: int | None = None, progress_bar: bool = False,
                              cache_prefix: bool | None = None, **sampling: Any) -> list[ProgramState]:
        """`run_batch` for async code: every item a task on this loop (at most `max_concurrency` at
        once), the engine batching their requests; the states in input order."""
        if max_concurrency is not None and (not isinstance(max_concurrency, int) or max_concurrency < 1):
            raise ProgramError(f"max_concurrency must be None or an int >= 1, got {max_concurrency!r}")
        defaults, options, arguments, backend = self._batch_setup("run_batch_async", batch_kwargs, backend, sampling)
        if global_config.enable_precache_with_tracing if cache_prefix is None else cache_prefix:
            await run_in_greenlet(cache_common_prefix, self, backend, arguments)
        return await run_program_batch_async(self, backend, arguments, defaults, max_concurrency=max_concurrency,
                                             progress_bar=progress_bar, options=options)

    def _batch_setup(self, where: str, batch_kwargs: Any, backend: BaseBackend | None,
                     sampling: dict[str, Any]) -> tuple[SamplingParams, GenOptions, list[dict[str, Any]], BaseBackend]:
        """A batch run's defaults, options, per-item arguments and backend, or a ProgramError."""
        if not isinstance(batch_kwargs, (list, tuple)) or not all(isinstance(k, dict) for k in batch_kwargs):
            raise ProgramError(f"{where}() takes a list of dicts of program arguments, e.g. [{{'question': 'q1'}}, ...]")
        unknown = sorted(set(sampling) - set(RUN_SAMPLING_DEFAULTS))
        if unknown:
            raise ProgramError(f"{where}() got unknown keyword(s) {unknown}; sampling keywords: "
                               f"{sorted(RUN_SAMPLING_DEFAULTS)}")
        self._check_spec_tokens()
        defaults, options = _run_defaults(f"{self.name}.{where}()", sampling)
        arguments = [self._bind((), kw) for kw in batch_kwargs]
        return defaults, options, arguments, _as_backend(backend) or get_default_backend()

    def run_batch(self, batch_kwargs: list[dict[str, Any]], *, backend: BaseBackend | None = None,
                  num_threads: int | str = "auto", progress_bar: bool = False, generator_style: bool = False,
                  cache_prefix: bool | None = None, stream: bool = False,
                  **sampling: Any) -> list[ProgramState] | Iterator[ProgramState]:
        """Run once per kwargs dict, concurrently; the engine batches the requests of all items.
        `sampling`: the keywords of run(). With `generator_style`, yield the states in input order as they
        finish. `cache_prefix` (default: global_config.enable_precache_with_tracing) puts the items'
        common constant prefix in the cache first."""
        if stream:
            raise StreamUsageError("run_batch() does not stream; call run(..., stream=True) for each program to stream")
        defaults, options, arguments, backend = self._batch_setup("run_batch", batch_kwargs, backend, sampling)
        if global_config.enable_precache_with_tracing if cache_prefix is None else cache_prefix:
            cache_common_prefix(self, backend, arguments)
        return run_program_batch(self, backend, arguments, defaults, num_threads=num_threads,
                                 progress_bar=progress_bar, options=options, generator_style=generator_style)

    def trace(self, *, backend: BaseBackend | None = None, **kwargs: Any) -> TracerProgramState:
        """IR graph of the program; arguments not given are placeholders. No model is called
        (`backend` is accepted for SGLang compatibility and unused)."""
        self._check_names(kwargs)
        return trace_program(self, placeholder_arguments(self, kwargs))

    def compile(self, *, backend: BaseBackend | None = None) -> "CompiledFunction":
        return CompiledFunction(self, _as_backend(backend) or get_default_backend())

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


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None) -> Any:
    """Decorator turning `def prog(s, ...)` into an SglFunction (`@function` or `@function(...)`)."""
    if func is None:
        return lambda f: SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)
    return SglFunction(func, num_api_spec_tokens=num_api_spec_tokens)


# ---- expressions -----------------------------------------------------------------------------

_DTYPES: dict[Any, type | None] = {None: None, int: int, float: float, str: str, bool: bool,
                                   "int": int, "float": float, "str": str, "bool": bool}


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None, n: int | None = None,
        stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
        stop_regex: str | list[str] | None = None, temperature: float | None = None, top_p: float | None = None,
        top_k: int | None = None, min_p: float | None = None, frequency_penalty: float | None = None,
        presence_penalty: float | None = None, ignore_eos: bool | None = None, return_logprob: bool | None = None,
        logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None, dtype: type | str | None = None,
        choices: list[str] | None = None, choices_method: ChoicesSamplingMethod | None = None,
        regex: str | None = None, json_schema: Any = None, *, seed: int | None = None) -> SglExpr:
    """Generate into variable `name` (SGLang's arguments, in SGLang's order). Unset ones inherit the run's.

    `choices=[...]` makes it a `select`. `dtype` (int, float, str, bool or their names) constrains the
    text to SGLang's REGEX_INT / REGEX_FLOAT / REGEX_STR / REGEX_BOOL (int and float also stop at a space
    or newline); the variable holds the generated text, as in SGLang. `n` > 1 makes the variable a list
    of n texts (the first is appended). `min_tokens`: stops are ignored until that many tokens.
    """
    if name is not None and (not isinstance(name, str) or not name):
        raise ProgramError(f"gen(name): name must be a non-empty str or None, got {name!r}")
    if choices is not None:
        return select(name, choices, 0.0 if temperature is None else temperature, choices_method or token_length_normalized)
    if dtype not in _DTYPES:
        raise ProgramError(f"gen({name!r}): dtype must be int, float, str or bool (or their names), got {dtype!r}")
    fields = {"max_new_tokens": max_tokens, "min_new_tokens": min_tokens, "stop": stop, "stop_token_ids": stop_token_ids,
              "stop_regex": stop_regex, "temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
              "frequency_penalty": frequency_penalty, "presence_penalty": presence_penalty, "ignore_eos": ignore_eos,
              "logprobs": return_logprob, "top_logprobs": top_logprobs_num, "seed": seed, "regex": regex,
              "json_schema": json_schema}
    overrides = {k: v for k, v in fields.items() if v is not None}
    try:
        SamplingParams(**overrides).validate()
    except (InvalidRequestError, TypeError) as exc:
        raise ProgramError(f"gen({name!r}): {exc}") from None
    options = GenOptions(n=n, logprob_start_len=logprob_start_len, return_text_in_logprobs=return_text_in_logprobs)
    _check_options(f"gen({name!r})", options)
    return SglGen(name, overrides, _DTYPES[dtype], options)


def gen_int(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> SglExpr:
    return gen(name, max_tokens, dtype=int, **kwargs)


def gen_string(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> SglExpr:
    return gen(name, max_tokens, dtype=str, **kwargs)


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


def separate_reasoning(expr: Any = None, model_type: str | None = None) -> SglExpr:
    """SGLang's reasoning/answer split needs a reasoning model and its parser; none is served here."""
    raise UnsupportedFeatureError(
        "separate_reasoning() needs a reasoning model (e.g. DeepSeek-R1, Qwen3) and SGLang's reasoning parser; "
        "radix-backend has no reasoning parser yet: generate normally and split the text yourself")
