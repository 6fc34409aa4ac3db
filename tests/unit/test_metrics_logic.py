"""GET /metrics' logic without a server: the per-request time histograms on a fake clock, the
scheduler's totals and the pool's figures read at scrape time, separate registries, the
exposition formats, and the middleware that counts answers. (Over HTTP: tests/test_metrics_prom.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from potluck.api import metrics as metrics_mod
from potluck.api.metrics import TPOT_BUCKETS_S, TTFT_BUCKETS_S, Metrics, StatusCounter
from potluck.engine.scheduler import (
    Finished,
    QueueSink,
    Request,
    Scheduler,
    SchedulerConfig,
    Stats,
    TokenEvent,
)
from potluck.sampling import GREEDY

from .fakes import FakeModel, FakePipeline, alone


class Clock:
    """time.monotonic for potluck.api.metrics, moved by hand (seconds)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(metrics_mod, "time", c)  # the module's own `time` only
    return c


class Cache:
    def __init__(self, n: int) -> None:
        self.n = n

    def nbytes(self) -> int:
        return self.n


def pool(stages: list[dict[int, Cache]] = (), nodes: list[dict[str, Any]] = ()) -> Any:
    """What the collector reads of api.pool.PoolInfo: the stages' caches and snapshot()'s nodes."""
    pipeline = SimpleNamespace(stages=[SimpleNamespace(caches=c) for c in stages])
    return SimpleNamespace(
        model=SimpleNamespace(pipeline=pipeline), snapshot=lambda: {"nodes": list(nodes)}
    )


def idle_scheduler(stats: Stats | None = None, active: int = 0, queued: int = 0) -> Any:
    return SimpleNamespace(stats=stats or Stats(), active=active, queued=queued)


@pytest.fixture
def sched() -> Iterator[Scheduler]:
    s = Scheduler(FakeModel(FakePipeline()), SchedulerConfig())
    yield s
    s.close()


def value(m: Metrics, metric: str, /, **labels: str) -> float | None:
    return m.registry.get_sample_value(metric, labels)


TTFT = "potluck_time_to_first_token_seconds"
TPOT = "potluck_time_per_output_token_seconds"


def test_time_to_first_token_and_per_output_token(clock: Clock) -> None:
    """Submitted at 0; tokens at 0.375, 0.5, 0.625 and 0.75 s: one TTFT of 0.375 s, at its end
    one TPOT of (0.75 - 0.375) / 3 = 0.125 s, each in its bucket (binary fractions: exact sums)."""
    m = Metrics(idle_scheduler(), pool())
    timing = m.timing()
    for i, dt in enumerate((0.375, 0.125, 0.125, 0.125)):
        clock.t += dt
        timing.see(TokenEvent(7, i))
        assert value(m, f"{TTFT}_count") == 1  # observed once, at the first token
        assert value(m, f"{TPOT}_count") == 0  # not before the end
    timing.see(Finished("length", 5, 4))
    assert value(m, f"{TTFT}_sum") == 0.375
    assert value(m, f"{TTFT}_bucket", le="0.25") == 0 and value(m, f"{TTFT}_bucket", le="0.5") == 1
    assert value(m, f"{TPOT}_count") == 1 and value(m, f"{TPOT}_sum") == 0.125
    assert value(m, f"{TPOT}_bucket", le="0.1") == 0 and value(m, f"{TPOT}_bucket", le="0.2") == 1
    assert value(m, f"{TTFT}_bucket", le="+Inf") == 1
    assert {0.25, 0.5} <= set(TTFT_BUCKETS_S) and {0.1, 0.2} <= set(TPOT_BUCKETS_S)  # as read


def test_short_requests_observe_no_time_per_token(clock: Clock) -> None:
    m = Metrics(idle_scheduler(), pool())
    one = m.timing()
    clock.t += 2.0
    one.see(TokenEvent(1, 0))
    one.see(Finished("stop", 3, 1))  # one token: no time between tokens
    none = m.timing()
    none.see(Finished("cancelled", 3, 0))  # cancelled before its first token
    assert value(m, f"{TTFT}_count") == 1 and value(m, f"{TTFT}_sum") == pytest.approx(2.0)
    assert value(m, f"{TPOT}_count") == 0


