"""Prometheus metrics of the server: request counts, token throughput, queue length, cache and KV usage.

Each app gets its own `CollectorRegistry` so that several servers in one process (tests, data
parallel replicas) never collide on the global registry. Cache and KV numbers are read from
`engine.cache_stats()` at scrape time, so they are never stale.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import MissingDependencyError

try:
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
    from prometheus_client.core import GaugeMetricFamily
except ImportError as exc:  # pragma: no cover - the server extra installs it
    raise MissingDependencyError.for_extra("prometheus-client", "server") from exc

PREFIX = "radix_backend"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class _Throughput:
    """Generated tokens per second over a sliding window (what a dashboard shows as 'tokens/s')."""

    window_s: float = 10.0
    _events: deque = field(default_factory=deque)  # (timestamp, tokens)

    def add(self, tokens: int, now: float | None = None) -> None:
        self._events.append((time.monotonic() if now is None else now, tokens))

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()
        return sum(t for _, t in self._events) / self.window_s


class RequestTracker:
    """Lifecycle of one request for the metrics: queued until its first token, then running."""

    def __init__(self, metrics: "ServerMetrics", endpoint: str) -> None:
        self._m = metrics
        self.endpoint = endpoint
        self.start = time.monotonic()
        self._first = False
        self._done = False
        with metrics._lock:
            metrics._waiting += 1

    def first_token(self) -> None:
        if self._first or self._done:
            return
        self._first = True
        self._m.ttft.labels(self.endpoint).observe(time.monotonic() - self.start)
        with self._m._lock:
            self._m._waiting -= 1
            self._m._running += 1

    def tokens(self, n: int) -> None:
        """Count `n` generated tokens as they are produced (streaming keeps tokens/s live)."""
        if n > 0:
            self.first_token()
            self._m.generation_tokens.inc(n)
            with self._m._lock:
                self._m._throughput.add(n)

    def finish(self, prompt_tokens: int = 0, cached_tokens: int = 0) -> None:
        if self._done:
            return
        with self._m._lock:
            if self._first:
                self._m._running -= 1
            else:
                self._m._waiting -= 1
        self._done = True
        self._m.prompt_tokens.inc(prompt_tokens)
        self._m.cached_tokens.inc(cached_tokens)
        self._m.latency.labels(self.endpoint).observe(time.monotonic() - self.start)


class ServerMetrics:
    """All metrics of one server; `render()` gives the Prometheus text exposition."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._waiting = 0
        self._running = 0
        self._throughput = _Throughput()
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens processed", registry=r)
        self.cached_tokens = Counter(f"{PREFIX}_cached_prompt_tokens", "Prompt tokens served from the radix cache", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Generated tokens", registry=r)
        self.latency = Histogram(f"{PREFIX}_request_latency_seconds", "End-to-end request latency", ["endpoint"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time to first generated token", ["endpoint"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_LiveCollector(self))

    def track(self, endpoint: str) -> RequestTracker:
        return RequestTracker(self, endpoint)

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def snapshot(self) -> dict[str, float]:
        """Live values (also what the gauges export): queue, running, tokens/s."""
        with self._lock:
            return {"num_requests_waiting": float(self._waiting), "num_requests_running": float(self._running),
                    "generation_tokens_per_second": self._throughput.rate()}

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LiveCollector:
    """Gauges computed at scrape time from the server's counters and `engine.cache_stats()`."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics

    def describe(self) -> list:
        return []  # values are only known at collect time; avoid registry-time collection

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, value in self.m.snapshot().items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", name.replace("_", " "), value=value)
        try:
            stats = self.m.engine.cache_stats()
        except Exception:  # a scrape must never fail because the engine is busy shutting down
            return
        total = max(1, int(stats.slots_total))
        gauges = {
            "cache_hit_rate": ("Radix cache hit rate over all prompt tokens seen", stats.hit_rate),
            "cache_prompt_tokens": ("Prompt tokens seen by the scheduler", stats.prompt_tokens),
            "cache_cached_tokens": ("Prompt tokens served from the radix cache", stats.cached_tokens),
            "cache_nodes": ("Radix tree nodes", stats.nodes),
            "cache_evicted_tokens": ("Tokens evicted from the radix cache", stats.evictions),
            "kv_slots_total": ("KV cache slots", stats.slots_total),
            "kv_slots_used": ("KV slots held by requests or the radix tree", stats.slots_used),
            "kv_slots_cached": ("KV slots owned by the radix tree", stats.cached_slots),
            "kv_usage": ("Fraction of KV slots in use", stats.slots_used / total),
            "cache_disk_hit_tokens": ("Prompt tokens whose KV was loaded from the disk tier", stats.disk_hit_tokens),
            "cache_disk_bytes_read": ("Bytes read from the disk KV tier", stats.disk_bytes_read),
            "cache_disk_bytes_written": ("Bytes written to the disk KV tier", stats.disk_bytes_written),
            "cache_disk_load_seconds": ("Time spent loading KV from the disk tier", stats.disk_load_s),
            "spec_draft_tokens": ("Speculative draft tokens verified", stats.spec_draft_tokens),
            "spec_accepted_tokens": ("Speculative draft tokens accepted", stats.spec_accepted_tokens),
            "spec_acceptance_rate": ("Accepted share of the speculative draft tokens", stats.spec_acceptance_rate),
            "spec_tokens_per_step": ("Tokens per decode step of a request that verified a draft",
                                     stats.spec_tokens_per_step),
            # the scheduler's own view (the server's view is num_requests_*)
            "queue_length": ("Requests waiting in the scheduler queue", stats.waiting_requests),
            "running_requests": ("Requests in the running batch", stats.running_requests),
        }
        for key, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"{PREFIX}_{key}", doc, value=float(value))
