"""Executes DSL programs (cf. sglang.lang.interpreter).

`s += expr` only queues `expr` on the state. Queued work runs when something needs its result
(a variable read, `text()`, `fork`, the end of the program). Draining runs every state of the
program in lock-step: each state advances through its local work (text, roles) to its next
`gen`, and all those gens go to the backend as ONE batch. So the branches of a fork, whose
prompts share the parent's text, are submitted together, after the parent's text has been put
in the radix cache once (`backend.cache_prefix` at fork time).

`run(stream=True)` executes the program on a background thread; `text_iter()` follows it.
`run_async` executes it in a greenlet on the caller's event loop (`async_bridge`): the same
draining, with every backend call awaited, so many programs wait on one engine without threads.
"""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, nullcontext
from typing import TYPE_CHECKING, Any

from greenlet import getcurrent

from radix_backend.outputs import GenerateOutput
from radix_backend.sampling_params import SamplingParams
from radix_backend.sglang_meta import finished_meta, LogprobEntry, LogprobOptions, StreamMeta

from .async_bridge import call, iterate, run_in_greenlet
from .chat_template import ChatTemplate
from .errors import ProgramError, StreamUsageError, UnknownVariableError, UnsupportedFeatureError
from .global_config import global_config
from .ir import (
    DTYPE_REGEXES,
    GenOptions,
    Program,
    BACKEND_NODES,
    TRACE_ONLY_NODES,
    SglConcateAndAppend,
    SglConstantText,
    SglExpr,
    SglGen,
    SglRoleBegin,
    SglRoleEnd,
    SglSelect,
    SglVarScopeBegin,
    SglVarScopeEnd,
    flatten,
    to_expr,
)
from .roles import RoleMethods

if TYPE_CHECKING:
    from .backends.base import BaseBackend