def test_the_schedulers_totals_and_current_figures_are_read_at_scrape() -> None:
    stats = Stats(
        requests_total=7,
        requests_rejected=2,
        requests_finished={"length": 4, "stop": 2},
        prompt_tokens=50,
        generated_tokens=90,
    )
    m = Metrics(idle_scheduler(stats, active=3, queued=1), pool())
    assert value(m, "potluck_requests_total") == 7
    assert value(m, "potluck_requests_rejected_total") == 2
    assert value(m, "potluck_requests_finished_total", reason="length") == 4
    assert value(m, "potluck_requests_finished_total", reason="stop") == 2
    assert value(m, "potluck_prompt_tokens_total") == 50
    assert value(m, "potluck_generated_tokens_total") == 90
    assert value(m, "potluck_requests_active") == 3 and value(m, "potluck_queue_depth") == 1
    stats.requests_total += 1  # read live: the next scrape sees it
    stats.requests_finished["cancelled"] = 1
    assert value(m, "potluck_requests_total") == 8
    assert value(m, "potluck_requests_finished_total", reason="cancelled") == 1


def test_prefix_cache_figures_are_read_at_scrape() -> None:
    """The prefix cache's totals as counters, what it holds now as gauges, each with its HELP
    and TYPE lines in the exposition."""
    stats = Stats(
        prefix_hits=4, prefix_misses=6, cached_tokens=123, prefix_entries=3, prefix_bytes=5 << 20
    )
    m = Metrics(idle_scheduler(stats), pool())
    assert value(m, "potluck_prefix_cache_hits_total") == 4
    assert value(m, "potluck_prefix_cache_misses_total") == 6
    assert value(m, "potluck_prefix_cached_tokens_total") == 123
    assert value(m, "potluck_prefix_cache_entries") == 3
    assert value(m, "potluck_prefix_cache_bytes") == 5 << 20
    stats.prefix_hits += 1  # read live
    stats.cached_tokens += 7
    stats.prefix_entries, stats.prefix_bytes = 0, 0  # evicted: gauges go down
    assert value(m, "potluck_prefix_cache_hits_total") == 5
    assert value(m, "potluck_prefix_cached_tokens_total") == 130
    assert value(m, "potluck_prefix_cache_entries") == 0
    assert value(m, "potluck_prefix_cache_bytes") == 0
    body, _ = m.render(None)
    lines = body.decode().splitlines()
    for name, kind in [
        ("potluck_prefix_cache_hits_total", "counter"),
        ("potluck_prefix_cache_misses_total", "counter"),
        ("potluck_prefix_cached_tokens_total", "counter"),
        ("potluck_prefix_cache_entries", "gauge"),
        ("potluck_prefix_cache_bytes", "gauge"),
    ]:
        assert f"# TYPE {name} {kind}" in lines
        assert any(line.startswith(f"# HELP {name} ") for line in lines)
    assert "potluck_prefix_cache_hits_total 5.0" in lines
    assert "potluck_prefix_cache_misses_total 6.0" in lines
    assert "potluck_prefix_cached_tokens_total 130.0" in lines


def test_speculative_decoding_counters() -> None:
    stats = Stats(draft_steps=5, drafted=40, draft_kept=31)
    m = Metrics(idle_scheduler(stats), pool())
    assert value(m, "potluck_spec_draft_steps_total") == 5
    assert value(m, "potluck_spec_drafted_tokens_total") == 40
    assert value(m, "potluck_spec_kept_tokens_total") == 31
    stats.draft_kept += 2
    assert value(m, "potluck_spec_kept_tokens_total") == 33


def test_kv_cache_and_per_node_figures() -> None:
    nodes = [
        {"address": "local", "name": "head", "compute_ms": 2.5, "hop_ms": None,
         "memory_used_bytes": 100},
        {"address": "b:1", "name": "box", "compute_ms": 4.0, "hop_ms": 1.5,
         "memory_used_bytes": 300},
        {"address": "c:2", "name": "gone", "compute_ms": None, "hop_ms": None,
         "memory_used_bytes": 0},
    ]  # fmt: skip
    m = Metrics(idle_scheduler(), pool([{1: Cache(1000), 2: Cache(500)}, {1: Cache(300)}], nodes))
    assert value(m, "potluck_kv_cache_sequences") == 2
    assert value(m, "potluck_kv_cache_bytes") == 1800
    compute, network = "potluck_node_compute_ms_per_token", "potluck_node_network_ms_per_token"
    assert value(m, compute, node="local", name="head") == 2.5
    assert value(m, compute, node="b:1", name="box") == 4.0
    assert value(m, compute, node="c:2", name="gone") is None  # not measured: no sample
    assert value(m, network, node="b:1", name="box") == 1.5
    assert value(m, network, node="local", name="head") is None
    assert value(m, "potluck_node_memory_used_bytes", node="c:2", name="gone") == 0
    body, _ = m.render(None)
    assert [line for line in body.splitlines() if b'node="c:2"' in line] == [
        b'potluck_node_memory_used_bytes{name="gone",node="c:2"} 0.0'
    ]
    idle = Metrics(idle_scheduler(), pool([{}]))
    assert value(idle, "potluck_kv_cache_sequences") == 0  # nothing leaked when idle


