"""Constrained decoding through llguidance (regex, JSON schema, Lark/GBNF grammar, choices).

The engine owns one `ConstraintCompiler` per tokenizer. At submit time `compile(params)` turns the
request's constraint into a per-request `TokenConstraint` (an llguidance matcher) or raises
`ConstraintError`, so a bad constraint fails that request alone, before it is scheduled. During
decoding the scheduler makes two calls per step: `mask_logits` before sampling (each constrained
row's allowed-token bitmask applied to its logits) and `advance` after it (the matcher consumes the
sampled token, then the tokens the grammar forces are appended at once: jump-forward, no decode
steps spent on them).

Compiled grammars are cached: a matcher built once per distinct constraint is deep-copied for each
request, so a batch of 32 identical JSON-schema requests compiles the schema once.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import llguidance
import llguidance.hf
import torch

from ..errors import ConstraintError
from ..sampling_params import SamplingParams
from ..utils import load_json_text

if TYPE_CHECKING:
    from .request import Req

logger = logging.getLogger(__name__)

ConstraintKind = Literal["regex", "json_schema", "grammar", "choices"]

# JSON output shaped like `{"name": "Bob", "age": 3}`: the separators models write naturally, and
# no free whitespace, so keys and punctuation are forced (jump-forward) and a small model cannot
# loop on newlines. A schema may override these through its own "x-guidance" object.
DEFAULT_JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}

_BIT_SHIFTS_CACHE: dict[torch.device, torch.Tensor] = {}


def _first_line(message: str) -> str:
    """llguidance errors carry a long parser-state dump after the first line; keep the useful part."""
    return message.strip().split("\n<state>", 1)[0].strip()


@dataclass(frozen=True)
class ConstraintSpec:
    """A constraint in canonical text form: the cache key and the input to llguidance."""

    kind: ConstraintKind
    source: str  # regex text, canonical JSON schema, grammar text, or JSON list of choices

    def describe(self) -> str:
        text = self.source if len(self.source) <= 80 else self.source[:77] + "..."
        return f"{self.kind} {text!r}"


def _schema_to_text(schema: Any) -> str:
    """dict / JSON string / pydantic model class -> canonical JSON text.

    Key order is kept: llguidance emits properties in schema order, so it is part of the constraint.
    """
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    elif isinstance(schema, (str, bytes)):
        schema = load_json_text(schema, "json_schema")
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(
            "json_schema must be a dict, a JSON string or a pydantic BaseModel subclass, "
            f"got {type(schema).__name__}")
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise ConstraintError(f"json_schema is not JSON-serializable: {e}") from None


def constraint_spec(params: SamplingParams) -> ConstraintSpec | None:
    """The request's constraint in canonical form, or None when it has none."""
    set_fields = [n for n in ("regex", "json_schema", "grammar", "choices") if getattr(params, n) is not None]
    if not set_fields:
        return None
    if len(set_fields) > 1:
        raise ConstraintError(f"set at most one of regex, json_schema, grammar, choices (got {', '.join(set_fields)})")
    if params.regex is not None:
        if not isinstance(params.regex, str):
            raise ConstraintError(f"regex must be a string, got {type(params.regex).__name__}")
        return ConstraintSpec("regex", params.regex)
    if params.json_schema is not None:
        return ConstraintSpec("json_schema", _schema_to_text(params.json_schema))
    if params.grammar is not None:
        if not isinstance(params.grammar, str) or not params.grammar.strip():
            raise ConstraintError("grammar must be a non-empty Lark or GBNF grammar string")
        return ConstraintSpec("grammar", params.grammar)
    choices = params.choices
    if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) for c in choices):
        raise ConstraintError(f"choices must be a non-empty list of strings, got {choices!r}")
    return ConstraintSpec("choices", json.dumps(list(dict.fromkeys(choices))))


