"""GET /metrics through `prometheus-client`, in one `CollectorRegistry` per server (several servers
in one process stay apart).

Counters only grow and histograms are observed once per request (Prometheus' `rate()` needs
both): HTTP answers are counted by the app's middleware, and each choice's times are observed from
its events (`RequestTiming`, on the scheduler's thread). The scheduler's totals (its own monotonic
counters) and the current figures (queue, KV cache, prefix cache, each node's ms per token) are
read at scrape time by `_Live`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from potluck.api.pool import PoolInfo
from potluck.engine.scheduler import Event, Finished, Scheduler, TokenEvent

# seconds; a prompt over a pool of home machines can take tens of seconds
TTFT_BUCKETS_S = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# seconds per token: ~5 ms for a small model on one machine, ~1 s for a large one over Wi-Fi
TPOT_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class RequestTiming:
    """One choice's times, fed its events on the scheduler's thread: the time to its first token
    once at that token, the mean time per later token once at its end (two tokens or more)."""

    def __init__(self, ttft: Histogram, tpot: Histogram) -> None:
        self.ttft, self.tpot = ttft, tpot
        self.t_submit = time.monotonic()
        self.t_first = self.t_last = 0.0
        self.n = 0

    def see(self, ev: Event) -> None:
        if isinstance(ev, TokenEvent):
            now = time.monotonic()
            if self.n == 0:
                self.t_first = now
                self.ttft.observe(now - self.t_submit)
            self.t_last, self.n = now, self.n + 1
        elif isinstance(ev, Finished) and self.n >= 2:
            self.tpot.observe((self.t_last - self.t_first) / (self.n - 1))


class _Live(Collector):
    """The scheduler's totals and the pool's current figures, read at each scrape."""

    def __init__(self, scheduler: Scheduler, pool: PoolInfo) -> None:
        self.scheduler, self.pool = scheduler, pool

    def collect(self) -> Iterator[Metric]:
        sched, st = self.scheduler, self.scheduler.stats
        # (a CounterMetricFamily's name drops "_total"; its sample keeps it)
        yield _counter(
            "potluck_requests_total",
            "Generation requests (one per choice) accepted by the scheduler.",
            st.requests_total,
        )
        yield _counter(
            "potluck_requests_rejected_total",
            "Generation requests refused because the queue was full (HTTP 429).",
            st.requests_rejected,
        )
        finished = CounterMetricFamily(
            "potluck_requests_finished_total",
            "Generation requests finished, by reason (stop, length, cancelled).",
            labels=["reason"],
        )
        for reason, n in sorted(dict(st.requests_finished).items()):
            finished.add_metric([reason], n)
        yield finished
        yield _counter(
            "potluck_prompt_tokens_total", "Prompt tokens of finished requests.", st.prompt_tokens
        )
        yield _counter("potluck_generated_tokens_total", "Tokens generated.", st.generated_tokens)
        yield _counter(
            "potluck_prefix_cache_hits_total",
            "Generation requests that reused a cached prompt prefix.",
            st.prefix_hits,
        )
        yield _counter(
            "potluck_prefix_cache_misses_total",
            "Generation requests that found no cached prompt prefix to reuse.",
            st.prefix_misses,
        )
        yield _counter(
            "potluck_prefix_cached_tokens_total",
            "Prompt tokens reused from the prefix cache instead of computed.",
            st.cached_tokens,
        )
        yield _gauge(
            "potluck_prefix_cache_entries",
            "Finished sequences the prefix cache holds.",
            st.prefix_entries,
        )
        yield _gauge(
            "potluck_prefix_cache_bytes",
            "Bytes of KV cache the prefix cache holds, over every stage.",
            st.prefix_bytes,
        )
        yield _counter(
            "potluck_spec_draft_steps_total",
            "Decode steps that carried drafted tokens (speculative decoding).",
            st.draft_steps,
        )
        yield _counter(
            "potluck_spec_drafted_tokens_total", "Tokens drafted for checking.", st.drafted
        )
        yield _counter(
            "potluck_spec_kept_tokens_total",
            "Drafted tokens the model agreed with (kept: each saved a step).",
            st.draft_kept,
        )
        yield _gauge(
            "potluck_tokens_per_second",
            "Tokens generated per second over the last 5 s, all requests together.",
            st.tokens_per_s(),
        )
        yield _gauge("potluck_requests_active", "Requests generating now.", sched.active)
        yield _gauge("potluck_queue_depth", "Requests waiting for a slot.", sched.queued)
        stages = self.pool.model.pipeline.stages
        yield _gauge(
            "potluck_kv_cache_sequences",
            "Sequences holding a KV cache on this machine's stages (0 when idle: nothing leaked).",
            max((len(s.caches) for s in stages), default=0),
        )
        yield _gauge(
            "potluck_kv_cache_bytes",
            "Bytes of KV cache held on this machine's stages.",
            sum(c.nbytes() for s in stages for c in list(s.caches.values())),
        )
        yield from self._nodes()

    def _nodes(self) -> Iterator[Metric]:
        nodes = self.pool.snapshot()["nodes"]
        per_node = ["node", "name"]
        compute = GaugeMetricFamily(
            "potluck_node_compute_ms_per_token",
            "Recent compute milliseconds per decode step, per node (one token for every sequence "
            "in the step).",
            labels=per_node,
        )
        network = GaugeMetricFamily(
            "potluck_node_network_ms_per_token",
            "Recent network milliseconds per decode step on the hop into each remote node.",
            labels=per_node,
        )
        memory = GaugeMetricFamily(
            "potluck_node_memory_used_bytes",
            "Bytes each node holds for the model (weights + KV cache).",
            labels=per_node,
        )
        for n in nodes:
            key = [n["address"], n["name"]]
            if n["compute_ms"] is not None:
                compute.add_metric(key, n["compute_ms"])
            if n["hop_ms"] is not None:
                network.add_metric(key, n["hop_ms"])
            memory.add_metric(key, n["memory_used_bytes"])
        yield from (compute, network, memory)


def _counter(name: str, help_: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, help_, value=value)


def _gauge(name: str, help_: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_, value=value)


class Metrics:
    """One server's metrics: its own registry, the instruments the app updates, and `_Live`."""

    def __init__(self, scheduler: Scheduler, pool: PoolInfo) -> None:
        self.registry = CollectorRegistry()
        self.http = Counter(
            "potluck_http_requests",
            "HTTP requests answered, by endpoint and status code.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "potluck_time_to_first_token_seconds",
            "Time from accepting a request (one choice) to its first token.",
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "potluck_time_per_output_token_seconds",
            "Mean time between a request's tokens after its first (requests of two tokens or more).",
            buckets=TPOT_BUCKETS_S,
            registry=self.registry,
        )
        self.registry.register(_Live(scheduler, pool))

    def count(self, endpoint: str, status: int) -> None:
        self.http.labels(endpoint, str(status)).inc()

    def timing(self) -> RequestTiming:
        """A fresh timer for one choice: make it just before submitting the choice."""
        return RequestTiming(self.ttft, self.tpot)

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition (body, Content-Type) that the scrape's Accept header asks for: Prometheus'
        text format, or OpenMetrics."""
        encode, content_type = choose_encoder(accept or "")
        return encode(self.registry), content_type


class StatusCounter:
    """Pure ASGI middleware counting answers by endpoint and status (streaming stays untouched)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path.startswith(("/v1/", "/api/", "/metrics", "/health")) else "static"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count(endpoint, int(message["status"]))
            await send(message)

        await self.app(scope, receive, counting_send)
