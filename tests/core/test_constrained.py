"""Constrained decoding (radix_backend.scheduler.constrained) driven by a seeded random-token "model".

At each step the driver picks a random token the mask allows, advances, appends the forced
(jump-forward) tokens, until the grammar finishes; the decoded text must then match the regex,
validate against the schema, or be one of the choices. Uses the real SmolLM2 tokenizer.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pydantic
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from radix_backend.scheduler.constrained import (
    ConstraintCompiler,
    TokenConstraint,
    apply_bitmask,
    bitmask_to_bool,
    fill_bitmasks,
    constraint_spec,
)
from radix_backend.errors import ConstraintError, InvalidRequestError
from radix_backend.sampling_params import SamplingParams

PAD = 64  # extra (padding) embedding rows beyond the tokenizer, as real checkpoints often have
EOS_IDS = [2, 0]  # <|im_end|> and <|endoftext|>
SEEDS = st.integers(min_value=0, max_value=2**32 - 1)
# No shrinking (a failing seed is already minimal to read) and no example database on disk.
HSETTINGS = settings(max_examples=10, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                     suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def compiler(tokenizer) -> ConstraintCompiler:
    return ConstraintCompiler(tokenizer, vocab_size=len(tokenizer) + PAD, eos_token_ids=EOS_IDS)


def allowed_mask(compiler: ConstraintCompiler, c: TokenConstraint) -> torch.Tensor:
    mask = compiler.allocate_bitmask(1)
    mask.zero_()
    c.fill_bitmask(mask, 0)
    return bitmask_to_bool(mask, compiler.vocab_size)[0]


def allowed_ids(compiler: ConstraintCompiler, c: TokenConstraint) -> list[int]:
    return allowed_mask(compiler, c).nonzero().flatten().tolist()


def drive(compiler: ConstraintCompiler, c: TokenConstraint, seed: int, max_steps: int = 400,
          eos_prob: float = 0.5) -> tuple[list[int], list[list[int]]]:
    """Random walk through the grammar: returns (output tokens, forced chunks in order)."""
    rng = random.Random(seed)
    forced = [c.forced_tokens()]
    out = list(forced[0])
    eos = torch.tensor(compiler.eos_token_ids)
    for _ in range(max_steps):
        if c.is_finished():
            return out, forced
        allowed = allowed_mask(compiler, c)
        assert not allowed[compiler.vocab_size - PAD:].any(), "padding ids must never be allowed"
        ends = eos[allowed[eos]].tolist()
        if ends and rng.random() < eos_prob:
            c.advance(rng.choice(ends))
            assert c.is_finished()
            return out, forced
        allowed[eos] = False
        ids = allowed.nonzero().flatten()
        assert len(ids), "mask allows nothing before the grammar finished"
        tok = int(ids[rng.randrange(len(ids))])
        c.advance(tok)
        out.append(tok)
        ff = c.forced_tokens()
        forced.append(ff)
        out += ff
    pytest.fail(f"grammar did not finish within {max_steps} steps: {compiler.ll_tokenizer.decode_str(out)!r}")


def text_of(compiler: ConstraintCompiler, tokens: list[int]) -> str:
    return compiler.ll_tokenizer.decode_bytes(tokens).decode("utf-8")  # strict: output must be valid UTF-8


# --- regex -------------------------------------------------------------------------------------

REGEXES = [
    r"[a-z]{1,8}@[a-z]{2,6}\.(com|org|net)",
    r"\(\d{3}\) \d{3}-\d{4}",
    r"(yes|no|maybe)",
    r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?",
    r"[A-Z][a-z]{0,6}( [A-Z][a-z]{0,6}){0,2}",
    r"^(yes|no)/[^\d\s]{1,3}$",  # anchors, a slash, negated classes
]


@pytest.mark.parametrize("regex", REGEXES)
@HSETTINGS
@given(seed=SEEDS)
def test_regex_random_walk_fullmatches(compiler, regex, seed):
    c = compiler.compile(SamplingParams(regex=regex))
    tokens, _ = drive(compiler, c, seed)
    text = text_of(compiler, tokens)
    assert re.fullmatch(regex, text, re.ASCII), (regex, text)  # \d \w \s are ASCII classes
    if not re.search(r"\\[DWS]|\[\^", regex):  # no negated class: Unicode semantics agree
        assert re.fullmatch(regex, text), (regex, text)


def test_mask_agrees_with_token_validation(compiler, tokenizer):
    c = compiler.compile(SamplingParams(regex=r"[0-9]{2,4}-[a-z]+"))
    c.advance(tokenizer.encode("1", add_special_tokens=False)[0])
    allowed = set(allowed_ids(compiler, c))
    rng = random.Random(0)
    probe = rng.sample(range(len(tokenizer)), 2000) + sorted(allowed)[:50]
    for t in probe:
        assert (t in allowed) == c.is_allowed(t), (t, tokenizer.convert_ids_to_tokens(t))
    assert all(t < len(tokenizer) for t in allowed)


# --- JSON schema ---------------------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.com$"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "vip"]}, "maxItems": 3},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "tags", "active", "address"],
    "additionalProperties": False,
}


@HSETTINGS
@given(seed=SEEDS)
def test_json_schema_random_walk_validates(compiler, seed):
    c = compiler.compile(SamplingParams(json_schema=PERSON))
    tokens, _ = drive(compiler, c, seed)
    value = json.loads(text_of(compiler, tokens))
    jsonschema.validate(value, PERSON)


class Item(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # else extra keys of any length are allowed
    sku: str = pydantic.Field(max_length=6)
    qty: int = pydantic.Field(ge=1, le=99)
    kind: str = pydantic.Field(pattern=r"^(book|pen)$")


class Order(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    order_id: int
    items: list[Item] = pydantic.Field(max_length=2)
    rush: bool


@HSETTINGS
@given(seed=SEEDS)
def test_pydantic_model_schema(compiler, seed):
    c = compiler.compile(SamplingParams(json_schema=Order))
    tokens, _ = drive(compiler, c, seed)
    text = text_of(compiler, tokens)
    Order.model_validate_json(text)
    jsonschema.validate(json.loads(text), Order.model_json_schema())


def test_schema_forms_share_one_compiled_grammar(tokenizer):
    comp = ConstraintCompiler(tokenizer, vocab_size=len(tokenizer), eos_token_ids=[tokenizer.eos_token_id])
    forms = [PERSON, json.dumps(PERSON), json.dumps(PERSON, indent=2)]
    constraints = [comp.compile(SamplingParams(json_schema=forms[i % 3])) for i in range(32)]
    info = comp.cache_info()
    assert (info.misses, info.hits, info.size) == (1, 31, 1)
    # Each request got its own matcher: advancing one leaves the others at the start.
    first, second = constraints[0], constraints[1]
    ff = first.forced_tokens()
    assert ff and tokenizer.decode(ff).startswith('{"name')
    assert second.num_consumed == 0 and second.forced_tokens() == ff


def test_schema_property_order_is_kept(compiler, tokenizer):
    reordered = dict(PERSON, properties=dict(reversed(list(PERSON["properties"].items()))))
    c = compiler.compile(SamplingParams(json_schema=reordered))
    assert (tokenizer.decode(c.forced_tokens()) + c.forced_text().decode()).startswith('{"address": {"city": "')
    assert compiler.compile_spec(constraint_spec(SamplingParams(json_schema=PERSON))).spec != c.spec


def test_json_jump_forward_forces_keys(compiler):
    schema = {
        "type": "object",
        "properties": {k: {"type": "integer", "minimum": 0, "maximum": 9} for k in ("alpha", "beta", "gamma")},
        "required": ["alpha", "beta", "gamma"],
        "additionalProperties": False,
    }
    for seed in range(5):
        c = compiler.compile(SamplingParams(json_schema=schema))
        tokens, forced = drive(compiler, c, seed)
        value = json.loads(text_of(compiler, tokens))
        jsonschema.validate(value, schema)
        assert forced[0], "the opening brace and first key are forced before any decode step"
        assert text_of(compiler, forced[0]).startswith('{"')
        forced_text = "".join(compiler.ll_tokenizer.decode_str(f) for f in forced)
        for key in ("alpha", "beta", "gamma"):
            assert key in forced_text, (key, forced_text)
        n_forced = sum(len(f) for f in forced)
        # Only the three one-digit values, the key-closing punctuation and the final brace are sampled.
        assert n_forced >= len(tokens) // 2, (n_forced, len(tokens))


def test_forced_tokens_are_consumed(compiler, tokenizer):
    c = compiler.compile(SamplingParams(regex=r"Answer: (yes|no)"))
    ff = c.forced_tokens()
    assert ff and tokenizer.decode(ff).startswith("Answer")
    assert c.num_consumed == len(ff)
    rest = c.forced_text().decode()
    assert tokenizer.decode(ff) + rest == "Answer: ", (ff, rest)  # the held-back tail is still forced
    allowed_texts = {tokenizer.decode([t]) for t in allowed_ids(compiler, c)}
    assert allowed_texts and all(t.startswith(rest) or rest.startswith(t) for t in allowed_texts)


# --- grammars and choices ---------------------------------------------------------------------------

# Nested parentheses, up to depth 2 (spelled out so that a random walk always terminates).
LARK_ARITH = r"""
start: e0
e0: t0 (OP t0)*
t0: NUMBER | "(" e1 ")"
e1: t1 (OP t1)*
t1: NUMBER | "(" e2 ")"
e2: NUMBER (OP NUMBER)*
OP: "+" | "-" | "*"
NUMBER: /[0-9]{1,3}/
"""


def _balanced_arith(text: str, max_depth: int) -> bool:
    depth = 0
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if not 0 <= depth <= max_depth:
            return False
    return depth == 0 and re.fullmatch(r"[0-9()+*\-]+", text) is not None


@HSETTINGS
@given(seed=SEEDS)
def test_lark_grammar_random_walk(compiler, seed):
    c = compiler.compile(SamplingParams(grammar=LARK_ARITH))
    tokens, _ = drive(compiler, c, seed, eos_prob=0.7)
    text = text_of(compiler, tokens)
    assert _balanced_arith(text, max_depth=2), text
    flat = re.sub(r"[()]", "", text)
    assert re.fullmatch(r"[0-9]{1,3}([+*\-][0-9]{1,3})*", flat), text


@HSETTINGS
@given(seed=SEEDS)
def test_gbnf_grammar_is_converted(compiler, seed):
    gbnf = 'root ::= answer " " conf\nanswer ::= "yes" | "no"\nconf ::= [0-9] "%"'
    c = compiler.compile(SamplingParams(grammar=gbnf))
    tokens, _ = drive(compiler, c, seed)
    assert re.fullmatch(r"(yes|no) [0-9]%", text_of(compiler, tokens))


CHOICES = ["yes", "no", "yes please", "Paris, France", "naïve café ✓", 'a "quoted" \\ choice']


@HSETTINGS
@given(seed=SEEDS)
def test_choices_random_walk(compiler, seed):
    c = compiler.compile(SamplingParams(choices=CHOICES))
    tokens, _ = drive(compiler, c, seed)
    assert text_of(compiler, tokens) in CHOICES


def test_choice_prefix_of_another_is_accepting_not_finished(compiler, tokenizer):
    c = compiler.compile(SamplingParams(choices=["yes", "yes please"]))
    for t in tokenizer.encode("yes", add_special_tokens=False):
        c.advance(t)
    assert c.is_accepting() and not c.is_finished()
    for t in tokenizer.encode(" please", add_special_tokens=False):
        c.advance(t)
    assert c.is_finished()


# --- EOS, padding, masks -----------------------------------------------------------------------------


def test_all_eos_ids_follow_acceptance(compiler, tokenizer):
    c = compiler.compile(SamplingParams(regex=r"[0-9]{1,3}"))
    assert not set(EOS_IDS) & set(allowed_ids(compiler, c))
    c.advance(tokenizer.encode("7", add_special_tokens=False)[0])
    allowed = set(allowed_ids(compiler, c))
    assert set(EOS_IDS) <= allowed and c.is_accepting() and not c.is_finished()
    c.advance(0)  # the secondary EOS id ends the grammar like the primary one
    assert c.is_finished()


def test_apply_bitmask_masks_only_constrained_rows(compiler, tokenizer):
    V = compiler.vocab_size
    c = compiler.compile(SamplingParams(choices=["alpha", "beta"]))
    mask = compiler.allocate_bitmask(3)
    c.fill_bitmask(mask, 1)
    logits = torch.randn(3, V)
    before = logits.clone()
    apply_bitmask(logits, mask, [1])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    finite = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert finite == allowed_ids(compiler, c)
    assert all(t < len(tokenizer) for t in finite)
    assert torch.equal(logits[1, finite], before[1, finite])
    texts = {tokenizer.decode([t]) for t in finite}
    assert all("alpha".startswith(s) or "beta".startswith(s) for s in texts), texts


def test_apply_bitmask_all_rows_and_narrow_logits(compiler):
    c = compiler.compile(SamplingParams(regex=r"x+"))
    mask = compiler.allocate_bitmask(2)
    c.fill_bitmask(mask, 0)
    c.fill_bitmask(mask, 1)
    logits = torch.zeros(2, compiler.vocab_size - PAD)  # logits narrower than the mask
    apply_bitmask(logits, mask, [0, 1])
    assert torch.equal(torch.isfinite(logits[0]), torch.isfinite(logits[1]))
    assert 0 < int(torch.isfinite(logits[0]).sum()) < 200


def test_fill_bitmasks_in_parallel_equals_per_row(compiler, tokenizer):
    cs = [compiler.compile(SamplingParams(regex=r"[0-9]{1,3}")), compiler.compile(SamplingParams(json_schema=PERSON)),
          compiler.compile(SamplingParams(choices=CHOICES)), compiler.compile(SamplingParams(grammar=LARK_ARITH))]
    cs[0].advance(tokenizer.encode("4", add_special_tokens=False)[0])  # accepting: EOS bits set
    cs[1].forced_tokens()
    rows = [3, 0, 5, 1]
    par, seq = compiler.allocate_bitmask(6), compiler.allocate_bitmask(6)
    fill_bitmasks(list(zip(cs, rows)), par)
    for c, row in zip(cs, rows):
        c.fill_bitmask(seq, row)
    assert torch.equal(par, seq)
    assert torch.equal(par[2], torch.full_like(par[2], -1))  # untouched rows stay all-allowed
    assert bitmask_to_bool(par, compiler.vocab_size)[3, EOS_IDS].all()


def test_bitmask_to_bool_roundtrip():
    allowed = torch.zeros(2, 100, dtype=torch.bool)
    allowed[0, [0, 31, 32, 63, 99]] = True
    allowed[1, 5] = True
    words = torch.zeros(2, 4, dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= 1 << (t % 32)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    assert torch.equal(bitmask_to_bool(words, 100), allowed)


# --- rollback and copies ------------------------------------------------------------------------------


def test_rollback_restores_state(compiler, tokenizer):
    c = compiler.compile(SamplingParams(regex=r"[0-9]{2}-[a-z]{2}"))
    start_mask = allowed_ids(compiler, c)
    ids = tokenizer.encode("12-", add_special_tokens=False)
    for t in ids:
        c.advance(t)
    c.rollback(len(ids))
    assert allowed_ids(compiler, c) == start_mask
    with pytest.raises(ConstraintError, match="roll back"):
        c.rollback(1)


def test_copy_is_independent(compiler, tokenizer):
    c = compiler.compile(SamplingParams(choices=["cat", "dog"]))
    d = c.copy()
    for t in tokenizer.encode("cat", add_special_tokens=False):
        c.advance(t)
    assert c.is_finished() and not d.is_finished()
    for t in tokenizer.encode("dog", add_special_tokens=False):
        d.advance(t)
    assert d.is_finished()


# --- errors --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("params, pattern", [
    (SamplingParams(regex="a(b"), r"invalid regex.*unclosed group"),
    (SamplingParams(regex="(?=look)ahead"), r"invalid regex.*look-?around"),
    (SamplingParams(json_schema={"type": "foo"}), r"invalid json_schema.*foo"),
    (SamplingParams(json_schema="{not json"), r"json_schema is not valid JSON"),
    (SamplingParams(json_schema=42), r"json_schema must be a dict"),
    (SamplingParams(grammar="start: foo"), r"invalid grammar.*unknown name.*foo"),
    (SamplingParams(grammar='root ::= "a'), r"invalid grammar"),
    (SamplingParams(grammar="   "), r"non-empty"),
])
def test_invalid_constraints_raise_helpful_errors(compiler, params, pattern):
    with pytest.raises(ConstraintError, match=re.compile(pattern, re.S | re.I)) as ei:
        compiler.compile(params)
    assert isinstance(ei.value, InvalidRequestError)
    assert "<state>" not in str(ei.value)


def test_bad_choices_and_multiple_constraints():
    p = SamplingParams()
    p.choices = []
    with pytest.raises(ConstraintError, match="non-empty list"):
        constraint_spec(p)
    p = SamplingParams(regex="a")
    p.choices = ["a"]
    with pytest.raises(ConstraintError, match="at most one"):
        constraint_spec(p)


def test_invalid_constraint_does_not_poison_compiler(compiler):
    with pytest.raises(ConstraintError):
        compiler.compile(SamplingParams(regex="a(b"))
    c = compiler.compile(SamplingParams(regex="ab"))
    assert c is not None and not c.is_error()


def test_no_constraint_compiles_to_none(compiler):
    assert compiler.compile(SamplingParams(max_new_tokens=4)) is None


def test_disallowed_token_and_early_eos_raise(compiler, tokenizer):
    c = compiler.compile(SamplingParams(regex=r"[0-9]+"))
    with pytest.raises(ConstraintError, match="EOS token 2 sampled before"):
        c.advance(2)
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    assert not c.is_allowed(letter)
    with pytest.raises(ConstraintError, match=f"token {letter} is not allowed by the regex constraint"):
        c.advance(letter)
    assert c.is_error()


# --- end to end on the real SmolLM2 (engine) -------------------------------------------------------------

PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24},
                   "population_millions": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}


def _ask(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


@pytest.mark.slow
def test_engine_regex_greedy_and_sampled(engine):
    params = [SamplingParams(regex=PHONE, temperature=0, max_new_tokens=24),
              SamplingParams(regex=PHONE, temperature=1.0, seed=7, max_new_tokens=24)]
    outs = engine.generate(["The office phone number is ", "You can call me at "], params)
    for o in outs:
        assert re.fullmatch(PHONE, o.text), o.text
        assert o.finish_reason == "stop"


@pytest.mark.slow
def test_engine_json_schema_batch_validates_and_jumps_forward(engine):
    misses_before = engine.constraint_compiler.cache_info().misses
    questions = [f"Describe {c} as JSON with its country and population in millions." for c in ("Paris", "Tokyo", "Lima")]
    outs = engine.generate(messages=[_ask(q) for q in questions],
                           params=SamplingParams(json_schema=CITY_SCHEMA, temperature=0, max_new_tokens=64))
    for o in outs:
        jsonschema.validate(json.loads(o.text), CITY_SCHEMA)
        assert o.finish_reason == "stop"
        assert o.meta.decode_steps < o.meta.completion_tokens  # forced keys cost no decode step
    assert engine.constraint_compiler.cache_info().misses - misses_before <= 1  # compiled once for the batch


@pytest.mark.slow
def test_engine_pydantic_choices_and_grammar(engine):
    class City(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str = pydantic.Field(max_length=20)
        is_capital: bool

    choices = ["Paris", "London", "Berlin"]
    arith = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'
    outs = engine.generate(
        messages=[_ask("Name the capital of France as JSON."), _ask("What is the capital of France?"),
                  _ask("What is 2 + 2?")],
        params=[SamplingParams(json_schema=City, temperature=0, max_new_tokens=40),
                SamplingParams(choices=choices, temperature=0, max_new_tokens=8),
                SamplingParams(grammar=arith, temperature=0.7, seed=1, max_new_tokens=16)])
    City.model_validate_json(outs[0].text)
    assert outs[1].text in choices
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", outs[2].text), outs[2].text
    assert all(o.finish_reason == "stop" for o in outs)


@pytest.mark.slow
def test_engine_invalid_constraint_fails_at_submit_only(engine):
    handle = engine.submit("The office phone number is ", SamplingParams(regex=PHONE, temperature=0, max_new_tokens=24))
    with pytest.raises(ConstraintError, match="unclosed group"):
        engine.generate("x", SamplingParams(regex="a(b"))
    with pytest.raises(ConstraintError, match="foo"):
        engine.generate(["x", "y"], [SamplingParams(max_new_tokens=2), SamplingParams(json_schema={"type": "foo"})])
    assert re.fullmatch(PHONE, handle.wait().text)


class _SharedEngine:
    """Lends the module engine to the benchmark without letting it shut the engine down."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def shutdown(self) -> None:
        pass


@pytest.mark.slow
def test_json_bench_jump_forward_saves_decode_steps(engine):
    from radix_backend import Engine
    from radix_backend.bench.json_bench import format_report, run

    def factory(enable_jump_forward: bool):
        return _SharedEngine(engine) if enable_jump_forward else Engine(kv_cache_tokens=8192, enable_jump_forward=False)

    result = run(factory, num_prompts=1, max_new_tokens=96)
    off, on = result["modes"]["jump_forward_off"], result["modes"]["jump_forward_on"]
    assert off["valid"] == on["valid"] == 1
    assert off["forced_tokens"] == 0 and off["decode_steps"] == off["completion_tokens"]
    assert on["forced_tokens"] > 0 and on["decode_steps"] < 0.7 * off["decode_steps"]
    assert on["forward_steps"] < off["forward_steps"]
    assert "jump_forward_on" in format_report(result)