def test_a_scheduler_run_counts_and_times_every_request(sched: Scheduler) -> None:
    """Requests through a real scheduler over a fake pipeline, each with its timing fed from its
    events as the API does: the totals and histogram counts match what happened."""
    m = Metrics(sched, pool())
    prompt = (4, 5, 6)
    stop = alone(prompt, 1)[0]
    reqs = [
        Request(prompt, GREEDY, 6, frozenset()),
        Request(prompt[1:], GREEDY, 4, frozenset()),
        Request(prompt, GREEDY, 6, frozenset({stop})),  # one token
    ]
    sinks = []
    for r in reqs:
        timing, sink = m.timing(), QueueSink()

        def both(ev, timing=timing, sink=sink) -> None:
            timing.see(ev)
            sink(ev)

        sched.submit(r, both)
        sinks.append(sink)
    for s in sinks:
        assert isinstance(list(s.events(timeout=5.0))[-1], Finished)
    assert value(m, "potluck_requests_total") == 3
    assert value(m, "potluck_requests_finished_total", reason="length") == 2
    assert value(m, "potluck_requests_finished_total", reason="stop") == 1
    assert value(m, "potluck_generated_tokens_total") == 6 + 4 + 1
    assert value(m, "potluck_prompt_tokens_total") == 3 + 2 + 3
    assert value(m, f"{TTFT}_count") == 3 and value(m, f"{TPOT}_count") == 2
    assert value(m, "potluck_requests_active") == 0 and value(m, "potluck_queue_depth") == 0


def test_each_server_has_its_own_registry() -> None:
    a, b = Metrics(idle_scheduler(), pool()), Metrics(idle_scheduler(), pool())
    a.count("/v1/completions", 200)
    a.count("/v1/completions", 200)
    a.count("/v1/completions", 429)
    assert value(a, "potluck_http_requests_total", endpoint="/v1/completions", status="200") == 2
    assert value(a, "potluck_http_requests_total", endpoint="/v1/completions", status="429") == 1
    assert value(b, "potluck_http_requests_total", endpoint="/v1/completions", status="200") is None


def test_exposition_formats() -> None:
    m = Metrics(idle_scheduler(Stats(requests_total=5)), pool())
    body, ctype = m.render(None)
    assert ctype.startswith("text/plain") and b"potluck_requests_total 5.0" in body
    body, ctype = m.render("application/openmetrics-text; version=1.0.0")
    assert ctype.startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")


def test_status_counter_counts_answers_by_endpoint() -> None:
    """The middleware counts each answer's status once, API paths by name and the rest as
    "static"; other ASGI traffic (lifespan) passes through uncounted."""
    m = Metrics(idle_scheduler(), pool())
    sent: list[dict[str, Any]] = []

    async def app(scope, receive, send) -> None:
        if scope["type"] == "http":
            status = 404 if scope["path"] == "/v1/nothing" else 200
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": b"x"})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    counted = StatusCounter(app, m)

    async def requests() -> None:
        for path in ("/v1/models", "/v1/models", "/v1/nothing", "/index.html", "/metrics"):
            await counted({"type": "http", "path": path}, receive, send)
        await counted({"type": "lifespan"}, receive, send)

    asyncio.run(requests())
    http = "potluck_http_requests_total"
    assert value(m, http, endpoint="/v1/models", status="200") == 2
    assert value(m, http, endpoint="/v1/nothing", status="404") == 1
    assert value(m, http, endpoint="static", status="200") == 1
    assert value(m, http, endpoint="/metrics", status="200") == 1
    assert len(sent) == 10  # every message passed on, bodies included
