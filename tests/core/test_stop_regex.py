"""Stop regexes on a linear-time automaton (radix_backend/stop_regex.py) and the caps on stops:
`re.search`'s answers, fed in pieces, without its backtracking."""

from __future__ import annotations

import random
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radix_backend.errors import InvalidRequestError
from radix_backend.sampling_params import MAX_STOP_CHARS, MAX_STOP_REGEXES, MAX_STOP_STRINGS, SamplingParams
from radix_backend.stop_regex import MAX_STATES, StopRegex

PATTERNS = [r"a+b", r"(a+)+c", r"\bfoo\b", r"^hello", r"end$", r"(?i)STOP", r"x{2,4}y", r"[^abc]{3}",
            r"\d+\.\d*", r"(cat|dog)s?\s", r"(?m)^##", r"(?s)a.b", r"a.b", r"\Bb", r"colou?r", r"(ab){2}",
            r"a{0}b", r"(a|)+b", r"(?m)x$", r"\w+@\w+", r"[a-c-]+z", r"\Aab", r"b\Z", r"x*?y", r"[\s\S]{2}Q"]
ALPHABET = "abcxyz dog cats foo\n.1234@-_ABSTOPend#Q"


def first_stop(pattern: str, text: str, cuts: list[int]) -> int | None:
    """Where feeding `text` in the pieces that end at `cuts` first reports a match."""
    matcher, start = StopRegex(pattern).matcher(), 0
    for cut in cuts:
        if matcher.feed(text[start:cut]):
            return cut
        start = cut
    return None


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(PATTERNS), st.text(alphabet=ALPHABET, max_size=30), st.randoms(use_true_random=False))
def test_feeding_pieces_finds_what_re_search_finds_on_each_prefix(pattern, text, rng):
    cuts = sorted(rng.sample(range(1, len(text) + 1), min(len(text), rng.randint(1, 6)))) if text else [0]
    want = next((cut for cut in cuts if re.search(pattern, text[:cut])), None)
    assert first_stop(pattern, text, cuts) == want


def test_a_backtracking_pattern_costs_linear_time():
    """`re.search("(a+)+c", "a" * n)` doubles its time with each "a"; the automaton does not."""
    matcher = StopRegex(r"(a+)+c").matcher()
    start = time.perf_counter()
    assert not any(matcher.feed("a") for _ in range(5000))
    assert time.perf_counter() - start < 1.0  # ~7 ms measured; re would not finish
    assert matcher.feed("c")


@pytest.mark.parametrize("pattern, reason", [
    (r"(a)\1", "groupref"), (r"(?=a)b", "assert"), (r"(?<!a)b", "assert_not"), (r"a++", "possessive"),
    (r"(?>a)", "atomic"), (r"(a)?(?(1)b|c)", "groupref_exists"), ("a" * 1001, "characters"),
    (r"(a{1,100}){1,100}", f"more than {MAX_STATES}"), ("(unclosed", "not a valid regular expression")])
def test_what_has_no_linear_time_automaton_is_refused_by_name(pattern, reason):
    with pytest.raises(InvalidRequestError, match=re.escape(reason)):
        SamplingParams(stop_regex=pattern).validate()


def test_stop_counts_and_lengths_are_capped_with_a_clear_error():
    SamplingParams(stop=["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS, stop_regex=["a"] * MAX_STOP_REGEXES).validate()
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_STOP_STRINGS} strings"):
        SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]).validate()
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_STOP_CHARS} characters"):
        SamplingParams(stop=["x" * (MAX_STOP_CHARS + 1)]).validate()
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_STOP_REGEXES} patterns"):
        SamplingParams(stop_regex=["a"] * (MAX_STOP_REGEXES + 1)).validate()


def test_a_hostile_stop_regex_does_not_stall_its_batch_mate(tiny_engine):
    """The stall measured before: "(a+)+c" on output forced to "aaaa..." made another request's two
    tokens take seconds. Both now run in one batch; the other keeps its run-alone time."""
    from radix_backend import SamplingParams as Params

    eng = tiny_engine
    a = eng.tokenizer.encode("a", add_special_tokens=False)
    assert len(a) == 1
    other = Params(max_new_tokens=2, temperature=0, ignore_eos=True)
    alone = min(_timed(eng, "Hi", other) for _ in range(3))
    hostile = Params(max_new_tokens=400, temperature=0, ignore_eos=True, stop_regex=r"(a+)+c",
                     logit_bias={a[0]: 100.0})
    handle = eng.submit("Say a", hostile)
    time.sleep(0.3)  # the hostile request is decoding "aaaa..."
    beside = _timed(eng, "Hi", other)
    out = handle.wait(120)
    assert out.text.startswith("a" * 50) and out.finish_reason == "length"
    assert beside < 2 * alone + 0.5  # a decode step with one more row, not a backtracking search


def _timed(eng, prompt: str, params) -> float:
    start = time.perf_counter()
    eng.generate(prompt, params)
    return time.perf_counter() - start


def test_random_patterns_agree_with_re():
    """Random small patterns over a small alphabet: the same answer as re on every prefix."""
    rng = random.Random(7)
    atoms = ["a", "b", ".", "[ab]", "[^a]", r"\d", r"\s", "(a|b)", "(ab)", "^", "$", r"\b"]
    checked = 0
    for _ in range(400):
        pattern = "".join(rng.choice(atoms) + rng.choice(["", "*", "+", "?", "{1,2}", "*?"]) for _ in range(rng.randint(1, 4)))
        try:
            re.compile(pattern)
        except re.error:
            continue
        text = "".join(rng.choice("ab1 \n") for _ in range(rng.randint(0, 12)))
        cuts = list(range(1, len(text) + 1)) or [0]
        want = next((cut for cut in cuts if re.search(pattern, text[:cut])), None)
        assert first_stop(pattern, text, cuts) == want, (pattern, text)
        checked += 1
    assert checked > 200
