"""Stop regexes matched in time linear in the text: a Thompson automaton stepped over each new piece
of output, never Python's backtracking `re` over the whole output.

Why: the scheduler thread is shared. `re.search("(a+)+c", text)` after every token backtracks
exponentially on text like "aaaa...", so one hostile request stalled every other request. Here the
pattern (parsed with Python's own regex parser, so the syntax and character classes are `re`'s) is
compiled once into an NFA of at most MAX_STATES states; matching keeps the set of live states
between tokens, so each new character costs O(states), and the step results are memoised (a lazy
DFA, RE2's idea) so ordinary text costs a dictionary lookup per character. `search` semantics: a
match anywhere in the text finishes the request, as `re.search` would on the same text.

Supported: literals, `.`, classes (ranges, negation, `\\d \\s \\w` and their negations), groups,
alternation, greedy and lazy repeats (laziness cannot change whether a match exists), `^ $ \\A \\Z
\\b \\B` and the flags `i m s` (also inline). Refused with a clear error: back-references,
lookaround, conditionals, atomic groups and possessive repeats (none of them has a linear-time
automaton).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from .errors import InvalidRequestError

try:  # Python 3.11+
    from re import _constants as sre
    from re import _parser as sre_parse
except ImportError:  # Python 3.10
    import sre_constants as sre  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

MAX_PATTERN_CHARS = 1000
MAX_STATES = 1000
_MEMO_ENTRIES = 4096  # memoised steps per matcher before the table starts over

_Pred = Callable[[str], bool]


@dataclass
class _State:
    kind: str  # "char" (consume one char matching `pred`), "split", "assert", "match"
    out: int = -1
    out2: int = -1  # split only
    pred: _Pred | None = None
    test: Callable[[str | None, str | None], bool] | None = None  # assert: (previous, next char)


def _is_word(c: str | None) -> bool:
    return c is not None and (c.isalnum() or c == "_")


_CATEGORIES: dict[object, _Pred] = {
    sre.CATEGORY_DIGIT: str.isdecimal, sre.CATEGORY_NOT_DIGIT: lambda c: not c.isdecimal(),
    sre.CATEGORY_SPACE: str.isspace, sre.CATEGORY_NOT_SPACE: lambda c: not c.isspace(),
    sre.CATEGORY_WORD: _is_word, sre.CATEGORY_NOT_WORD: lambda c: not _is_word(c),
}


class StopRegex:
    """One compiled stop regex; `matcher()` gives the per-request incremental state."""

    def __init__(self, pattern: str) -> None:
        if len(pattern) > MAX_PATTERN_CHARS:
            raise InvalidRequestError(f"stop_regex is {len(pattern)} characters; at most {MAX_PATTERN_CHARS}")
        try:
            parsed = sre_parse.parse(pattern, 0)
        except (sre.error, RecursionError, OverflowError) as exc:
            raise InvalidRequestError(f"stop_regex {pattern!r} is not a valid regular expression: {exc}") from None
        self.pattern = pattern
        self.flags = parsed.state.flags
        self.states: list[_State] = []
        start, ends = self._build(list(parsed))
        match = self._add(_State("match"))
        self._patch(ends, match)
        self.start = start

    def matcher(self) -> "StopRegexMatcher":
        return StopRegexMatcher(self)

    # ---- Thompson construction: each piece returns (entry state, dangling exits to patch) --------
    def _add(self, state: _State) -> int:
        if len(self.states) >= MAX_STATES:
            raise InvalidRequestError(f"stop_regex {self.pattern[:80]!r} needs more than {MAX_STATES} automaton "
                                      "states (large counted repeats); simplify it")
        self.states.append(state)
        return len(self.states) - 1

    def _patch(self, ends: list[tuple[int, str]], target: int) -> None:
        for index, field in ends:
            setattr(self.states[index], field, target)

    def _build(self, items: list) -> tuple[int, list[tuple[int, str]]]:
        """A sequence of parsed items; an empty one is a single pass-through state."""
        if not items:
            s = self._add(_State("split"))  # out2 stays -1: no second branch
            return s, [(s, "out")]
        start, ends = self._item(*items[0])
        for op, arg in items[1:]:
            nxt, nxt_ends = self._item(op, arg)
            self._patch(ends, nxt)
            ends = nxt_ends
        return start, ends

    def _item(self, op, arg) -> tuple[int, list[tuple[int, str]]]:
        if op in (sre.LITERAL, sre.NOT_LITERAL, sre.ANY, sre.IN):
            s = self._add(_State("char", pred=self._char_pred(op, arg)))
            return s, [(s, "out")]
        if op is sre.SUBPATTERN:
            _group, add_flags, del_flags, sub = arg
            if add_flags or del_flags:
                raise InvalidRequestError("stop_regex: scoped inline flags (?i:...) are not supported; "
                                          "put the flags at the start of the pattern")
            return self._build(list(sub))
        if op is sre.BRANCH:
            alternatives = [self._build(list(alt)) for alt in arg[1]]
            entry, ends = alternatives[-1]
            for alt_start, alt_ends in reversed(alternatives[:-1]):
                entry = self._add(_State("split", out=alt_start, out2=entry))
                ends = alt_ends + ends
            return entry, ends
        if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
            return self._repeat(*arg)
        if op is sre.AT:
            s = self._add(_State("assert", test=self._anchor(arg)))
            return s, [(s, "out")]
        raise InvalidRequestError(f"stop_regex {self.pattern[:80]!r}: {str(op).lower()} (back-references, lookaround, "
                                  "conditionals, atomic groups, possessive repeats) has no linear-time matcher")

    def _repeat(self, low: int, high, sub) -> tuple[int, list[tuple[int, str]]]:
        """`low` copies, then a loop (unbounded) or `high - low` copies each of which may be skipped."""
        start: int | None = None
        ends: list[tuple[int, str]] = []

        def append(piece_start: int, piece_ends: list[tuple[int, str]]) -> None:
            nonlocal start, ends
            if start is None:
                start = piece_start
            else:
                self._patch(ends, piece_start)
            ends = piece_ends

        for _ in range(low):
            append(*self._build(list(sub)))
        if high is sre.MAXREPEAT:
            body, body_ends = self._build(list(sub))
            loop = self._add(_State("split", out=body))
            self._patch(body_ends, loop)
            append(loop, [(loop, "out2")])
        else:
            skips: list[tuple[int, str]] = []
            for _ in range(high - low):
                body, body_ends = self._build(list(sub))
                gate = self._add(_State("split", out=body))
                append(gate, body_ends)
                skips.append((gate, "out2"))
            ends = ends + skips
        return (start, ends) if start is not None else self._build([])

    def _char_pred(self, op, arg) -> _Pred:
        ignore_case = bool(self.flags & sre.SRE_FLAG_IGNORECASE)
        fold = (lambda c: c.casefold()) if ignore_case else (lambda c: c)
        if op is sre.LITERAL:
            want = fold(chr(arg))
            return lambda c: fold(c) == want
        if op is sre.NOT_LITERAL:
            reject = fold(chr(arg))
            return lambda c: fold(c) != reject
        if op is sre.ANY:
            return (lambda c: True) if self.flags & sre.SRE_FLAG_DOTALL else (lambda c: c != "\n")
        negate = bool(arg) and arg[0][0] is sre.NEGATE
        tests = [self._class_item(kind, value, ignore_case) for kind, value in (arg[1:] if negate else arg)]
        return (lambda c: not any(t(c) for t in tests)) if negate else (lambda c: any(t(c) for t in tests))

    def _class_item(self, kind, value, ignore_case: bool) -> _Pred:
        if kind is sre.LITERAL:
            want = chr(value)
            return (lambda c: c.casefold() == want.casefold()) if ignore_case else (lambda c: c == want)
        if kind is sre.RANGE:
            lo, hi = value
            if ignore_case:
                return lambda c: any(lo <= ord(x) <= hi for x in {c, c.lower(), c.upper()})
            return lambda c: lo <= ord(c) <= hi
        if kind is sre.CATEGORY and value in _CATEGORIES:
            return _CATEGORIES[value]
        raise InvalidRequestError(f"stop_regex {self.pattern[:80]!r}: class item {kind} is not supported")

    def _anchor(self, at) -> Callable[[str | None, str | None], bool]:
        multiline = bool(self.flags & sre.SRE_FLAG_MULTILINE)
        if at is sre.AT_BEGINNING:
            return (lambda p, n: p is None or p == "\n") if multiline else (lambda p, n: p is None)
        if at is sre.AT_BEGINNING_STRING:
            return lambda p, n: p is None
        if at is sre.AT_END:  # as `re`: the end, or before a newline that ends the text (any newline: multiline)
            return (lambda p, n: n is None or n == "\n") if multiline else (lambda p, n: n is None)
        if at is sre.AT_END_STRING:
            return lambda p, n: n is None
        if at is sre.AT_BOUNDARY:
            return lambda p, n: _is_word(p) != _is_word(n)
        if at is sre.AT_NON_BOUNDARY:
            return lambda p, n: _is_word(p) == _is_word(n)
        raise InvalidRequestError(f"stop_regex {self.pattern[:80]!r}: anchor {at} is not supported")


class StopRegexMatcher:
    """The live automaton states of one request's text so far; `feed` the new text, get whether a
    match has appeared anywhere in the whole text."""

    def __init__(self, regex: StopRegex) -> None:
        self.regex = regex
        self._pending: frozenset[int] = frozenset()  # states waiting for the next character
        self._prev: str | None = None  # the last character fed (None: at the start)
        self._last_newline_end = False  # the text ends in "\n": `$` may also match before it
        self._before_newline: frozenset[int] = frozenset()
        self._before_prev: str | None = None
        self._memo: dict[tuple[frozenset[int], str | None, str], tuple[frozenset[int], bool]] = {}

    def feed(self, text: str) -> bool:
        """Consume `text`; True when the text fed so far contains a match."""
        for c in text:
            before = (self._pending, self._prev)
            key = (self._pending, self._prev, c)
            step = self._memo.get(key)
            if step is None:
                live, matched = self._closure(self._pending, self._prev, c)
                states = self.regex.states
                step = (frozenset(states[s].out for s in live if states[s].pred(c)), matched)
                if len(self._memo) >= _MEMO_ENTRIES:
                    self._memo.clear()
                self._memo[key] = step
            if step[1]:
                return True
            self._pending, self._prev = step[0], c
            self._before_newline, self._before_prev = before
        if self._closure(self._pending, self._prev, None)[1]:
            return True
        # `$` before a final newline: the state set just before it, with that newline as the next char
        return self._prev == "\n" and self._closure(self._before_newline, self._before_prev, "\n", end_follows=True)[1]

    def _closure(self, pending: frozenset[int], prev: str | None, nxt: str | None,
                 end_follows: bool = False) -> tuple[list[int], bool]:
        """The character states reachable from `pending` and a match starting here, without consuming
        (assertions judged on the characters around), and whether the match state is among them."""
        states = self.regex.states
        stack = [*pending, self.regex.start]  # a new match may start at every position
        seen: set[int] = set()
        live: list[int] = []
        matched = False
        while stack:
            s = stack.pop()
            if s < 0 or s in seen:
                continue
            seen.add(s)
            state = states[s]
            if state.kind == "char":
                live.append(s)
            elif state.kind == "split":
                stack += (state.out, state.out2)
            elif state.kind == "assert":
                if state.test(prev, nxt) or (end_follows and state.test(prev, None)):
                    stack.append(state.out)
            else:
                matched = True
        return live, matched


compile_stop_regex = functools.lru_cache(maxsize=256)(StopRegex)  # validated at submit, reused per request


class StopRegexWatch:
    """A request's stop regexes over its output text, fed only what was added since the last look."""

    def __init__(self, patterns: list[str], start: int) -> None:
        self.matchers = [compile_stop_regex(p).matcher() for p in patterns]
        self.fed = start  # text before this was fed (or is never searched: below min_new_tokens)

    def first_match(self, text: str) -> str | None:
        """The first pattern (in the request's order) that matches the text from `start` on."""
        if len(text) <= self.fed:
            return None
        new, self.fed = text[self.fed:], len(text)
        return next((m.regex.pattern for m in self.matchers if m.feed(new)), None)
