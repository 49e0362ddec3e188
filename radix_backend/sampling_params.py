"""SamplingParams: the per-request knobs, validated once at submit time."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, replace
from typing import Any

from .errors import InvalidRequestError
from .stop_regex import compile_stop_regex

logger = logging.getLogger(__name__)


@dataclass
class SamplingParams:
    """Sampling and stopping settings of one request (names follow SGLang / vLLM)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0  # EOS, stop token ids and stop strings/regexes are ignored until this many
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None  # finish when the output text matches (text kept, as SGLang)
    ignore_eos: bool = False
    no_stop_trim: bool = False  # keep the matched stop string at the end of the text
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI/SGLang, in [-100, 100])
    skip_special_tokens: bool = True
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    # Constraints (compiled by radix_backend.scheduler.constrained through llguidance).
    regex: str | None = None
    json_schema: Any = None  # dict, JSON string, or pydantic model class
    grammar: str | None = None  # Lark / EBNF
    choices: list[str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        self.stop_regex = [r for r in (self.stop_regex or []) if r]

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 1e-5 or self.top_k == 1

    @property
    def has_constraint(self) -> bool:
        return any(x is not None for x in (self.regex, self.json_schema, self.grammar, self.choices))

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    def copy(self, **changes: Any) -> "SamplingParams":
        return replace(self, **changes)

    def validate(self) -> None:
        """Raise InvalidRequestError naming the bad field; called by the engine at submit, so the
        Python API, /generate and the OpenAI routes share it. Every number is type-checked, finite
        and bounded so that no value can overflow the sampler (e.g. logits / 1e-39)."""

        def bad(msg: str) -> None:
            raise InvalidRequestError(f"SamplingParams: {msg}")

        for name, (lo, hi) in _INT_RANGES.items():
            value = getattr(self, name)
            if not _is_int(value) or not lo <= value <= hi:
                bad(f"{name} must be an int in [{lo}, {hi}], got {value!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -SEED_LIMIT <= self.seed < SEED_LIMIT):
            bad(f"seed must be an int in [-2**63, 2**63), got {self.seed!r}")
        if self.top_k == 0:
            bad("top_k must be -1 (disabled) or >= 1, got 0")
        for name, (lo, hi, lo_open) in _FLOAT_RANGES.items():
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo):
                bad(f"{name} must be a finite number in {'(' if lo_open else '['}{lo}, {hi}], got {value!r}")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not all(isinstance(s, str) for s in self.stop):
            bad("stop must be a string or a list of strings")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            bad(f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters each "
                "(every one is checked after every token)")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative ints")
        if self.logit_bias is not None:
            self.logit_bias = _checked_logit_bias(self.logit_bias, bad)
        if len(self.stop_regex) > MAX_STOP_REGEXES:
            bad(f"stop_regex takes at most {MAX_STOP_REGEXES} patterns")
        for pattern in self.stop_regex:
            if not isinstance(pattern, str):
                bad("stop_regex must be a string or a list of strings")
            try:
                compile_stop_regex(pattern)  # linear-time automaton; refuses what has none
            except InvalidRequestError as exc:
                bad(str(exc))
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                bad(f"{name} must be a string")
        n_constraints = sum(x is not None for x in (self.regex, self.json_schema, self.grammar, self.choices))
        if n_constraints > 1:
            bad("set at most one of regex, json_schema, grammar, choices")
        if self.choices is not None and (not isinstance(self.choices, list) or not self.choices
                                         or not all(isinstance(c, str) for c in self.choices)):
            bad("choices must be a non-empty list of strings")
        if self.choices is not None and len(self.choices) > MAX_CHOICES:
            bad(f"choices takes at most {MAX_CHOICES} strings")
        constraint_chars = sum(map(len, [*(self.choices or []), self.regex or "", self.grammar or ""]))
        if constraint_chars > MAX_CONSTRAINT_CHARS:
            bad(f"the constraint (regex, grammar or choices) is {constraint_chars} characters; at most "
                f"{MAX_CONSTRAINT_CHARS} (compiling it holds up other requests)")
        for text in [*self.stop, *self.stop_regex, *(self.choices or []), self.regex or "", self.grammar or ""]:
            check_encodable(text, "SamplingParams")


SEED_LIMIT = 2 ** 63
MAX_STOP_STRINGS = 32  # OpenAI allows 4; frameworks pass a few
MAX_STOP_CHARS = 256
MAX_STOP_REGEXES = 8
MAX_CHOICES = 4096
MAX_CONSTRAINT_CHARS = 1 << 18  # a grammar, a regex or all choices together (a JSON schema: the server's body cap)
MAX_TOKENS_LIMIT = 2 ** 31 - 1
_INT_RANGES = {"max_new_tokens": (0, MAX_TOKENS_LIMIT), "min_new_tokens": (0, MAX_TOKENS_LIMIT),
               "top_k": (-1, MAX_TOKENS_LIMIT), "top_logprobs": (0, 20)}
# name -> (low, high, low end excluded). repetition_penalty divides (or multiplies) logits by it:
# [0.01, 100] keeps fp32 logits finite; OpenAI's ranges for the others
_FLOAT_RANGES = {"temperature": (0.0, 100.0, False), "top_p": (0.0, 1.0, True), "min_p": (0.0, 1.0, False),
                 "frequency_penalty": (-2.0, 2.0, False), "presence_penalty": (-2.0, 2.0, False),
                 "repetition_penalty": (0.01, 100.0, False)}
_BOOL_FIELDS = ("ignore_eos", "no_stop_trim", "skip_special_tokens", "logprobs")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_encodable(text: str, where: str) -> None:
    """Text a tokenizer can take: valid Unicode (a lone UTF-16 surrogate, which JSON can carry, is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"{where}: text contains a character that is not valid Unicode "
                                  f"({exc.reason} at position {exc.start}, {text[exc.start]!r}); send UTF-8 text") from None


def _checked_logit_bias(bias: Any, bad: Any) -> dict[int, float]:
    """{token id: bias} with ids as ints (JSON sends them as strings) and finite biases in [-100, 100]."""
    if not isinstance(bias, dict):
        bad(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            bad(f"logit_bias keys must be token ids, got {key!r}")
        if token < 0 or not _is_number(value) or not -100 <= value <= 100:
            bad(f"logit_bias[{key!r}] must be a token id >= 0 with a bias in [-100, 100], got {value!r}")
        out[token] = float(value)
    return out


# SGLang 0.5.23's sampling_params keys, decided one by one (the README lists the decisions). Every key
# named like a SamplingParams field is honoured; these are renamed, ignored or refused:
_SGLANG_RENAMED_KEYS = {"ebnf": "grammar", "sampling_seed": "seed"}
_SGLANG_IGNORED_KEYS = {  # key -> (its default, why ignoring it cannot change the output here)
    "spaces_between_special_tokens": (True, "special tokens are skipped from the text unless asked for"),
    "stream_interval": (None, "a streaming cadence knob; every token is streamed"),
}
_SGLANG_REFUSED_KEYS = {  # key -> what is not supported (a 400 when set to anything but "off")
    "beam_width": "beam search", "structural_tag": "structural tags", "custom_params": "custom logit processors",
    "watermark": "watermarking",
}
_warned: set[str] = set()


_SGLANG_WIRE_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                       "presence_penalty", "repetition_penalty", "min_new_tokens", "stop", "stop_token_ids",
                       "stop_regex", "ignore_eos", "skip_special_tokens", "regex", "seed")


def to_sglang_sampling_params(p: SamplingParams) -> dict[str, Any]:
    """SGLang's `sampling_params` dict for `p` (the inverse of `sglang_sampling_params`; the
    json_schema goes as a JSON string, a grammar as `ebnf`)."""
    out = {k: getattr(p, k) for k in _SGLANG_WIRE_FIELDS}
    out = {k: v for k, v in out.items() if v is not None and v != []}
    if p.json_schema is not None:
        schema = p.json_schema
        if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
            schema = schema.model_json_schema()
        out["json_schema"] = schema if isinstance(schema, str) else json.dumps(schema)
    if p.grammar is not None:
        out["ebnf"] = p.grammar
    if p.choices is not None:
        out["choices"] = p.choices
    return out


def sglang_sampling_params(raw: dict[str, Any] | None) -> tuple[SamplingParams, int]:
    """SGLang's `sampling_params` dict (as its client and server take it) -> (SamplingParams, n)."""
    raw = dict(raw or {})
    n = raw.pop("n", 1)
    n = 1 if n is None else n
    kwargs: dict[str, Any] = {}
    unknown, refused = [], []
    fields = SamplingParams.__dataclass_fields__
    for key, value in raw.items():
        key = _SGLANG_RENAMED_KEYS.get(key, key)
        if key in _SGLANG_REFUSED_KEYS:
            if value not in (None, {}, [], 1, 0, False):
                refused.append(f"{key} ({_SGLANG_REFUSED_KEYS[key]})")
        elif key in _SGLANG_IGNORED_KEYS:
            default, why = _SGLANG_IGNORED_KEYS[key]
            if value != default and key not in _warned:
                _warned.add(key)
                logger.warning("sampling_params.%s=%r is ignored: %s", key, value, why)
        elif key not in fields:
            unknown.append(key)
        elif value is not None:
            kwargs[key] = value
    if refused:
        raise InvalidRequestError(f"sampling_params not supported here: {', '.join(refused)}; remove them")
    if unknown:
        raise InvalidRequestError(f"unknown sampling_params keys {sorted(unknown)}; supported: {sorted(fields)}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InvalidRequestError(f"sampling_params.n must be an int >= 1, got {n!r}")
    try:
        params = SamplingParams(**kwargs)
    except TypeError as exc:
        raise InvalidRequestError(f"bad sampling_params: {exc}") from exc
    params.validate()
    return params, n