def _grammar_text(spec: ConstraintSpec) -> str:
    """ConstraintSpec -> llguidance grammar definition (not yet validated)."""
    try:
        if spec.kind == "regex":
            # \d \w \s (and \D \W \S) are ASCII classes, Python's `re.ASCII` semantics: Rust's
            # Unicode \d would let a "phone number" regex produce Devanagari digits. Patterns using
            # only the positive classes therefore also `re.fullmatch` under Unicode semantics.
            return llguidance.grammar_from("lark", f"start: /{llguidance.regex_to_lark(spec.source, 'dws')}/")
        if spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=DEFAULT_JSON_OPTIONS)
        if spec.kind == "grammar":
            # "grammar" format accepts Lark as is and converts GBNF (llama.cpp style `root ::= ...`).
            return llguidance.grammar_from("grammar", spec.source)
        return llguidance.grammar_from("choice", spec.source)
    except ValueError as e:
        raise ConstraintError(f"invalid {spec.kind}: {_first_line(str(e))}") from None


@dataclass
class CompileCacheInfo:
    hits: int
    misses: int
    size: int


class TokenConstraint:
    """Per-request grammar state: token masks, advancing, jump-forward, rollback.

    Not thread-safe; the engine's scheduler thread owns it.
    """

    def __init__(self, matcher: llguidance.LLMatcher, spec: ConstraintSpec, vocab_size: int,
                 ll_eos: int, eos_token_ids: Sequence[int]) -> None:
        self._m = matcher
        self.spec = spec
        self.vocab_size = vocab_size
        self._ll_eos = ll_eos
        self._eos_ids = sorted({ll_eos, *eos_token_ids})
        self._eos_set = frozenset(self._eos_ids)
        self.num_consumed = 0  # tokens consumed so far (sampled + forced), the most rollback can undo

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-next-token bitmask into `bitmask[row]` (CPU int32, see allocate_bitmask).

        Every EOS id of the model is allowed exactly when the grammar allows ending here.
        """
        import llguidance.torch as lt

        lt.fill_next_token_bitmask(self._m, bitmask, row)
        self._sync_eos_bits(bitmask, row)

    def _sync_eos_bits(self, bitmask: torch.Tensor, row: int) -> None:
        """llguidance knows one EOS id; give the model's other EOS ids the same bit."""
        if len(self._eos_ids) == 1:
            return
        r = bitmask[row]
        eos_allowed = bool((int(r[self._ll_eos // 32]) >> (self._ll_eos % 32)) & 1)
        for t in self._eos_ids:
            if t < self.vocab_size and t != self._ll_eos:
                word = int(r[t // 32]) & 0xFFFFFFFF  # as unsigned 32-bit
                bit = 1 << (t % 32)
                word = (word | bit) if eos_allowed else (word & ~bit & 0xFFFFFFFF)
                r[t // 32] = word - (1 << 32) if word >= (1 << 31) else word  # back to int32

    def is_allowed(self, token_id: int) -> bool:
        """Whether `token_id` may come next (EOS: whether the grammar may end here)."""
        if token_id in self._eos_set:
            return self._m.is_accepting()
        return self._m.validate_tokens([token_id]) == 1

    def advance(self, token_id: int) -> None:
        """Consume one sampled token; raise ConstraintError if the grammar does not allow it.

        After an error the matcher stays in an error state: the request must be aborted.
        """
        if token_id in self._eos_set:
            if not self._m.is_accepting():
                raise ConstraintError(
                    f"EOS token {token_id} sampled before the {self.spec.kind} constraint was complete")
            token_id = self._ll_eos
        if not self._m.consume_token(token_id):
            raise ConstraintError(
                f"token {token_id} is not allowed by the {self.spec.kind} constraint: "
                f"{_first_line(self._m.get_error())}")
        self.num_consumed += 1

    def forced_tokens(self) -> list[int]:
        """Jump-forward: the tokens the grammar forces from here, already consumed.

        llguidance only returns tokens whose tokenization cannot change with what follows (it holds
        back a forced tail that could merge with the next token), so outputs stay canonical.
        """
        if self._m.is_stopped():
            return []
        ff = self._m.compute_ff_tokens()
        if ff:
            if not self._m.consume_tokens(ff):
                raise ConstraintError(f"internal: forced tokens rejected: {_first_line(self._m.get_error())}")
            self.num_consumed += len(ff)
        return list(ff)

    def forced_text(self) -> bytes:
        """Bytes the grammar forces next (may extend past forced_tokens(); for inspection)."""
        return self._m.compute_ff_bytes()

    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing but EOS: the request should stop."""
        return self._m.is_stopped()

    def is_accepting(self) -> bool:
        """The output so far is a complete match (EOS would be allowed), though more may follow."""
        return self._m.is_accepting()

    def is_error(self) -> bool:
        return self._m.is_error()

    @property
    def error(self) -> str:
        return _first_line(self._m.get_error())

    def rollback(self, n: int) -> None:
        """Undo the last `n` consumed tokens (e.g. forced tokens cut off by max_new_tokens)."""
        if n < 0 or n > self.num_consumed:
            raise ConstraintError(f"cannot roll back {n} tokens; {self.num_consumed} were consumed")
        if n and not self._m.rollback(n):
            raise ConstraintError(f"rollback of {n} tokens failed: {self.error}")
        self.num_consumed -= n

    def copy(self) -> "TokenConstraint":
        """An independent copy in the same state (e.g. for forked requests)."""
        c = TokenConstraint(self._m.deep_copy(), self.spec, self.vocab_size, self._ll_eos, self._eos_ids)
        c.num_consumed = self.num_consumed
        return c


class ConstraintCompiler:
    """Compiles SamplingParams constraints into TokenConstraints for one tokenizer and model vocab.

    `vocab_size` is the model's logits width; it may exceed the tokenizer (padded embedding rows),
    and those padding ids are never allowed.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], *,
                 cache_size: int = 256) -> None:
        eos_ids = [int(t) for t in eos_token_ids if t is not None]
        ll_eos = eos_ids[0] if eos_ids else tokenizer.eos_token_id
        self.vocab_size = max(int(vocab_size), len(tokenizer))
        try:
            self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size, eos_token=ll_eos)
        except ValueError as e:
            raise ConstraintError(f"constrained decoding needs a fast (Rust) HF tokenizer: {e}") from None
        self.eos_token_ids = sorted({self.ll_tokenizer.eos_token, *eos_ids})
        self._cache: OrderedDict[ConstraintSpec, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    def allocate_bitmask(self, batch_size: int) -> torch.Tensor:
        """A CPU int32 bitmask [batch_size, ceil(vocab/32)], all tokens allowed."""
        import llguidance.torch as lt

        return lt.allocate_token_bitmask(batch_size, self.vocab_size)

    def compile(self, params: SamplingParams) -> TokenConstraint | None:
        """A fresh TokenConstraint for the request, None without a constraint; ConstraintError if invalid."""
        try:
            spec = constraint_spec(params)
        except RecursionError:
            raise ConstraintError("json_schema is nested too deeply") from None
        if spec is None:
            return None
        return self.compile_spec(spec)

    def compile_spec(self, spec: ConstraintSpec) -> TokenConstraint:
        with self._lock:
            template = self._cache.get(spec)
            if template is not None:
                self._cache.move_to_end(spec)
                self._hits += 1
        if template is None:
            template = self._build(spec)
            with self._lock:
                self._misses += 1
                self._cache[spec] = template
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return TokenConstraint(template.deep_copy(), spec, self.vocab_size, self.ll_tokenizer.eos_token,
                               self.eos_token_ids)

    def cache_info(self) -> CompileCacheInfo:
        with self._lock:
            return CompileCacheInfo(self._hits, self._misses, len(self._cache))

    def _build(self, spec: ConstraintSpec) -> llguidance.LLMatcher:
        """Compile `spec`; every failure is a ConstraintError (a 400), including a schema nested too
        deep for Python's recursion and a panic inside llguidance (which Python raises as a
        BaseException)."""
        try:
            return self._compile(spec)
        except ConstraintError:
            raise
        except RecursionError:
            raise ConstraintError(f"{spec.kind} is nested too deeply to compile") from None
        except BaseException as exc:
            if type(exc).__name__ != "PanicException":
                raise
            raise ConstraintError(f"{spec.kind} could not be compiled: {_first_line(str(exc))}") from None

    def _compile(self, spec: ConstraintSpec) -> llguidance.LLMatcher:
        grammar = _grammar_text(spec)
        limits = parser_limits()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer,
                                                                                  limits=limits)
        if is_error:
            raise ConstraintError(f"invalid {spec.kind} {spec.describe()}: {_first_line(messages[0])}")
        for w in messages:
            logger.warning("constraint %s: %s", spec.describe(), w)
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise ConstraintError(f"invalid {spec.kind} {spec.describe()}: {_first_line(matcher.get_error())}")
        return matcher


def parser_limits() -> llguidance.LLParserLimits:
    """What one constraint may cost, ours on purpose (llguidance's defaults): building its lexer at
    most 1M fuel (~20 ms) and 500k grammar symbols at compile time, and per token (on the scheduler
    thread, for every request in the batch) 200k lexer fuel (~15 ms) and 50k Earley items; a grammar
    over these is a ConstraintError (400) or fails its own request, never a stall of the others."""
    return llguidance.LLParserLimits(initial_lexer_fuel=1_000_000, max_grammar_size=500_000,
                                     step_lexer_fuel=200_000, step_max_items=50_000)


_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def fill_bitmasks(items: Sequence[tuple[TokenConstraint, int]], bitmask: torch.Tensor) -> None:
    """Fill the bitmask rows of many constraints at once, in parallel on llguidance's thread pool.

    Same result as calling `c.fill_bitmask(bitmask, row)` for each (c, row); faster for big batches
    because the per-request mask computations run concurrently without the GIL.
    """
    global _executor
    if not items:
        return
    if len(items) == 1:
        items[0][0].fill_bitmask(bitmask, items[0][1])
        return
    import llguidance.torch as lt

    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
    lt.fill_next_token_bitmask_par(_executor, [(c._m, row) for c, row in items], bitmask)
    for c, row in items:
        c._sync_eos_bits(bitmask, row)


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpack an int32 bitmask [B, W] into a bool tensor [B, vocab_size] (True = allowed)."""
    shifts = _BIT_SHIFTS_CACHE.get(bitmask.device)
    if shifts is None:
        shifts = _BIT_SHIFTS_CACHE[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(bitmask.shape[0], -1).bool()
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(bitmask.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set disallowed logits to -inf in place, for the constrained `rows` of `logits` [B, V].

    `bitmask` rows are indexed like `logits` rows. Unpacking is plain eager torch (no torch.compile,
    unlike llguidance.torch's helper), so the first constrained request pays no compile time and
    any device works; the mask is moved to the logits' device here.
    """
    if not rows:
        return
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError("apply_bitmask expects logits [B, V] and an int32 bitmask [B, ceil(V/32)]")
    idx = torch.as_tensor(list(rows), dtype=torch.long)
    masks = bitmask.index_select(0, idx).to(logits.device, non_blocking=True)
    disallowed = ~bitmask_to_bool(masks, logits.shape[1])
    idx = idx.to(logits.device)
    if len(rows) == logits.shape[0] and list(rows) == list(range(logits.shape[0])):
        logits.masked_fill_(disallowed, float("-inf"))
    else:
        sub = logits.index_select(0, idx).masked_fill_(disallowed, float("-inf"))
        logits.index_copy_(0, idx, sub)


# ---- the scheduler's interface: one call before sampling, one after -------------------------------
def mask_logits(logits: torch.Tensor, constraints: Sequence[TokenConstraint | None]) -> None:
    """Set to -inf, in place, every token a row's constraint forbids (row i: constraints[i])."""
    items = [(c, i) for i, c in enumerate(constraints) if c is not None]
    if not items:
        return
    import llguidance.torch as lt

    bitmask = lt.allocate_token_bitmask(len(constraints), items[0][0].vocab_size)
    fill_bitmasks(items, bitmask)
    apply_bitmask(logits, bitmask, [i for _, i in items])


def advance(req: Req, token: int, *, jump_forward: bool) -> None:
    """After `token` was appended to a constrained request: move its matcher past the token and,
    with `jump_forward`, append the tokens the grammar now forces. No-op without a constraint."""
    c = req.constraint
    if c is None or req.finished:
        return  # an EOS the grammar allowed has already finished the request
    c.advance(token)
    if c.is_finished():
        req.finish_reason = req.finish_reason or "stop"
    elif jump_forward:
        append_forced_tokens(req)


def append_forced_tokens(req: Req) -> None:
    """Append the tokens the grammar forces from here; they need no decode step of their own."""
    forced = req.constraint.forced_tokens()
    for i, tok in enumerate(forced):
        req.append_token(tok)
        if req.finished:
            req.constraint.rollback(len(forced) - i - 1)  # keep the matcher in step with the output
            return
    if req.constraint.is_finished():
        req.finish_reason = "stop"
