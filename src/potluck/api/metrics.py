"""GET /metrics in Prometheus' text exposition format (version 0.0.4), written by hand: a handful
of counters, gauges and one histogram need no client library."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable

from potluck.api.pool import PoolInfo
from potluck.engine.scheduler import Scheduler

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _label(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(pairs: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{_label(v)}"' for k, v in pairs.items()) + "}" if pairs else ""


class HttpCounters:
    """Requests answered, by endpoint and status (updated on the event loop, read on scrape)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by: Counter[tuple[str, int]] = Counter()

    def count(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.by[(endpoint, status)] += 1


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def metric(
        self, name: str, kind: str, help_: str, samples: Iterable[tuple[dict[str, str], float]]
    ) -> None:
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            self.lines.append(f"{name}{_labels(labels)} {value:g}")


def render(scheduler: Scheduler, pool: PoolInfo, http: HttpCounters) -> str:
    st = scheduler.stats
    w = _Writer()
    with http._lock:
        by = dict(http.by)
    w.metric(
        "potluck_http_requests_total",
        "counter",
        "HTTP requests answered, by endpoint and status code.",
        [({"endpoint": e, "status": str(s)}, n) for (e, s), n in sorted(by.items())],
    )
    w.metric(
        "potluck_requests_total",
        "counter",
        "Generation requests (one per choice) accepted by the scheduler.",
        [({}, st.requests_total)],
    )
    w.metric(
        "potluck_requests_rejected_total",
        "counter",
        "Generation requests refused because the queue was full (HTTP 429).",
        [({}, st.requests_rejected)],
    )
    w.metric(
        "potluck_requests_finished_total",
        "counter",
        "Generation requests finished, by reason (stop, length, cancelled).",
        [({"reason": r}, n) for r, n in sorted(dict(st.requests_finished).items())],
    )
    w.metric(
        "potluck_prompt_tokens_total",
        "counter",
        "Prompt tokens of finished requests.",
        [({}, st.prompt_tokens)],
    )
    w.metric(
        "potluck_generated_tokens_total",
        "counter",
        "Tokens generated.",
        [({}, st.generated_tokens)],
    )
    w.metric(
        "potluck_tokens_per_second",
        "gauge",
        "Tokens generated per second over the last 5 s, all requests together.",
        [({}, round(st.tokens_per_s(), 3))],
    )
    w.metric(
        "potluck_requests_active", "gauge", "Requests generating now.", [({}, scheduler.active)]
    )
    w.metric(
        "potluck_queue_depth",
        "gauge",
        "Requests waiting for a slot.",
        [({}, scheduler.queued)],
    )
    stages = pool.model.pipeline.stages
    caches = [c for s in stages for c in list(s.caches.values())]
    w.metric(
        "potluck_kv_cache_sequences",
        "gauge",
        "Sequences holding a KV cache on this machine's stages (0 when idle: nothing leaked).",
        [({}, max((len(s.caches) for s in stages), default=0))],
    )
    w.metric(
        "potluck_kv_cache_bytes",
        "gauge",
        "Bytes of KV cache held on this machine's stages.",
        [({}, sum(c.nbytes() for c in caches))],
    )
    ttft = list(st.ttft_s)
    w.lines.append(
        "# HELP potluck_time_to_first_token_seconds Time from accepting a request to its first "
        "token (the last 1024 requests)."
    )
    w.lines.append("# TYPE potluck_time_to_first_token_seconds histogram")
    for le in TTFT_BUCKETS_S:
        n = sum(1 for t in ttft if t <= le)
        w.lines.append(f'potluck_time_to_first_token_seconds_bucket{{le="{le:g}"}} {n}')
    w.lines.append(f'potluck_time_to_first_token_seconds_bucket{{le="+Inf"}} {len(ttft)}')
    w.lines.append(f"potluck_time_to_first_token_seconds_sum {sum(ttft):g}")
    w.lines.append(f"potluck_time_to_first_token_seconds_count {len(ttft)}")
    nodes = pool.snapshot()["nodes"]
    w.metric(
        "potluck_node_compute_ms_per_token",
        "gauge",
        "Recent compute milliseconds per decode step, per node (one token for every sequence "
        "in the step).",
        [
            ({"node": n["address"], "name": n["name"]}, n["compute_ms"])
            for n in nodes
            if n["compute_ms"] is not None
        ],
    )
    w.metric(
        "potluck_node_network_ms_per_token",
        "gauge",
        "Recent network milliseconds per decode step on the hop into each remote node.",
        [
            ({"node": n["address"], "name": n["name"]}, n["hop_ms"])
            for n in nodes
            if n["hop_ms"] is not None
        ],
    )
    w.metric(
        "potluck_node_memory_used_bytes",
        "gauge",
        "Bytes each node holds for the model (weights + KV cache).",
        [({"node": n["address"], "name": n["name"]}, n["memory_used_bytes"]) for n in nodes],
    )
    return "\n".join(w.lines) + "\n"
