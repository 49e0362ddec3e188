"""Speculative decoding from text the engine already holds: drafts with no draft model.

Two draft sources, both free to consult:
- the request's own context (prompt lookup): the longest recent n-gram ending the sequence that
  occurred before, and the tokens that followed it then (`ContextIndex`);
- the radix tree: when another request already continued this very sequence, what it produced
  (`RadixCache.continuation`).

Each decoding request's draft is verified in the same batched forward as everyone else's rows:
draft token j is one more decode row of the request, attending to the request's KV plus the rows
before it (`ScheduleBatch`), so every backend serves it as an ordinary decode step and, with batch
invariance, each row's logits are bit-identical to a plain decode step's. The output processor
then samples the rows in order with the request's own sampler state and keeps a draft token only
while the sampled token equals it, so the output (greedy, or sampled with a seed) is exactly what
plain decoding gives; for a one-token draft distribution this is the standard speculative
rejection rule (accept d with probability p(d), else sample from p with d removed).

How many draft tokens a request gets each step is a small cost model (`plan_drafts`): a step of
r rows costs `StepCost(r)` one-row steps, draft token j pays off with probability alpha^j (alpha:
the request's acceptance rate for that kind of draft), and of the batch's draft tokens, most likely
first, the step takes as many as maximise its expected tokens per unit of cost. Open-ended text,
where drafts miss, soon gets none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

# Shortest and longest n-gram a context lookup matches (a longer match is tried first).
MIN_NGRAM = 2
MAX_NGRAM = 5
# Acceptance is estimated per kind of draft (`Draft.kind`: the source and, for a context lookup,
# the length of the n-gram it matched) at two levels. Engine-wide (`DraftStats`), every verified
# draft of the kind counts, the past weighted GLOBAL_DECAY per update, starting optimistic
# (OPTIMISTIC_RATE with PRIOR_WEIGHT pseudo-counts) so a kind is tried before it is judged; it is
# the prior of each request's own estimate (`SpecState`), whose counts are weighted DECAY per
# verified step. A kind proposed but not drafted fades back towards its prior (IDLE_DECAY per
# request, GLOBAL_IDLE_DECAY engine-wide), so text that turns repetitive is tried again.
OPTIMISTIC_RATE = 0.9
PRIOR_WEIGHT = 2.0
DECAY = 0.85
GLOBAL_DECAY = 0.98
IDLE_DECAY = 0.97
GLOBAL_IDLE_DECAY = 0.995


@dataclass(frozen=True)
class StepCost:
    """The time of a decode step of `rows` rows in one-row steps: fixed + per_row * rows + per_tile *
    ceil(rows / tile_rows). On a CPU the low-bit matmuls take activation rows in tiles, each tile
    one more pass that unpacks the weights, so a row past a multiple of the tile costs more than
    the rows within it. A GPU's decode step is bound by reading the weights: extra rows are nearly
    free there."""

    fixed: float
    per_row: float
    per_tile: float = 0.0
    tile_rows: int = 1

    def __call__(self, rows: int) -> float:
        return self.fixed + self.per_row * rows + self.per_tile * -(-rows // self.tile_rows)


def cpu_step_cost(tile_rows: int) -> StepCost:
    """Measured on a 2-core AMD EPYC (Zen 5, tiles of 8 rows) with SmolLM2 Q4_1 over a 500-token
    context, one request's decode rows (medians of interleaved rounds), in one-row steps: 2 rows
    1.22, 3: 1.34, 4: 1.43, 5: 1.6, 6: 1.9, 8: 2.25, 9: 2.7, 12: 3.07, 16: 3.81 (BENCHMARKS.md):
    about 0.18 a row and 0.27 a tile over 0.55 fixed. The ninth row of
    a batch of 8 thus costs 0.45, which a flat share of a one-row step per row (0.3) underpriced:
    drafts of one or two requests in a batch of 8 slowed open-ended chat down. Other CPUs and
    models keep the shape with their own tile (`native.matmul_tile_rows`)."""
    return StepCost(fixed=0.55, per_row=0.18, per_tile=0.27, tile_rows=max(1, tile_rows))


GPU_STEP_COST = StepCost(fixed=0.98, per_row=0.02)


_HASH_MULTIPLIER = 0x9E3779B97F4A7C15  # odd: the 64-bit golden-ratio constant
_HASH_MASK = (1 << 64) - 1
# Every kind of draft `ContextIndex.propose` and the tree give (`Draft.kind`)
DRAFT_KINDS = ("tree",) + tuple(f"context:{n}" for n in range(MIN_NGRAM, MAX_NGRAM + 1))


@dataclass
class Draft:
    tokens: list[int]
    kind: str  # where it came from: "tree", or "context:N" for a context match of an N-gram


def ngram_key(gram: Sequence[int]) -> int:
    """An n-gram's 64-bit polynomial hash: what `ContextIndex` keys its n-grams by."""
    key = 0
    for token in gram:
        key = (key * _HASH_MULTIPLIER + token + 1) & _HASH_MASK
    return key


