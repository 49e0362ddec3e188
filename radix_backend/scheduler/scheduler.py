"""Scheduler: one background thread that owns the KV (through `KVManager`) and every request.

Each step it (1) takes new requests and aborts from its inbox, (2) keeps every running request
decoding, evicting cached leaves or retracting a request when KV runs short, (3) admits waiting
requests in cache-aware order (`lpm`: longest cached prefix first) within a prefill token budget,
chunking a long prompt, and (4) runs one mixed forward (prefill chunks + decode tokens), samples,
and hands each request its token. Finished requests' tokens go into the radix tree so later calls
reuse them.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import asdict

import torch

from ..config import EngineConfig
from ..errors import EngineShutdownError, KVCacheTooSmallError, RequestAbortedError
from ..mem_cache.kv_manager import KVManager
from ..model_executor.model_runner import ModelRunner
from ..outputs import CacheStats, SchedulerStats
from .admission import PrefillAdder, StepBudget, needs_match_to_order, order_waiting
from .inbox import Inbox
from .output_processor import Detokenize, OutputProcessor
from .request import Req
from .schedule_batch import ScheduleBatch
from .speculative import (
    DRAFT_KINDS,
    GPU_STEP_COST,
    Draft,
    DraftStats,
    cpu_step_cost,
    drafts_may_pay,
    pick_draft,
    plan_drafts,
)

logger = logging.getLogger(__name__)

class Scheduler:
    def __init__(self, runner: ModelRunner, config: EngineConfig, *, detokenize: Detokenize) -> None:
        self.runner = runner
        self.page_size = config.page_size
        self.policy = config.schedule_policy
        self.max_running = config.max_running_requests
        self.prefill_budget = config.chunked_prefill_tokens
        self.enable_jump_forward = config.enable_jump_forward
        self.speculative = runner.kernel_path.batch_invariant if config.speculative is None else config.speculative
        self.max_draft = config.speculative_max_draft
        self.step_cost = cpu_step_cost(runner.matmul_tile_rows) if runner.device.type == "cpu" else GPU_STEP_COST
        self.draft_stats = DraftStats()
        self.kv = KVManager.for_runner(runner, config)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.stats = SchedulerStats()
        self.output = OutputProcessor(self.kv, self.stats, detokenize, jump_forward=self.enable_jump_forward,
                                      draft_stats=self.draft_stats)
        self._inbox = Inbox()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="radix-scheduler", daemon=True)
        self._thread.start()
        _live_schedulers.add(self)

    # ---- thread-safe entry points ---------------------------------------------------------
    def submit(self, req: Req) -> None:
        self.submit_all([req])

    def submit_all(self, reqs: list[Req]) -> None:
        """Queue requests as one arrival: the scheduler sees all of them in the same step, so a
        batch's first forward is not spent on whichever request happened to be posted first."""
        if self._stop.is_set():
            raise EngineShutdownError("the engine is shut down; create a new Engine")
        for req in reqs:
            if req.constraint is not None and self.enable_jump_forward:
                from . import constrained  # imported by the engine already when a request has a constraint

                constrained.append_forced_tokens(req)  # tokens the grammar forces up front join the prompt's prefill
                self.output.detokenize(req)
        self._inbox.post("add", reqs)

    def set_speculative(self, enabled: bool) -> bool:
        """Turn speculative decoding on or off between steps (benchmarks and tests compare the two);
        returns the previous setting."""
        def swap() -> bool:
            previous, self.speculative = self.speculative, enabled
            return previous

        return self.call(swap)

    def abort(self, rid: str) -> None:
        self._inbox.post("abort", rid)

    def call(self, fn: Callable[[], object], timeout: float = 60.0) -> object:
        """Run fn on the scheduler thread between steps (e.g. flush_cache, cache_stats)."""
        return self._inbox.call(fn, timeout)

    @property
    def is_stopped(self) -> bool:
        return self._stop.is_set()

    def shutdown(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._inbox.post("wake")
        self._thread.join(timeout=30)
        self.kv.close()

    # ---- loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            idle = not self.waiting and not self.running
            try:
                self._drain_inbox(block=idle)  # an abort releases KV too
                if self._stop.is_set():
                    break
                with torch.inference_mode():  # logits are inference tensors; sampling edits them in place
                    self._step()
            except Exception as exc:  # a bug or a device error: fail the batch, keep serving
                logger.exception("scheduler step failed")
                self._fail_all(exc)
        self._fail_all(EngineShutdownError("the engine was shut down before this request finished"))
        self._drain_inbox(block=False, shutting_down=True)

    def _fail_all(self, error: BaseException) -> None:
        """Fail every queued request with `error`; one whose KV cannot be released is failed all the same."""
        for req in list(self.running) + list(self.waiting):
            try:
                self._finish(req, error=error)
            except Exception:  # noqa: BLE001 - _finish has failed its handle; the others still need theirs
                logger.exception("releasing a failed request's KV failed")

    def _drain_inbox(self, block: bool, shutting_down: bool = False) -> None:
        def add(req: Req) -> None:
            if shutting_down:
                req.handle.fail(EngineShutdownError("the engine was shut down"))
            else:
                self.waiting.append(req)

        self._inbox.drain(block=block, on_add=add, on_abort=self._abort)

    def _abort(self, rid: str) -> None:
        for req in list(self.waiting) + self.running:
            if req.rid == rid:
                req.finish_reason = "abort"
                self._finish(req)
                return

    # ---- one step ---------------------------------------------------------------------------
    def _step(self) -> None:
        batch = ScheduleBatch()
        budget = StepBudget(self.prefill_budget, self.page_size)
        self._schedule_running(batch, budget)
        self._schedule_waiting(batch, budget)
        if self.speculative:
            self._add_drafts(batch)
        if not batch.reqs:
            if self.waiting and not self.running:
                self._fail_unschedulable()
            return
        try:
            logits = self.runner.forward(batch.forward_input())
        except Exception as exc:
            logger.exception("forward failed; failing its %d requests", len(batch.reqs))
            for req, slots in zip(batch.reqs, batch.new_slots):
                self.kv.free(slots)
                self._finish(req, error=exc)
            return
        self.stats.forward_steps += 1
        self.output.process(batch, logits)
        self._deliver(batch.reqs)

    def _schedule_running(self, batch: ScheduleBatch, budget: StepBudget) -> None:
        """Every running request computes its pending tokens (1 when decoding; the next chunk
        when its prompt is still being prefilled); retract others when KV runs out."""
        running = sorted(self.running, key=lambda r: r.submit_time)
        if running and all(req.pending_tokens == 1 for req in running):
            slots = self.kv.alloc_decode(len(running))  # a plain decode step, the pool not short
            if slots is not None:
                for req, one in zip(running, slots):
                    batch.add(req, one, 1)
                return
        for req in running:
            if req not in self.running:
                continue  # retracted while making room for an earlier one
            n = req.pending_tokens
            if n > 1:  # still prefilling a chunked prompt (or forced tokens): within the budget
                n = budget.chunk_len(n)
                if n <= 0:
                    continue
            slots = self.kv.alloc(req.kv, n)
            while slots is None:
                victim = max((r for r in self.running if r is not req and r not in batch.reqs),
                             key=lambda r: r.submit_time, default=None)
                if victim is None:
                    break
                self._retract(victim)
                slots = self.kv.alloc(req.kv, n)
            if slots is None:
                self._retract(req)
                continue
            if n > 1:
                budget.spend(n)
            batch.add(req, slots, n)

    def _schedule_waiting(self, batch: ScheduleBatch, budget: StepBudget) -> None:
        if needs_match_to_order(self.policy, len(self.waiting)):
            # The order reads the tree only: loading every waiting request's disk blocks would fill
            # the pool with locked prefixes, admit nobody and, once the step evicted them, load them
            # all again (a livelock). A request's blocks are loaded when it is about to be admitted.
            for req in self.waiting:
                if req.kv.last_node is None:
                    self._match(req, from_disk=False)
        self.waiting = deque(order_waiting(self.waiting, self.policy))
        adder = PrefillAdder(budget, self.running, self.max_running)
        for req in list(self.waiting):
            if not adder.has_room():
                break
            self._match(req)
            if adder.should_defer(req):
                continue
            n = adder.admissible_len(req, self.kv.available())
            slots = self.kv.alloc(req.kv, n) if n else None
            if slots is None:
                break
            adder.admit(req, n)
            batch.add(req, slots, n)
        for req in adder.admitted:
            self.waiting.remove(req)
            self.running.append(req)
        for req in self.waiting:  # unlock matches of requests that stay waiting; re-match next step
            self.kv.release_match(req.kv)

    def _add_drafts(self, batch: ScheduleBatch) -> None:
        """Speculative decoding (see speculative.py): decoding requests with a draft from their own
        context or the radix tree verify as many of its tokens as the cost model pays for, in spare
        KV slots only."""
        capped = [(i, cap) for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens))
                  if (cap := self._draft_cap(req, n)) > 0]
        rows, tokens = sum(batch.extend_lens), max(1, batch.extend_lens.count(1))
        priors = {kind: self.draft_stats.rate(kind) for kind in DRAFT_KINDS}
        best = [batch.reqs[i].spec.best_rate(priors) for i, _ in capped]
        if not capped or not drafts_may_pay(best, [cap for _, cap in capped], rows, tokens, self.step_cost):
            return
        found: list[tuple[int, Draft]] = []
        for i, cap in capped:
            req = batch.reqs[i]
            ids = req.fill_ids
            draft = pick_draft([req.spec.context.propose(ids, cap), Draft(self.kv.continuation(ids, cap), "tree")],
                               lambda kind: req.spec.rate(kind, self.draft_stats))
            if draft is not None:
                found.append((i, draft))
        if not found:
            return
        rates = [batch.reqs[i].spec.rate(d.kind, self.draft_stats) for i, d in found]
        sizes = plan_drafts(rates, [len(d.tokens) for _, d in found], rows=rows, tokens=tokens, cost=self.step_cost)
        for (i, draft), k in zip(found, sizes):
            req = batch.reqs[i]
            if k == 0:
                req.spec.idle(draft.kind, self.draft_stats)
                continue
            draft.tokens = draft.tokens[:k]
            slots = self.kv.alloc_spare(int(batch.new_slots[i][-1]), req.kv.kv_len + 1, k)
            if slots is None:
                return
            batch.add_draft(i, draft, slots)

    def _draft_cap(self, req: Req, n: int) -> int:
        """How many draft tokens `req` may verify after its next token (0: it is not decoding one
        token, or scores its prompt, or returns logits)."""
        if n != 1 or req.pending_tokens != 1 or req.input_logprob_start is not None or req.return_next_logits:
            return 0
        return min(self.max_draft, req.remaining_new_tokens - 1, req.max_total_tokens - req.seq_len - 1)

    def _fail_unschedulable(self) -> None:
        """Nothing runs and the head request cannot get KV even with an empty tree: fail it."""
        head = self.waiting[0]
        self.kv.evict_all()
        if self.kv.available() < min(head.pending_tokens, self.prefill_budget):
            self.waiting.popleft()
            self.kv.release_match(head.kv)
            self._finish(head, error=KVCacheTooSmallError(
                f"request {head.rid} needs {head.pending_tokens} KV slots but only {self.kv.available()} can be "
                "freed; raise kv_cache_tokens"))

    def _match(self, req: Req, *, from_disk: bool = True) -> None:
        """Match an unmatched request; with `from_disk`, extend a tree-only match from the disk tier."""
        tokens = req.fill_ids[:req.max_prefix_len]
        if req.kv.last_node is None:
            self.kv.match(req.kv, tokens, from_disk=from_disk)
        elif from_disk:
            self.kv.match_with_disk(req.kv, tokens)
        if not req.admitted_once:
            req.meta.cached_tokens = min(req.kv.cached_len, len(req.prompt_ids))

    def _retract(self, req: Req) -> None:
        """Preempt under memory pressure: keep its computed KV in the tree, requeue it first."""
        self.running.remove(req)
        self.kv.cache(req.kv, req.computed_ids, finished=True)
        self.waiting.appendleft(req)
        self.stats.retractions += 1

    # ---- after the forward --------------------------------------------------------------------
    def _deliver(self, reqs: list[Req]) -> None:
        """Finish the requests that are done (or failed); stream new text of the others."""
        for req in reqs:
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

    # ---- finishing ----------------------------------------------------------------------------
    def _finish(self, req: Req, error: BaseException | None = None) -> None:
        try:
            if req in self.running:
                self.running.remove(req)
                self.kv.cache(req.kv, req.computed_ids, finished=True)
            elif req in self.waiting:
                self.waiting.remove(req)
                if req.kv.last_node is not None:
                    self.kv.cache(req.kv, req.computed_ids, finished=True)
        except Exception as exc:  # a KV accounting fault: the request, no longer queued, still gets an answer
            req.handle.fail(error or exc)
            raise
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

    # ---- run on the scheduler thread via call() -----------------------------------------------
    def flush_cache(self) -> bool:
        if self.running or self.waiting:
            return False
        self.kv.reset()
        return True

    def cache_stats(self) -> CacheStats:
        s = self.stats
        disk = self.kv.disk.store.stats if self.kv.disk is not None else None
        return CacheStats(
            **asdict(s), **asdict(self.kv.usage()),
            hit_rate=s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
            spec_acceptance_rate=s.spec_accepted_tokens / s.spec_draft_tokens if s.spec_draft_tokens else 0.0,
            spec_tokens_per_step=1 + s.spec_accepted_tokens / s.spec_verified_steps if s.spec_verified_steps else 0.0,
            running_requests=len(self.running), waiting_requests=len(self.waiting),
            **({} if disk is None else dict(disk_hit_tokens=disk.hit_tokens, disk_bytes_read=disk.bytes_read,
                                            disk_bytes_written=disk.bytes_written, disk_load_s=disk.load_s)))


_live_schedulers: "weakref.WeakSet[Scheduler]" = weakref.WeakSet()


@atexit.register
def _stop_schedulers_at_exit() -> None:
    """Stop every scheduler thread before the interpreter finalizes. A daemon thread still inside
    a torch op then would be torn down mid-call and abort the process ("terminate called without
    an active exception"); engines nobody shut down (e.g. get_engine()'s shared one) need this."""
    for scheduler in list(_live_schedulers):
        scheduler.shutdown()
