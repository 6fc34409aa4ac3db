"""GET /metrics of a real server (uvicorn on 127.0.0.1, a tiny random model): the text parses with
prometheus-client's own parser, every counter and histogram only grows between scrapes (what
Prometheus' `rate()` needs), histograms are observed once per request, and two servers in one
process keep their own figures."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from potluck.engine.scheduler import SchedulerConfig
from potluck.pool.build import load_model
from test_api import Server, start_server

from ggufgen import write_tiny_model

Key = tuple[str, tuple[tuple[str, str], ...]]  # (sample name, sorted labels)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("metrics") / "tiny.gguf", "llama", n_layer=2)


def _server(path: Path) -> Iterator[Server]:
    yield from start_server(load_model(path, n_ctx=128), SchedulerConfig(max_active=4), None)


@pytest.fixture(scope="module")
def server(tiny_path: Path) -> Iterator[Server]:
    yield from _server(tiny_path)


@pytest.fixture(scope="module")
def other(tiny_path: Path) -> Iterator[Server]:
    """A second server in the same process (its own model copy and scheduler)."""
    yield from _server(tiny_path)


def _scrape(server: Server) -> tuple[dict[Key, float], set[Key], dict[str, str]]:
    """Every sample of the exposition, those of counters and histograms, each family's type."""
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples, growing, types = {}, set(), {}
    for fam in text_string_to_metric_families(r.text):
        types[fam.name] = fam.type
        for s in fam.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in samples, f"{key} twice"
            samples[key] = s.value
            if fam.type in ("counter", "histogram"):
                growing.add(key)
    return samples, growing, types


def _one(samples: dict[Key, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _complete(server: Server, max_tokens: int, stream: bool = False) -> int:
    """One completion (a fixed prompt of token ids, greedy); its completion tokens."""
    body = {
        "model": server.model_id,
        "prompt": [5, 6, 7, 8],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if not stream:
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["completion_tokens"])
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    usage = 0
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and '"usage": {' in line:
                usage = int(line.split('"completion_tokens": ')[1].split(",")[0].split("}")[0])
    return usage


def test_counters_and_histograms_only_grow(server: Server, other: Server) -> None:
    first, growing, types = _scrape(server)
    other_first, _, _ = _scrape(other)
    assert types["potluck_requests"] == "counter"  # (the parser drops "_total" from the family)
    assert types["potluck_time_to_first_token_seconds"] == "histogram"
    assert types["potluck_time_per_output_token_seconds"] == "histogram"
    assert types["potluck_node_compute_ms_per_token"] == "gauge"

    tokens = [_complete(server, 6), _complete(server, 1), _complete(server, 4, stream=True)]
    bad = httpx.post(server.url + "/v1/completions", json={"model": "nope", "prompt": "x"})
    assert bad.status_code == 404
    assert server.idle()

    second, growing2, types2 = _scrape(server)
    assert types2 == types and growing <= growing2, growing - growing2
    shrunk = {k: (first[k], second[k]) for k in growing if second[k] < first[k]}
    assert not shrunk, shrunk

    def grew(name: str, **labels: str) -> float:
        return _one(second, name, **labels) - _one(first, name, **labels)

    # once per request: TTFT for each, time per output token for those of two tokens or more
    assert grew("potluck_time_to_first_token_seconds_count") == 3
    assert grew("potluck_time_per_output_token_seconds_count") == sum(n >= 2 for n in tokens)
    assert grew("potluck_time_to_first_token_seconds_sum") > 0
    assert grew("potluck_time_to_first_token_seconds_bucket", le="+Inf") == 3
    assert grew("potluck_requests_total") == 3
    assert grew("potluck_generated_tokens_total") >= sum(tokens)
    assert grew("potluck_prompt_tokens_total") == 3 * 4
    assert grew("potluck_http_requests_total", endpoint="/v1/completions", status="200") == 3
    assert grew("potluck_http_requests_total", endpoint="/v1/completions", status="404") == 1
    assert _one(second, "potluck_queue_depth") == 0 and _one(second, "potluck_kv_cache_bytes") == 0
    (compute,) = [k for k in second if k[0] == "potluck_node_compute_ms_per_token"]
    assert dict(compute[1])["node"] == "local" and second[compute] > 0

    # the other server's registry saw none of it (only its own scrape)
    other_second, _, _ = _scrape(other)
    for name in ("potluck_requests_total", "potluck_time_to_first_token_seconds_count"):
        assert _one(other_second, name) == _one(other_first, name) == 0
    assert _one(other_second, "potluck_http_requests_total", endpoint="/metrics", status="200") == 1


def test_openmetrics_when_asked(server: Server) -> None:
    r = httpx.get(server.url + "/metrics", headers={"Accept": "application/openmetrics-text"})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.endswith("# EOF\n")
    assert "potluck_time_to_first_token_seconds_bucket" in r.text