def ngram_keys(tokens: np.ndarray, n: int) -> list[int]:
    """`ngram_key` of each n-gram of `tokens` (uint64 token ids + 1), on arrays."""
    count = len(tokens) - n + 1
    keys = np.zeros(count, dtype=np.uint64)
    for j in range(n):  # uint64 arithmetic wraps, as the mask does above
        keys = keys * np.uint64(_HASH_MULTIPLIER) + tokens[j:j + count]
    return keys.tolist()


class ContextIndex:
    """The n-grams of one request's tokens, each mapped to where its latest earlier occurrence
    continued; kept up to date as tokens are appended (O(MAX_NGRAM) a token). N-grams are keyed by
    a 64-bit hash, a long prompt's all at once on arrays: a tuple per n-gram built in Python took
    ~1 ms a 1,000-token prompt, 30 ms when a batch of 30 such requests first looked for drafts. A
    match is checked against the tokens, so a hash collision can only lose a draft."""

    BULK = 32  # new tokens from which the n-grams are hashed on arrays

    def __init__(self) -> None:
        self._next: list[dict[int, int]] = [{} for _ in range(MAX_NGRAM + 1)]  # by n: key -> position after
        self._indexed = 0  # n-grams ending before this position are indexed

    def propose(self, ids: Sequence[int], k: int) -> Draft:
        """Up to `k` tokens that followed the longest earlier occurrence of the sequence's ending."""
        last = len(ids) - 1  # n-grams ending here have no continuation yet: looked up, not indexed
        if last - self._indexed >= self.BULK:
            lo = max(self._indexed - MAX_NGRAM + 1, 0)
            tokens = np.asarray(ids[lo:last], dtype=np.uint64) + np.uint64(1)
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                first = max(self._indexed, n - 1)  # the n-grams ending at first .. last - 1
                self._next[n].update(zip(ngram_keys(tokens[first - n + 1 - lo:], n), range(first + 1, last + 1)))
        else:
            for end in range(self._indexed, last):
                for n in range(MIN_NGRAM, min(MAX_NGRAM, end + 1) + 1):
                    self._next[n][ngram_key(ids[end - n + 1:end + 1])] = end + 1
        self._indexed = max(self._indexed, last)
        for n in range(min(MAX_NGRAM, len(ids)), MIN_NGRAM - 1, -1):
            suffix = list(ids[len(ids) - n:])
            start = self._next[n].get(ngram_key(suffix))
            if start is not None and list(ids[start - n:start]) == suffix:
                return Draft(list(ids[start:start + k]), f"context:{n}")
        return Draft([], "context")


@dataclass
class Acceptance:
    """How often one kind of draft token is accepted: the per-token rate of a geometric model
    (accepted tokens over accepted tokens plus rejections) from decayed counts and a prior."""

    accepted: float = 0.0
    rejected: float = 0.0

    def rate(self, prior: float, weight: float = PRIOR_WEIGHT) -> float:
        return (self.accepted + weight * prior) / (self.accepted + self.rejected + weight)

    def update(self, proposed: int, accepted: int, decay: float) -> None:
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + (1.0 if accepted < proposed else 0.0)

    def fade(self, decay: float) -> None:
        self.accepted *= decay
        self.rejected *= decay


class DraftStats:
    """Engine-wide acceptance per kind of draft: the prior of every request's own estimate."""

    def __init__(self) -> None:
        self.kinds: dict[str, Acceptance] = {}

    def rate(self, kind: str) -> float:
        return self.kinds.setdefault(kind, Acceptance()).rate(OPTIMISTIC_RATE)

    def record(self, kind: str, proposed: int, accepted: int) -> None:
        self.kinds.setdefault(kind, Acceptance()).update(proposed, accepted, GLOBAL_DECAY)

    def idle(self, kind: str) -> None:
        self.kinds.setdefault(kind, Acceptance()).fade(GLOBAL_IDLE_DECAY)


