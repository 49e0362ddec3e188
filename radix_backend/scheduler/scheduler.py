"""Scheduler: one background thread that owns the radix cache, the KV slots and every running request.

Each step it (1) takes new requests and aborts from its inbox, (2) keeps every running request
decoding, evicting cached leaves or retracting a request when KV runs short, (3) admits waiting
requests in cache-aware order (`lpm`: longest cached prefix first) within a prefill token budget,
chunking a long prompt, and (4) runs one mixed forward (prefill chunks + decode tokens) and
samples. Finished requests' tokens go into the radix tree so later calls reuse them.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from .admission import PrefillAdder, StepBudget, needs_match_to_order, order_waiting
from ..config import EngineConfig
from ..errors import EngineShutdownError, KVCacheTooSmallError, RequestAbortedError
from ..model_executor.model_runner import ForwardInput, ModelRunner
from ..outputs import TokenLogprob
from ..mem_cache.disk_tier import DiskTier, open_disk_tier
from ..mem_cache.radix_cache import RadixCache
from .request import Req
from .sampling import SamplerRow, add_logit_bias, sample, suppress_tokens, token_logprobs

logger = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    forward_steps: int = 0
    generated_tokens: int = 0
    retractions: int = 0
    finished_requests: int = 0


@dataclass
class _Batch:
    reqs: list[Req] = field(default_factory=list)
    new_slots: list[torch.Tensor] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)  # logits rows each request gets from the forward

    def add(self, req: Req, slots: torch.Tensor, n: int) -> None:
        self.reqs.append(req)
        self.new_slots.append(slots)
        self.extend_lens.append(n)


class Scheduler:
    def __init__(self, runner: ModelRunner, config: EngineConfig, *, decode: Callable[[list[int], bool], str]) -> None:
        self.runner = runner
        self.decode = decode
        self.page_size = config.page_size
        self.policy = config.schedule_policy
        self.max_running = config.max_running_requests
        self.prefill_budget = config.chunked_prefill_tokens
        self.enable_jump_forward = config.enable_jump_forward
        self.allocator = runner.kv_pool.make_allocator(debug=config.debug_slots)
        self.tree = RadixCache(self.allocator, page_size=config.page_size, disable=config.disable_radix_cache)
        self.disk: DiskTier | None = None
        if config.disk_cache_dir:
            self.disk = open_disk_tier(config, runner, self.tree, self._alloc_slots)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.stats = SchedulerStats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="radix-scheduler", daemon=True)
        self._thread.start()
        _live_schedulers.add(self)

    # ---- thread-safe entry points ---------------------------------------------------------
    def submit(self, req: Req) -> None:
        if self._stop.is_set():
            raise EngineShutdownError("the engine is shut down; create a new Engine")
        if req.constraint is not None and self.enable_jump_forward:
            from . import constrained  # imported by the engine already when a request has a constraint

            constrained.append_forced_tokens(req)  # tokens the grammar forces up front join the prompt's prefill
            self._detokenize(req)
        self._inbox.put(("add", req))

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    def call(self, fn: Callable[[], object], timeout: float = 60.0) -> object:
        """Run fn on the scheduler thread between steps (e.g. flush_cache, stats)."""
        box: dict[str, object] = {}
        done = threading.Event()
        self._inbox.put(("call", (fn, box, done)))
        if not done.wait(timeout):
            raise TimeoutError("scheduler did not answer in time")
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box.get("value")

    @property
    def is_stopped(self) -> bool:
        return self._stop.is_set()

    def shutdown(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout=30)
        if self.disk is not None:
            self.disk.store.close()  # queued block writes land before the process may exit

    # ---- loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            idle = not self.waiting and not self.running
            self._drain_inbox(block=idle)
            if self._stop.is_set():
                break
            try:
                with torch.inference_mode():  # logits are inference tensors; sampling edits them in place
                    self._step()
            except Exception as exc:  # a bug or a device error: fail the batch, keep serving
                logger.exception("scheduler step failed")
                for req in list(self.running) + list(self.waiting):
                    self._finish(req, error=exc)
        for req in list(self.running) + list(self.waiting):
            self._finish(req, error=EngineShutdownError("the engine was shut down before this request finished"))
        self._drain_inbox(block=False, shutting_down=True)

    def _drain_inbox(self, block: bool, shutting_down: bool = False) -> None:
        first = True
        while True:
            try:
                kind, payload = self._inbox.get(timeout=0.5) if (block and first) else self._inbox.get_nowait()
            except queue.Empty:
                return
            first = False
            if kind == "add":
                if shutting_down:
                    payload.handle.fail(EngineShutdownError("the engine was shut down"))
                else:
                    self.waiting.append(payload)
            elif kind == "abort":
                self._abort(payload)
            elif kind == "call":
                fn, box, done = payload
                try:
                    box["value"] = fn()
                except Exception as exc:
                    box["error"] = exc
                done.set()

    def _abort(self, rid: str) -> None:
        for req in list(self.waiting) + self.running:
            if req.rid == rid:
                req.finish_reason = "abort"
                self._finish(req)
                return

    # ---- one step ---------------------------------------------------------------------------
    def _step(self) -> None:
        batch = _Batch()
        budget = StepBudget(self.prefill_budget, self.page_size)
        self._schedule_running(batch, budget)
        self._schedule_waiting(batch, budget)
        if not batch.reqs:
            if self.waiting and not self.running:
                self._fail_unschedulable()
            return
        try:
            logits = self.runner.forward(self._build_forward(batch))
        except Exception as exc:
            logger.exception("forward failed; failing its %d requests", len(batch.reqs))
            for req, slots in zip(batch.reqs, batch.new_slots):
                if slots.numel():
                    self.allocator.free(slots)
                self._finish(req, error=exc)
            return
        self.stats.forward_steps += 1
        self._process_results(batch, logits)

    def _schedule_running(self, batch: _Batch, budget: StepBudget) -> None:
        """Every running request computes its pending tokens (1 when decoding; the next chunk
        when its prompt is still being prefilled); retract others when KV runs out."""
        for req in sorted(self.running, key=lambda r: r.submit_time):
            if req not in self.running:
                continue  # retracted while making room for an earlier one
            n = req.pending_tokens
            if n > 1:  # still prefilling a chunked prompt (or forced tokens): within the budget
                n = budget.chunk_len(n)
                if n <= 0:
                    continue
            slots = self._alloc(req, n)
            while slots is None:
                victim = max((r for r in self.running if r is not req and r not in batch.reqs),
                             key=lambda r: r.submit_time, default=None)
                if victim is None:
                    break
                self._retract(victim)
                slots = self._alloc(req, n)
            if slots is None:
                self._retract(req)
                continue
            if n > 1:
                budget.spend(n)
            batch.add(req, slots, n)

    def _schedule_waiting(self, batch: _Batch, budget: StepBudget) -> None:
        if needs_match_to_order(self.policy, len(self.waiting)):
            for req in self.waiting:
                if req.last_node is None:
                    self._match(req)
        self.waiting = deque(order_waiting(self.waiting, self.policy))
        adder = PrefillAdder(budget, self.running, self.max_running)
        for req in list(self.waiting):
            if not adder.has_room():
                break
            if req.last_node is None:
                self._match(req)
            if adder.should_defer(req):
                continue
            n = adder.admissible_len(req, self._available())
            slots = self._alloc(req, n) if n else None
            if slots is None:
                break
            adder.admit(req, n)
            batch.add(req, slots, n)
        for req in adder.admitted:
            self.waiting.remove(req)
            self.running.append(req)
        for req in self.waiting:  # unlock matches of requests that stay waiting; re-match next step
            self._release_match(req)

    def _fail_unschedulable(self) -> None:
        """Nothing runs and the head request cannot get KV even with an empty tree: fail it."""
        head = self.waiting[0]
        self.tree.evict(self.tree.evictable_size())
        if self._available() < min(head.pending_tokens, self.prefill_budget):
            self.waiting.popleft()
            self._release_match(head)
            self._finish(head, error=KVCacheTooSmallError(
                f"request {head.rid} needs {head.pending_tokens} KV slots but only {self._available()} can be freed; "
                "raise kv_cache_tokens"))

    # ---- KV bookkeeping ---------------------------------------------------------------------
    def _available(self) -> int:
        return self.allocator.num_free + self.tree.evictable_size()

    def _alloc(self, req: Req, n: int) -> torch.Tensor | None:
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        return self._alloc_slots(int(req.slots[-1]) if req.kv_len else None, req.kv_len, n)

    def _alloc_slots(self, last_slot: int | None, cur_len: int, n: int) -> torch.Tensor | None:
        """`n` slots continuing a sequence of `cur_len` tokens, evicting from the tree if needed."""
        slots = self.allocator.alloc_extend(last_slot, cur_len, n)
        if slots is None:
            need = self.allocator.pages_needed(cur_len, n) * self.page_size
            self.tree.evict(max(need - self.allocator.num_free, 0))
            slots = self.allocator.alloc_extend(last_slot, cur_len, n)
        return slots

    def _match(self, req: Req) -> None:
        """Match the request's tokens against the tree (then the disk tier) and lock the matched path."""
        tokens = req.fill_ids[:req.max_prefix_len]
        m = self.tree.match_prefix(tokens)
        if self.disk is not None:
            m = self.disk.extend_match(tokens, m)
        self.tree.inc_lock_ref(m.last_node)
        req.last_node = m.last_node
        req.slots = m.slots.to(torch.int64)
        req.kv_len = req.cached_len = len(m.slots)
        if not req.admitted_once:
            req.meta.cached_tokens = min(req.cached_len, len(req.prompt_ids))

    def _release_match(self, req: Req) -> None:
        if req.last_node is not None and req.kv_len == req.cached_len:
            self.tree.dec_lock_ref(req.last_node)
            req.last_node = None
            req.slots = torch.empty(0, dtype=torch.int64)
            req.kv_len = req.cached_len = 0

    def _cache_req(self, req: Req, finished: bool) -> None:
        """Hand the request's computed KV to the tree (RadixCache.cache_finished / cache_unfinished
        say which slots are freed, inserted or kept)."""
        tokens = req.fill_ids[:req.kv_len]
        if self.disk is not None:
            self.disk.on_cached(tokens, req.slots)
        if finished:
            self.tree.cache_finished(tokens, req.slots, req.cached_len, req.last_node)
            req.last_node = None
            req.slots = torch.empty(0, dtype=torch.int64)
            req.kv_len = req.cached_len = 0
            return
        kv = self.tree.cache_unfinished(tokens, req.slots, req.cached_len, req.last_node)
        req.slots, req.cached_len, req.last_node = kv.slots.to(torch.int64), kv.prefix_len, kv.last_node

    def _retract(self, req: Req) -> None:
        """Preempt under memory pressure: keep its computed KV in the tree, requeue it first."""
        self.running.remove(req)
        self._cache_req(req, finished=True)
        self.waiting.appendleft(req)
        self.stats.retractions += 1

    # ---- forward ------------------------------------------------------------------------------
    def _build_forward(self, batch: _Batch) -> ForwardInput:
        input_ids: list[int] = []
        positions: list[int] = []
        kv_parts: list[torch.Tensor] = []
        logits_indices: list[int] = []
        offset = 0
        for req, slots, n in zip(batch.reqs, batch.new_slots, batch.extend_lens):
            start = req.kv_len
            input_ids.extend(req.fill_ids[start:start + n])
            positions.extend(range(start, start + n))
            kv_parts.append(req.slots[:start])
            kv_parts.append(slots)
            rows = self._logit_positions(req, start, n)
            batch.logit_rows.append(len(rows))
            logits_indices.extend(offset + (p - start) for p in rows)
            offset += n
        return ForwardInput(input_ids=input_ids, positions=positions, prefix_lens=[r.kv_len for r in batch.reqs],
                            extend_lens=batch.extend_lens, kv_indices=torch.cat(kv_parts),
                            out_slots=torch.cat(batch.new_slots), logits_indices=logits_indices)

    @staticmethod
    def _logit_positions(req: Req, start: int, n: int) -> list[int]:
        """Sequence positions whose logits this request needs from this forward."""
        rows: list[int] = []
        if req.input_logprob_start is not None:
            lo = max(start, req.input_logprob_start - 1)
            hi = min(start + n, len(req.prompt_ids) - 1)
            rows.extend(range(lo, hi))
        if start + n == req.seq_len and (req.remaining_new_tokens > 0 or req.return_next_logits):
            rows.append(start + n - 1)
        return rows

    def _process_results(self, batch: _Batch, logits: torch.Tensor) -> None:
        to_sample: list[tuple[Req, int]] = []
        row = 0
        for req, slots, n, count in zip(batch.reqs, batch.new_slots, batch.extend_lens, batch.logit_rows):
            start = req.kv_len
            req.slots = torch.cat([req.slots, slots])
            req.kv_len += n
            at_end = start + n == req.seq_len
            wants_sample = at_end and req.remaining_new_tokens > 0
            n_input = count - (1 if wants_sample or (at_end and req.return_next_logits) else 0)
            if n_input:
                try:
                    self._record_input_logprobs(req, logits[row:row + n_input], start)
                except Exception as exc:  # noqa: BLE001 - fails this request only
                    req.error = exc
            row += n_input
            if at_end and req.return_next_logits:
                req.next_logits = logits[row].clone()
            if wants_sample:
                to_sample.append((req, row))
            if wants_sample or (at_end and req.return_next_logits):
                row += 1
            if not req.admitted_once:
                req.admitted_once = True
                self.stats.prompt_tokens += len(req.prompt_ids)
                self.stats.cached_tokens += req.meta.cached_tokens
                req.meta.queue_time_s = time.perf_counter() - req.submit_time
            finishing = at_end and req.remaining_new_tokens == 0  # max_new_tokens reached (or 0)
            if n > 1 and not finishing and req.kv_len - req.cached_len >= self.page_size:
                # after a prefill (chunk) the prompt goes into the tree at once, so requests that
                # share it, waiting or yet to come, reuse it while this one is still decoding
                self._cache_req(req, finished=False)
            if finishing and not req.finished:
                req.finish_reason = "length"
        if to_sample:
            self._sample(to_sample, logits)
        for req in list(batch.reqs):
            if req.error is not None:
                self._finish(req, error=req.error)
            elif req.finished:
                self._finish(req)
            elif req.output_ids and req.handle.stream:
                try:
                    chunk = req.take_stream_chunk()
                except Exception as exc:  # noqa: BLE001 - fails this request only
                    self._finish(req, error=exc)
                    continue
                if chunk is not None:
                    req.handle.push_chunk(chunk)

    def _record_input_logprobs(self, req: Req, rows: torch.Tensor, start: int) -> None:
        first = max(start, req.input_logprob_start - 1)  # type: ignore[operator]
        targets = req.prompt_ids[first + 1:first + 1 + rows.shape[0]]
        lp = torch.log_softmax(rows.float(), dim=-1)
        req.input_logprobs.extend(lp.gather(1, torch.tensor(targets, device=lp.device)[:, None]).squeeze(1).tolist())

    def _sample(self, items: list[tuple[Req, int]], logits: torch.Tensor) -> None:
        """Sample the batch's rows together; if that raises, once more row by row from the same
        logits and generator states, so only the request whose row fails fails (`req.error`), and
        the others get exactly the tokens the batched call would have given them."""
        reqs = [r for r, _ in items]
        rows_idx = [i for _, i in items]
        raw = logits if rows_idx == list(range(logits.shape[0])) else logits[torch.tensor(rows_idx, device=logits.device)]
        states = {i: r.generator.get_state() for i, r in enumerate(reqs) if r.generator is not None}
        try:
            picked = self._sample_rows(reqs, raw)
        except Exception as exc:  # noqa: BLE001 - isolate the faulty request below
            logger.warning("batched sampling failed (%s: %s); sampling its %d rows one by one",
                           type(exc).__name__, exc, len(reqs))
            picked = []
            for i, req in enumerate(reqs):
                if i in states:
                    req.generator.set_state(states[i])
                try:
                    picked.extend(self._sample_rows([req], raw[i:i + 1]))
                except Exception as row_exc:  # noqa: BLE001 - this request's fault only
                    req.error = row_exc
                    picked.append((None, None))
        now = time.perf_counter()
        for req, (tok, lp) in zip(reqs, picked):
            if tok is not None:
                self._take_token(req, tok, lp, now)
        self.stats.generated_tokens += sum(tok is not None for tok, _ in picked)

    def _sample_rows(self, reqs: list[Req], raw: torch.Tensor) -> list[tuple[int, TokenLogprob | None]]:
        """(token, logprob entry) per row of `raw`, which is left unchanged."""
        short = {i: r.stop_token_ids for i, r in enumerate(reqs) if r.below_min_tokens}
        biased = {i: r.params.logit_bias for i, r in enumerate(reqs) if r.params.logit_bias}
        modifies = short or biased or any(r.constraint is not None or r.params.has_penalties for r in reqs)
        work = raw.clone() if modifies else raw
        add_logit_bias(work, biased)
        suppress_tokens(work, short)
        if any(r.constraint is not None for r in reqs):
            from . import constrained

            constrained.mask_logits(work, [r.constraint for r in reqs])
        tokens = sample(work, [SamplerRow(r.params, r.output_ids, r.prompt_ids, r.generator) for r in reqs])
        lps: list[TokenLogprob | None] = [None] * len(reqs)
        if any(r.params.logprobs for r in reqs):
            lps = token_logprobs(raw, tokens, [r.params.top_logprobs for r in reqs])
        return list(zip(tokens, lps))

    def _take_token(self, req: Req, tok: int, lp: TokenLogprob | None, now: float) -> None:
        """Append a sampled token and run what follows it (grammar, detokenizing, stop checks); an
        error in any of them fails this request only."""
        if not req.output_ids:
            req.meta.first_token_time_s = now - req.submit_time
        req.meta.decode_steps += 1
        try:
            if req.params.logprobs:
                req.output_logprobs.append(lp)
            req.append_token(tok)
            if req.constraint is not None:
                from . import constrained

                constrained.advance(req, tok, jump_forward=self.enable_jump_forward)
            self._detokenize(req)
        except Exception as exc:  # noqa: BLE001 - a grammar, tokenizer or stop-check error
            req.error = exc

    def _detokenize(self, req: Req) -> None:
        req.detokenize(lambda ids: self.decode(ids, req.params.skip_special_tokens))

    # ---- finishing ----------------------------------------------------------------------------
    def _finish(self, req: Req, error: BaseException | None = None) -> None:
        if req in self.running:
            self.running.remove(req)
            self._cache_req(req, finished=True)
        elif req in self.waiting:
            self.waiting.remove(req)
            if req.last_node is not None:
                self._cache_req(req, finished=True)
        if error is not None:
            req.handle.fail(error)
            return
        self.stats.finished_requests += 1
        if req.finish_reason == "abort":
            req.handle.fail(RequestAbortedError(f"request {req.rid} was aborted"))
            return
        try:
            chunk = req.take_stream_chunk() if req.handle.stream else None
            output = req.build_output()
        except Exception as exc:  # noqa: BLE001 - its slots are already released above
            req.handle.fail(exc)
            return
        if chunk is not None:
            req.handle.push_chunk(chunk)
        req.handle.finish(output)

    # ---- maintenance (run on the scheduler thread via call()) -------------------------------
    def flush_cache(self) -> bool:
        if self.running or self.waiting:
            return False
        self.tree.reset()
        return True


_live_schedulers: "weakref.WeakSet[Scheduler]" = weakref.WeakSet()


@atexit.register
def _stop_schedulers_at_exit() -> None:
    """Stop every scheduler thread before the interpreter finalizes. A daemon thread still inside
    a torch op then would be torn down mid-call and abort the process ("terminate called without
    an active exception"); engines nobody shut down (e.g. get_engine()'s shared one) need this."""
    for scheduler in list(_live_schedulers):
        scheduler.shutdown()