class ProgramRun:
    """One execution of a program: its states, backend, default sampling params and thread."""

    def __init__(self, backend: "BaseBackend", defaults: SamplingParams, chat_template: ChatTemplate | None = None,
                 options: GenOptions | None = None) -> None:
        self.backend = backend
        self.defaults = defaults
        self.options = options or GenOptions(n=1, return_text_in_logprobs=False)
        self._chat_template = chat_template
        self.states: list[ProgramState] = []
        self.lock = threading.RLock()
        self.thread: threading.Thread | None = None  # a streamed run()'s
        self.task: asyncio.Task | None = None  # a streamed run_async()'s
        self.executor: Any = None  # the greenlet running the body
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._waiters: list[asyncio.Future] = []  # async readers of a run_async program, woken on change

    @property
    def chat_template(self) -> ChatTemplate:
        if self._chat_template is None:
            self._chat_template = self.backend.get_chat_template()
        return self._chat_template

    @property
    def background(self) -> bool:
        """Streamed: the body runs on its own thread or task while the caller reads."""
        return self.thread is not None or self.task is not None

    def on_executor(self) -> bool:
        """Whether the caller is the program's body itself."""
        if self.thread is not None:
            return threading.current_thread() is self.thread
        return getcurrent() is self.executor

    def running_elsewhere(self, what: str) -> bool:
        """True while a streamed body runs on its thread (the caller may block for it); a program
        streaming on this event loop cannot be waited for without `await` (StreamUsageError)."""
        if not self.background or self.done.is_set() or self.on_executor():
            return False
        if self.task is not None:
            raise StreamUsageError(
                f"{what} needs the program to finish, and it is still running on this event loop: "
                f"`await state.wait()` first, or read it with `async for ... in state.text_async_iter(...)`")
        return True

    def wake(self) -> None:
        """Something changed: wake async readers (called on the loop's thread in run_async mode)."""
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    async def changed(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        await waiter

    def finish(self) -> None:
        self.done.set()
        for st in self.states:
            with st._cond:
                st._cond.notify_all()
        self.wake()


class ProgramState(RoleMethods):
    """The `s` of a program: text so far, chat messages, variables and their meta info."""

    def __init__(self, run: ProgramRun, *, stream_root: bool = False) -> None:
        self._run = run
        self._stream_root = stream_root
        self._text = ""
        self._messages: list[dict[str, str]] = []
        self._variables: dict[str, Any] = {}
        self._var_raw: dict[str, str] = {}  # generated text of each variable (streamed while it grows)
        self._var_stream_meta: dict[str, dict[str, Any]] = {}  # streamed variables' meta_info so far
        self._vars_done: set[str] = set()
        self._meta: dict[str, dict[str, Any]] = {}
        self._written: set[str] = set()  # variables set since this state was forked (gathered by join)
        self._pending: deque[SglExpr] = deque()
        self._cur_role: str | None = None
        self._cur_role_begin = 0
        self._scopes: dict[str, int] = {}
        self._fork_start = 0
        self._parent: ProgramState | None = None
        self._cond = threading.Condition()
        self.ret_value: Any = None
        run.states.append(self)

    # ---- building ---------------------------------------------------------------------
    def __iadd__(self, other: Any) -> "ProgramState":
        self._submit(to_expr(other))
        return self

    def _submit(self, expr: SglExpr) -> None:
        with self._run.lock:
            self._pending.extend(flatten([expr]))

    def fork(self, size: int = 1) -> "ProgramStateGroup":
        """`size` copies of this state that continue independently and share its prefix in the cache."""
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ProgramError(f"fork(size) needs an int >= 1, got {size!r}")
        self.sync(everything=False)
        if size > 1 and self._text:
            call(self._run.backend, "cache_prefix", self._text)
        return ProgramStateGroup([self._child() for _ in range(size)], src_state=self)

    def _child(self) -> "ProgramState":
        c = ProgramState(self._run)
        c._text, c._messages = self._text, list(self._messages)
        c._variables, c._var_raw, c._meta = dict(self._variables), dict(self._var_raw), dict(self._meta)
        c._vars_done = set(self._vars_done)
        c._cur_role, c._cur_role_begin = self._cur_role, self._cur_role_begin
        c._scopes = dict(self._scopes)
        c._fork_start, c._parent = len(self._text), self
        return c

    # ---- reading ----------------------------------------------------------------------
    def sync(self, everything: bool = True) -> None:
        """Run all queued work (of the whole program, so sibling forks batch; or only this state's)."""
        run = self._run
        if run.running_elsewhere("reading the state"):
            run.done.wait()  # a streamed program is still running on its thread
        if run.error is not None and run.background:
            raise run.error
        _drain(run.states if everything else [self], only=None if everything else self)

    def text(self) -> str:
        self.sync()
        return self._text

    def messages(self) -> list[dict[str, str]]:
        self.sync()
        return [dict(m) for m in self._messages]

    def get_var(self, name: str) -> Any:
        run = self._run
        if name in self._vars_done and run.background and not run.done.is_set() and not run.on_executor():
            return self._variables[name]  # a streamed program's finished variable
        if run.running_elsewhere(f"state[{name!r}]"):
            with self._cond:  # a streamed program: return as soon as this variable is complete
                self._cond.wait_for(lambda: name in self._vars_done or run.done.is_set())
            if name in self._vars_done and not run.done.is_set():
                return self._variables[name]
        self.sync()
        if name not in self._variables:
            raise UnknownVariableError(
                f"no variable {name!r} in this program state; defined: {sorted(self._variables) or 'none'} "
                f"(variables come from gen(name), select(name) and var_scope(name))"
            )
        return self._variables[name]

    __getitem__ = get_var

    def set_var(self, name: str, value: Any) -> None:
        self.sync()
        self._set_var(name, value)

    __setitem__ = set_var

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._variables

    def get_meta_info(self, name: str) -> dict[str, Any]:
        self.get_var(name)
        return dict(self._meta.get(name, {}))

    def error(self) -> BaseException | None:
        """The exception that stopped a streamed program, if any."""
        return self._run.error

    async def wait(self) -> "ProgramState":
        """Until a streamed program (run_async or run with stream=True) has finished; raises its error.
        Cancelling the wait cancels a run_async program (its requests are aborted)."""
        run = self._run
        if run.task is not None:
            await run.task
        elif run.thread is not None:
            await asyncio.to_thread(run.done.wait)
        if run.error is not None:
            raise run.error
        return self

    def __repr__(self) -> str:
        return f"ProgramState({self._text[-200:]!r})"

    # ---- streaming --------------------------------------------------------------------
    def text_iter(self, var_name: str | None = None, return_meta_data: bool = False) -> Iterator[Any]:
        """Increments of the text (or of variable `var_name`) while a streamed program runs. With
        `return_meta_data` (and a variable), `(chunk, meta_info)` pairs, meta_info as SGLang's client
        reports it while a gen streams: running counts and all logprobs so far."""
        self._check_stream("text_iter", var_name, return_meta_data)
        if self._run.task is not None:
            raise StreamUsageError("this program streams on the event loop (run_async): read it with "
                                   "`async for ... in state.text_async_iter(...)`")
        return self._iter(var_name, return_meta_data)

    def text_async_iter(self, var_name: str | None = None, return_meta_data: bool = False) -> AsyncIterator[Any]:
        """`async for` version of text_iter. A run_async program is followed on the loop itself; a
        run(stream=True) one is waited for on a worker thread."""
        self._check_stream("text_async_iter", var_name, return_meta_data)
        if self._run.task is not None:
            return self._aiter(var_name, return_meta_data)
        it = self._iter(var_name, return_meta_data)

        async def agen() -> AsyncIterator[str]:
            done = object()
            while True:
                chunk = await asyncio.to_thread(next, it, done)
                if chunk is done:
                    return
                yield chunk  # type: ignore[misc]

        return agen()

    def _check_stream(self, what: str, var_name: str | None, return_meta_data: bool) -> None:
        if not self._stream_root:
            raise StreamUsageError(
                f"{what}() needs a program started with run(..., stream=True) or run_async(..., stream=True) "
                f"(and the state it returned); for a finished run read state.text() or state[name]"
            )
        if return_meta_data and var_name is None:
            raise StreamUsageError(f"{what}(return_meta_data=True) needs a variable name: meta data is per gen")

    def _poll(self, var_name: str | None, pos: int, return_meta_data: bool) -> tuple[str, Any, bool]:
        """What a stream reader at `pos` has not seen yet, its meta_info, and whether it is complete."""
        with self._cond:
            current = self._text if var_name is None else self._var_raw.get(var_name, "")
            finished = self._run.done.is_set() or (var_name is not None and var_name in self._vars_done)
            meta = None
            if return_meta_data and var_name is not None:
                meta = dict(self._var_stream_meta.get(var_name) or self._meta.get(var_name) or {})
            return current[pos:], meta, finished

    def _iter(self, var_name: str | None, return_meta_data: bool) -> Iterator[Any]:
        pos = 0
        while True:
            with self._cond:
                while not ((got := self._poll(var_name, pos, return_meta_data))[0] or got[2]):
                    self._cond.wait()
            piece, meta, finished = got
            if piece:
                yield (piece, meta) if return_meta_data else piece
                pos += len(piece)
            if finished:
                break
        self._check_stream_end(var_name)

    async def _aiter(self, var_name: str | None, return_meta_data: bool) -> AsyncIterator[Any]:
        pos = 0
        while True:
            piece, meta, finished = self._poll(var_name, pos, return_meta_data)
            if piece:
                yield (piece, meta) if return_meta_data else piece
                pos += len(piece)
            if finished:
                break
            if not piece:
                await self._run.changed()
        self._check_stream_end(var_name)

    def _check_stream_end(self, var_name: str | None) -> None:
        if self._run.error is not None:
            raise self._run.error
        if var_name is not None and var_name not in self._vars_done:
            raise UnknownVariableError(f"text_iter({var_name!r}): the program produced no variable {var_name!r}")

    # ---- execution of local nodes -------------------------------------------------------
    def _append(self, text: str, var: str | None = None, stream_meta: dict[str, Any] | None = None) -> None:
        with self._cond:
            self._text += text
            if var is not None:
                self._var_raw[var] = self._var_raw.get(var, "") + text
            if var is not None and stream_meta is not None:  # a streamed gen's meta_info so far, for text_iter
                self._var_stream_meta[var] = stream_meta
            self._cond.notify_all()
        self._run.wake()

    def _restart_var(self, name: str | None) -> None:
        """A variable generated again (a gen in a loop) streams from empty."""
        if name is not None:
            with self._cond:
                self._var_raw.pop(name, None)
                self._var_stream_meta.pop(name, None)
                self._vars_done.discard(name)

    def _set_var(self, name: str, value: Any, meta: dict[str, Any] | None = None, raw: str | None = None) -> None:
        with self._cond:
            self._variables[name] = value
            self._var_raw[name] = raw if raw is not None else str(value)
            self._vars_done.add(name)
            self._written.add(name)
            if meta is not None:
                self._meta[name] = meta
            self._cond.notify_all()
        self._run.wake()

    def _advance_local(self) -> SglExpr | None:
        """Execute queued local nodes; pop and return the next node that needs the backend."""
        while self._pending:
            node = self._pending.popleft()
            if isinstance(node, BACKEND_NODES):
                return node
            self._execute_local(node)
        return None

    def _execute_local(self, node: SglExpr) -> None:
        if isinstance(node, SglConstantText):
            self._append(node.value)
        elif isinstance(node, SglRoleBegin):
            self._role_begin(node.role)
        elif isinstance(node, SglRoleEnd):
            self._role_end(node.role)
        elif isinstance(node, SglVarScopeBegin):
            self._scopes[node.name] = len(self._text)
        elif isinstance(node, SglVarScopeEnd):
            if node.name not in self._scopes:
                raise ProgramError(f"var_scope {node.name!r} ended without beginning")
            self._set_var(node.name, self._text[self._scopes.pop(node.name):])
        elif isinstance(node, SglConcateAndAppend):
            self._append("".join(s._text[s._fork_start:] for s in node.states))
        elif isinstance(node, TRACE_ONLY_NODES):
            raise ProgramError(f"{type(node).__name__} is a tracing placeholder and cannot be executed")
        else:
            raise ProgramError(f"cannot execute {node!r}")

    def _role_begin(self, role: str) -> None:
        if self._cur_role is not None:
            raise ProgramError(f"{role}() begins inside {self._cur_role}(): roles cannot nest; end the first role")
        tmpl = self._run.chat_template
        if not self._messages and role != "system" and tmpl.default_system_prompt is not None:
            self._role_begin("system")
            self._append(tmpl.default_system_prompt)
            self._role_end("system")
        prefix, _ = self._role_strings(role)
        self._append(prefix)
        self._cur_role, self._cur_role_begin = role, len(self._text)

    def _role_end(self, role: str) -> None:
        if self._cur_role != role:
            raise ProgramError(f"{role}_end() without a matching {role}_begin() (current role: {self._cur_role})")
        content = self._text[self._cur_role_begin:].lstrip()
        _, suffix = self._role_strings(role)
        self._append(suffix)
        self._messages.append({"role": role, "content": content})
        self._cur_role = None

    def _role_strings(self, role: str) -> tuple[str, str]:
        try:
            return self._run.chat_template.get_prefix_and_suffix(role, self._messages)
        except ValueError as exc:
            raise ProgramError(str(exc)) from exc


class ProgramStateGroup:
    """States created by `fork` (or any list of states): `+=` applies to each, `join` merges back."""

    def __init__(self, states: Sequence[ProgramState], src_state: ProgramState | None = None) -> None:
        self.states = list(states)
        self.src_state = src_state

    def __iadd__(self, other: Any) -> "ProgramStateGroup":
        if callable(other) and not isinstance(other, (str, SglExpr)):
            for i, s in enumerate(self.states):
                s += other(i)
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ProgramError(f"forks += list needs one item per fork ({len(self.states)}), got {len(other)}")
            for s, item in zip(self.states, other):
                s += item
        else:
            for s in self.states:
                s += other
        return self

    def __setitem__(self, i: int, value: Any) -> None:
        """`forks[i] += expr` appends to the fork in place, then stores it back: only that state fits."""
        if value is not self.states[i]:
            raise ProgramError(f"forks[{i}] = ... can only store back forks[{i}] itself (write forks[{i}] += expr)")

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def sync(self) -> None:
        runs = {id(s._run): s._run for s in self.states}.values()
        _drain([st for r in runs for st in r.states])

    def fork(self, size: int = 1) -> "ProgramStateGroup":
        """Fork every state `size` times; one flat group (children remember their own parent)."""
        return ProgramStateGroup([c for s in self.states for c in s.fork(size).states])

    def join(self, mode: str = "gather_variable") -> None:
        """Merge forks into their parents: variables as lists ("gather_variable", SGLang's default)
        or the text each fork added ("concate_and_append")."""
        if mode not in ("gather_variable", "concate_and_append"):
            raise ProgramError(f"join mode must be 'gather_variable' or 'concate_and_append', got {mode!r}")
        self.sync()
        by_parent: dict[int, list[ProgramState]] = {}
        for s in self.states:
            if s._parent is None:
                raise ProgramError("join(): a state in this group was not created by fork()")
            by_parent.setdefault(id(s._parent), []).append(s)
        for children in by_parent.values():
            parent = children[0]._parent
            assert parent is not None
            if mode == "gather_variable":
                names = list(dict.fromkeys(n for c in children for n in c._variables if n in c._written))
                for n in names:
                    parent._set_var(n, [c._variables.get(n) for c in children], {"per_fork": [c._meta.get(n) for c in children]})
            else:
                parent._submit(SglConcateAndAppend(children))


# ---- draining: run queued work, batching gens across states ---------------------------------


def _drain(states: Sequence[ProgramState], only: ProgramState | None = None) -> None:
    runs = list({id(s._run): s._run for s in states}.values())
    runs.sort(key=id)  # a fixed lock order across concurrent drains
    with ExitStack() as stack:
        for r in runs:
            stack.enter_context(r.lock)
        todo = [only] if only is not None else list({id(s): s for s in states}.values())
        while True:
            work = []
            for st in todo:
                node = st._advance_local()
                if node is not None:
                    work.append((st, node))
            if not work:
                return
            _execute_backend_step(work)


def _execute_backend_step(work: list[tuple[ProgramState, SglExpr]]) -> None:
    batch: dict[int, list[tuple[ProgramState, SglGen]]] = {}
    for st, node in work:
        if isinstance(node, SglSelect):
            _execute_select(st, node)
        elif isinstance(node, SglGen) and st._stream_root and st._run.background and st._run.on_executor():
            _execute_gen_stream(st, node)
        else:
            assert isinstance(node, SglGen)
            batch.setdefault(id(st._run.backend), []).append((st, node))
    for items in batch.values():
        backend = items[0][0]._run.backend
        plans = [(_gen_params(st._run, node), _gen_options(st._run, node)) for st, node in items]
        prompts = [st._text for (st, _), (_, opt) in zip(items, plans) for _ in range(opt.n)]  # n samples: n requests
        params = [p for p, opt in plans for _ in range(opt.n)]
        outs = call(backend, "generate", prompts, params)
        if len(outs) != len(prompts):
            raise RuntimeError(f"backend returned {len(outs)} outputs for {len(prompts)} prompts")
        start = 0
        for (st, node), (p, opt) in zip(items, plans):
            mine, start = outs[start:start + opt.n], start + opt.n
            prompt = st._text
            st._append(mine[0].text)
            _store_gen(st, node, mine, prompt, p, opt)


def _gen_options(run: ProgramRun, node: SglGen) -> GenOptions:
    return node.options.over(run.options)


def _gen_params(run: ProgramRun, node: SglGen) -> SamplingParams:
    """The gen's SamplingParams: the run's defaults, its own overrides, then its dtype (as SGLang's
    runtime endpoint: the dtype's regex replaces any other constraint; int/float stop at space/newline)."""
    p = run.defaults.copy(**node.overrides)
    if node.dtype is not None:
        if p.has_constraint and p.regex != DTYPE_REGEXES[node.dtype]:
            warnings.warn(f"gen({node.name!r}) sets both dtype and a constraint; only dtype is used (as in SGLang)",
                          stacklevel=2)
        stop = list(p.stop) + ([" ", "\n"] if node.dtype in (int, float) else [])
        p = p.copy(regex=DTYPE_REGEXES[node.dtype], json_schema=None, grammar=None, choices=None, stop=stop)
    return p


def _store_gen(st: ProgramState, node: SglGen, outs: list[GenerateOutput], prompt: str, params: SamplingParams,
               options: GenOptions, meta: dict[str, Any] | None = None) -> None:
    """Variable `node.name` := the text (a list of n texts for n > 1), with SGLang's meta_info
    (`meta`: a streamed gen's last event's, as SGLang's client keeps it)."""
    if node.name is None:
        return
    if meta is None:
        logprobs = _logprob_options(st._run.backend, params, options)
        meta = finished_meta(outs[0], outs[0].request_id, logprobs, _input_logprobs(st, prompt, logprobs, options))
    texts = [o.text for o in outs]
    st._set_var(node.name, texts if len(outs) > 1 else texts[0], meta, raw=texts[0])


def _logprob_options(backend: "BaseBackend", params: SamplingParams, options: GenOptions) -> LogprobOptions:
    texts = (lambda ids: call(backend, "token_texts", ids)) if params.logprobs and options.return_text_in_logprobs \
        else None
    return LogprobOptions(params.logprobs, params.top_logprobs, texts)


def _input_logprobs(st: ProgramState, prompt: str, logprobs: LogprobOptions, options: GenOptions) -> list[LogprobEntry]:
    """gen(logprob_start_len=...)'s prompt logprobs (none without it, as SGLang's default -1)."""
    if not logprobs.return_logprob or options.logprob_start_len is None or options.logprob_start_len < 0:
        return []
    return logprobs.entries(call(st._run.backend, "prompt_logprobs", prompt, options.logprob_start_len))


def _execute_gen_stream(st: ProgramState, node: SglGen) -> None:
    params, options = _gen_params(st._run, node), _gen_options(st._run, node)
    if options.n != 1:
        raise UnsupportedFeatureError(f"gen({node.name!r}, n>1) cannot stream; run the program without stream=True")
    prompt = st._text
    logprobs = _logprob_options(st._run.backend, params, options)
    stream_meta = StreamMeta("", logprobs, False, _input_logprobs(st, prompt, logprobs, options))
    info: dict[str, Any] = {}
    parts: list[str] = []
    st._restart_var(node.name)
    backend = st._run.backend
    for chunk in iterate(lambda: backend.generate_stream(prompt, params), lambda: backend.agenerate_stream(prompt, params)):
        info = stream_meta.update(chunk)
        st._append(chunk.text, var=node.name, stream_meta=info)
        parts.append(chunk.text)
    if node.name is not None:
        st._set_var(node.name, "".join(parts), dict(info))


def _execute_select(st: ProgramState, node: SglSelect) -> None:
    method = node.choices_method
    scores = call(st._run.backend, "score", st._text, node.choices, unconditional=method.requires_unconditional_logprobs)
    decision = method(node.choices, scores)
    st._append(decision.decision)
    if node.name is not None:
        st._set_var(node.name, decision.decision, _with_token_texts(st._run.backend, dict(decision.meta_info)))


def _with_token_texts(backend: "BaseBackend", meta: dict[str, Any]) -> dict[str, Any]:
    """Select's input_token_logprobs with each token's text, as SGLang's select asks the server
    for them (left None where the backend cannot render tokens)."""
    per_choice = meta.get("input_token_logprobs") or []
    try:
        texts = call(backend, "token_texts", [e[1] for entries in per_choice for e in entries])
    except UnsupportedFeatureError:
        return meta
    it = iter(texts)
    meta["input_token_logprobs"] = [[(e[0], e[1], next(it)) for e in entries] for entries in per_choice]
    return meta


# ---- running programs -----------------------------------------------------------------------


def run_program(program: Program, backend: "BaseBackend", arguments: dict[str, Any],
                defaults: SamplingParams, stream: bool = False, options: GenOptions | None = None,
                use_thread: bool = True) -> ProgramState:
    run = ProgramRun(backend, defaults, options=options)
    state = ProgramState(run, stream_root=stream)
    if stream and use_thread:
        run.thread = threading.Thread(target=_execute, args=(program, state, arguments), daemon=True,
                                      name=f"sgl-{program.name}")
        run.thread.start()
    else:
        _execute(program, state, arguments)
    return state


def _execute(program: Program, state: ProgramState, arguments: dict[str, Any]) -> None:
    run = state._run
    run.executor = getcurrent()
    try:
        state.ret_value = program.func(state, **arguments)
        _drain(run.states)
    except BaseException as exc:
        run.error = exc  # a streamed program's readers get it; a cancelled task stays cancelled
        if not run.background or isinstance(exc, asyncio.CancelledError):
            raise
    finally:
        run.finish()
    if global_config.verbosity >= 2:
        print(state._text)


def run_program_batch(program: Program, backend: "BaseBackend", batch_arguments: list[dict[str, Any]],
                      defaults: SamplingParams, num_threads: int | str = "auto", progress_bar: bool = False,
                      options: GenOptions | None = None,
                      generator_style: bool = False) -> list[ProgramState] | Iterator[ProgramState]:
    """Run the program once per argument dict on a thread pool; the engine batches their requests.
    `generator_style`: a generator yielding the states in input order as they finish."""
    if num_threads == "auto":
        num_threads = AUTO_MAX_THREADS  # threads mostly wait on the engine, which batches their requests
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ProgramError(f"num_threads must be 'auto' or an int >= 1, got {num_threads!r}")
    results = _run_batch_items(program, backend, batch_arguments, defaults, min(num_threads, max(1, len(batch_arguments))),
                               progress_bar, options)
    return results if generator_style else list(results)


def _run_batch_items(program: Program, backend: "BaseBackend", batch_arguments: list[dict[str, Any]],
                     defaults: SamplingParams, num_threads: int, progress_bar: bool,
                     options: GenOptions | None) -> Iterator[ProgramState]:
    from tqdm.auto import tqdm

    if not batch_arguments:
        return
    bar = tqdm(total=len(batch_arguments), disable=not progress_bar, desc=program.name)

    def one(args: dict[str, Any]) -> ProgramState:
        try:
            return run_program(program, backend, args, defaults, options=options)
        finally:
            bar.update(1)

    try:
        if num_threads == 1:
            for a in batch_arguments:
                yield one(a)
            return
        with ThreadPoolExecutor(num_threads, thread_name_prefix=f"sgl-batch-{program.name}") as pool:
            futures = [pool.submit(one, a) for a in batch_arguments]
            for i, f in enumerate(futures):
                try:
                    yield f.result()
                except BaseException as exc:
                    if hasattr(exc, "add_note"):
                        exc.add_note(f"(in run_batch item {i}: {batch_arguments[i]!r:.200})")
                    for rest in futures[i + 1:]:
                        rest.cancel()
                    raise
    finally:
        bar.close()


AUTO_MAX_THREADS = 128


# ---- running programs on an event loop ------------------------------------------------------


async def run_program_async(program: Program, backend: "BaseBackend", arguments: dict[str, Any],
                            defaults: SamplingParams, stream: bool = False,
                            options: GenOptions | None = None) -> ProgramState:
    """Run the program's body in a greenlet on this loop, awaiting every backend call. With
    `stream`, return at once (the body runs as a task; `text_async_iter`, `await state.wait()`)."""
    run = ProgramRun(backend, defaults, options=options)
    state = ProgramState(run, stream_root=stream)
    body = run_in_greenlet(_execute, program, state, arguments)
    if stream:
        run.task = asyncio.ensure_future(body)
        return state
    await body
    return state


async def run_program_batch_async(program: Program, backend: "BaseBackend", batch_arguments: list[dict[str, Any]],
                                  defaults: SamplingParams, max_concurrency: int | None = None,
                                  progress_bar: bool = False, options: GenOptions | None = None) -> list[ProgramState]:
    """Every item as its own task on this loop (at most `max_concurrency` at once); the states in
    input order. The first failure cancels the rest."""
    from tqdm.auto import tqdm

    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(batch_arguments), desc=program.name) if progress_bar else None

    async def one(i: int, args: dict[str, Any]) -> ProgramState:
        try:
            async with limit or nullcontext():
                return await run_program_async(program, backend, args, defaults, options=options)
        except Exception as exc:
            exc.add_note(f"(in run_batch_async item {i}: {args!r:.200})")
            raise
        finally:
            if bar is not None:
                bar.update(1)

    tasks = [asyncio.ensure_future(one(i, a)) for i, a in enumerate(batch_arguments)]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        if bar is not None:
            bar.close()