@dataclass
class SpecState:
    """A request's speculative-decoding state (owned by its `Req`)."""

    context: ContextIndex = field(default_factory=ContextIndex)
    kinds: dict[str, Acceptance] = field(default_factory=dict)

    def rate(self, kind: str, stats: DraftStats) -> float:
        return self.kinds.setdefault(kind, Acceptance()).rate(stats.rate(kind))

    def best_rate(self, priors: dict[str, float]) -> float:
        """The highest `rate` over the kinds of `priors` (each kind's engine-wide rate, taken once
        for a whole batch); a kind this request has no counts for is at its prior."""
        return max(self.kinds[kind].rate(prior) if kind in self.kinds else prior for kind, prior in priors.items())

    def record(self, kind: str, proposed: int, accepted: int, stats: DraftStats) -> None:
        self.kinds.setdefault(kind, Acceptance()).update(proposed, accepted, DECAY)
        stats.record(kind, proposed, accepted)

    def idle(self, kind: str, stats: DraftStats) -> None:
        self.kinds.setdefault(kind, Acceptance()).fade(IDLE_DECAY)
        stats.idle(kind)


def pick_draft(candidates: list[Draft], rate: Callable[[str], float]) -> Draft | None:
    """The candidate with the most expected accepted tokens, `rate(kind)` a token's acceptance."""
    def expected(d: Draft) -> float:
        a = rate(d.kind)
        return sum(a ** j for j in range(1, len(d.tokens) + 1))

    return max((d for d in candidates if d.tokens), key=expected, default=None)


# The pruning bound of `plan_drafts` holds exactly; a token on it can only tie the best value, which
# float rounding may still lift by an ulp. The cut leaves such tokens in, to plan what the
# definition plans.
ROUNDING_MARGIN = 1.0 - 1e-9


def plan_drafts(rates: list[float], lengths: list[int], rows: int, tokens: float, cost: StepCost) -> list[int]:
    """How many draft tokens each request gets. Request i may take up to `lengths[i]` tokens, its
    j-th accepted with probability rates[i]**j; the step already has `rows` rows, of which the
    `tokens` decode rows give a token each (the rest are prompt rows, computed whatever happens).
    The batch's draft tokens are ranked, most likely first (each request's in its own order), and
    the step takes the leading run of them that maximises expected tokens per unit of decoding
    cost: the decode rows' own `cost(tokens)` plus what the run adds to this step,
    `cost(rows + n) - cost(rows)` (the whole run is weighed, not one row at a time: a row that
    opens a new tile can pay off only together with the rows that fill it). Prompt rows are left
    out of the yardstick: against a 2,000-row prefill chunk's cost a few decode rows' tokens are
    worth next to nothing, so any draft seemed to pay there (the branching benchmark, whose chat
    answers start while other prompts are still computed, drafted 73 tokens of which 22 were
    accepted; weighed this way, 18 of which 15).

    Only tokens that could still raise the best value are ranked: every further token adds at most
    its own likelihood p and at least `cost.per_row`, so once p <= best * per_row no longer run can
    beat the best (a mediant bound), and a token below tokens / cost(tokens) * per_row is never
    reached. Plain Python on those few tokens: the step's first numpy call, after a forward has
    swept the caches, took ~0.1 ms, more than the whole plan."""
    base, step = cost(tokens), cost(rows)
    best = tokens / base
    floor = best * cost.per_row * ROUNDING_MARGIN
    ranked: list[tuple[float, int]] = []
    for i, (rate, n) in enumerate(zip(rates, lengths)):
        for j in range(1, n + 1):
            likely = rate ** j
            if likely <= floor:
                break
            ranked.append((likely, i))
    ranked.sort(key=lambda pi: -pi[0])  # stable: each request's tokens stay in their order
    best_n, gained = 0, 0.0
    for n, (p, _) in enumerate(ranked, 1):
        if p <= best * cost.per_row * ROUNDING_MARGIN:
            break
        gained += p
        value = (tokens + gained) / (base + cost(rows + n) - step)
        if value > best:
            best_n, best = n, value
    counts = [0] * len(rates)
    for _, i in ranked[:best_n]:
        counts[i] += 1
    return counts


def drafts_may_pay(best_rates: list[float], caps: list[int], rows: int, tokens: float, cost: StepCost) -> bool:
    """Whether any draft could be worth its rows this step, before looking any up: `plan_drafts`
    with each request's best acceptance rate over every kind of draft and its longest draft. A
    draft's tokens can only be less likely, so where this plans none the real drafts plan none too,
    and the lookups (a long prompt's n-grams indexed in Python: ~1 ms a request of 1,000 tokens)
    are skipped: a batch of 32 such requests spent 4.5 % of its time on them for nothing."""
    return any(plan_drafts(best_rates, caps, rows, tokens, cost))
