"""Continuous batching with a real model: many requests at once give exactly what each gives alone,
they join and leave between steps, cancel frees the KV cache, a full queue refuses, and over a pool
of real worker processes (several batches in flight) the tokens are the same as well."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from potluck.engine.generate import Model, generate
from potluck.engine.scheduler import (
    Failed,
    Finished,
    QueueFullError,
    QueueSink,
    Request,
    Scheduler,
    SchedulerConfig,
    TokenEvent,
)
from potluck.errors import ContextError
from potluck.model.stage import SeqChunk
from potluck.pool.build import load_model
from potluck.sampling import GREEDY, Sampler, SamplingParams, Token, log_softmax
from workers import Spawn
from workers import spawn_module_worker as spawn_module_worker

PROMPTS = [
    "The quick brown fox",
    "In 1969, the first people to walk on",
    "Name three planets.",
    "def fib(n):",
    "Hello",
    "Once upon a time there was a small village where",
    "1, 2, 3, 4,",
    "The capital of France is",
    "Water boils at",
    "My favourite colour is",
]


@pytest.fixture(scope="module")
def smol(smollm2_path: Path) -> Model:
    return load_model(smollm2_path, n_ctx=256)


def _alone(m: Model, ids: list[int], n: int, params: SamplingParams = GREEDY) -> list[int]:
    return list(generate(m, ids, n, Sampler(params), stop_ids=frozenset()))


def _run(sched: Scheduler, reqs: list[Request]) -> list[tuple[list[int], Finished]]:
    sinks = [QueueSink() for _ in reqs]
    for r, s in zip(reqs, sinks, strict=True):
        sched.submit(r, s)
    out = []
    for s in sinks:
        evs = list(s.events(timeout=60))
        assert isinstance(evs[-1], Finished), evs[-1]
        out.append(([e.token for e in evs if isinstance(e, TokenEvent)], evs[-1]))
    return out


@pytest.fixture
def sched(smol: Model) -> Iterator[Scheduler]:
    s = Scheduler(smol, SchedulerConfig(n_batch=4, max_rows=4, max_active=6))
    yield s
    s.close()
    assert smol.pipeline.stages[0].caches == {}


def test_concurrent_equal_alone_greedy(smol: Model, sched: Scheduler) -> None:
    """10 requests (more than max_active, decode batches of ≤ 4 rows, prompts in micro-batches
    of 4) give exactly the tokens each gives alone through `generate`."""
    ids = [smol.tokenizer.encode(p) for p in PROMPTS]
    want = [_alone(smol, p, 12) for p in ids]
    got = _run(sched, [Request(tuple(p), GREEDY, 12, frozenset()) for p in ids])
    assert [toks for toks, _ in got] == want
    assert all(f.reason == "length" and f.n_generated == 12 for _, f in got)
    assert smol.pipeline.stages[0].caches == {}


def test_concurrent_equal_alone_seeded(smol: Model, sched: Scheduler) -> None:
    ids = [smol.tokenizer.encode(p) for p in PROMPTS[:5]]
    params = [SamplingParams(temperature=0.9, seed=100 + i) for i in range(5)]
    want = [_alone(smol, p, 10, q) for p, q in zip(ids, params, strict=True)]
    got = _run(
        sched, [Request(tuple(p), q, 10, frozenset()) for p, q in zip(ids, params, strict=True)]
    )
    assert [toks for toks, _ in got] == want


def test_requests_join_a_running_batch(smol: Model, sched: Scheduler) -> None:
    """A request submitted while another is mid-generation joins at the next step; both exact."""
    a, b = (smol.tokenizer.encode(p) for p in PROMPTS[:2])
    want_a, want_b = _alone(smol, a, 40), _alone(smol, b, 8)
    sa, sb = QueueSink(), QueueSink()
    sched.submit(Request(tuple(a), GREEDY, 40, frozenset()), sa)
    got_a: list[int] = []
    for ev in sa.events():
        if isinstance(ev, TokenEvent):
            got_a.append(ev.token)
        if len(got_a) == 5:
            break
    sched.submit(Request(tuple(b), GREEDY, 8, frozenset()), sb)
    got_b = [e.token for e in sb.events() if isinstance(e, TokenEvent)]
    got_a += [e.token for e in sa.events() if isinstance(e, TokenEvent)]
    assert got_b == want_b
    assert got_a == want_a


def test_stop_ids_length_and_full_context(smol: Model, sched: Scheduler) -> None:
    ids = smol.tokenizer.encode(PROMPTS[2])
    want = _alone(smol, ids, 20)
    stop = want[5]
    first = want.index(stop)
    ((toks, fin),) = _run(sched, [Request(tuple(ids), GREEDY, 20, frozenset({stop}))])
    assert toks == want[: first + 1] and fin.reason == "stop"  # the stop id is delivered, last
    long = smol.tokenizer.encode("count: " + "1 2 3 " * 40)
    ((toks, fin),) = _run(sched, [Request(tuple(long), GREEDY, 500, frozenset())])
    assert fin.reason == "length" and len(long) + len(toks) == smol.n_ctx


def test_cancel_frees_kv_cache(smol: Model, sched: Scheduler) -> None:
    ids = smol.tokenizer.encode(PROMPTS[5])
    sink = QueueSink()
    stream = sched.submit(Request(tuple(ids), GREEDY, 200, frozenset()), sink)
    n = 0
    for ev in sink.events():
        if isinstance(ev, TokenEvent):
            n += 1
            if n == 3:
                assert len(smol.pipeline.stages[0].caches) == 1
                stream.cancel()
        elif isinstance(ev, Finished):
            assert ev.reason == "cancelled" and 3 <= ev.n_generated < 200
    deadline = time.monotonic() + 5
    while smol.pipeline.stages[0].caches and time.monotonic() < deadline:
        time.sleep(0.01)
    assert smol.pipeline.stages[0].caches == {}
    assert sched.active == 0


def test_queue_full_refuses(smol: Model) -> None:
    s = Scheduler(smol, SchedulerConfig(max_active=1, max_queue=1))
    try:
        ids = tuple(smol.tokenizer.encode(PROMPTS[0]))
        streams = [s.submit(Request(ids, GREEDY, 200, frozenset()), QueueSink()) for _ in range(2)]
        with pytest.raises(QueueFullError, match=r"1 waiting \(limit 1\)|limit 1"):
            s.submit(Request(ids, GREEDY, 200, frozenset()), QueueSink())
        assert s.stats.requests_rejected == 1
        for st in streams:
            st.cancel()
    finally:
        s.close()
    assert smol.pipeline.stages[0].caches == {}


def test_bad_requests(smol: Model, sched: Scheduler) -> None:
    with pytest.raises(ContextError, match="empty"):
        sched.submit(Request((), GREEDY, 5, frozenset()), QueueSink())
    with pytest.raises(ContextError, match=r"prompt is 300 tokens but the context is 256"):
        sched.submit(Request((1,) * 300, GREEDY, 5, frozenset()), QueueSink())


def test_logprobs_are_the_models(smol: Model, sched: Scheduler) -> None:
    """Each token carries log_softmax of the raw logits, and top alternatives sorted."""
    ids = smol.tokenizer.encode(PROMPTS[7])
    params = SamplingParams(temperature=0.0, logprobs=3)
    ((toks, _),) = _run(sched, [Request(tuple(ids), params, 3, frozenset())])
    assert all(isinstance(t, Token) for t in toks)
    seq = smol.new_seq_id()  # the same micro-batches of 4 as the scheduler's (same kernels)
    for i in range(0, len(ids), 4):
        part = ids[i : i + 4]
        logits = smol.pipeline.forward(np.array(part), [SeqChunk(seq, len(part))])[0]
    smol.pipeline.drop(seq)
    ref = log_softmax(logits)
    t0 = toks[0]
    assert int(t0) == int(ref.argmax()) == t0.top[0][0]
    assert t0.logprob == pytest.approx(float(ref[t0]), abs=1e-5)
    assert [i for i, _ in t0.top] == np.argsort(-ref, kind="stable")[:3].tolist()
    assert all(a[1] >= b[1] for a, b in zip(t0.top, t0.top[1:], strict=False))


# -- over a pool of real worker processes: depth > 1, batches in flight --------------------------
@pytest.fixture(scope="module")
def pool_model(spawn_module_worker: Spawn, smollm2_path: Path) -> Model:
    peers = [spawn_module_worker().address for _ in range(2)]
    return load_model(smollm2_path, n_ctx=256, peers=peers)


def test_pool_concurrent_equal_alone(smol: Model, pool_model: Model) -> None:
    """Three stages (this machine + two workers): sequences spread over up to 3 batches in flight
    give the same greedy and seeded tokens as one process alone, and the same logprobs (sent back
    by the last stage)."""
    assert pool_model.pipeline.depth == 3
    ids = [smol.tokenizer.encode(p) for p in PROMPTS[:6]]
    params = [GREEDY if i % 2 else SamplingParams(temperature=0.8, seed=i) for i in range(6)]
    want = [_alone(smol, p, 10, q) for p, q in zip(ids, params, strict=True)]
    s = Scheduler(pool_model, SchedulerConfig(n_batch=4, max_rows=4))
    try:
        got = _run(
            s, [Request(tuple(p), q, 10, frozenset()) for p, q in zip(ids, params, strict=True)]
        )
        assert [toks for toks, _ in got] == want
        lp = SamplingParams(temperature=0.0, logprobs=2)
        alone = _alone(smol, ids[0], 3, lp)
        ((pooled, _),) = _run(s, [Request(tuple(ids[0]), lp, 3, frozenset())])
        assert pooled == alone
        for a, b in zip(alone, pooled, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-5
            assert [i for i, _ in a.top] == [i for i, _ in b.top] and len(b.top) == 2
        assert len(s.stats.stage_ms) == 3 and len(s.stats.hop_ms) == 3
        assert s.stats.max_in_flight > 1  # (with a synchronous submit this stays 1)
    finally:
        s.close()
    assert all(not st.caches for st in pool_model.pipeline.stages)


def test_failed_batch_reports_and_scheduler_goes_on(smol: Model, sched: Scheduler) -> None:
    """A request whose prompt does not fit the KV cache after admission cannot happen (checked at
    submit); a token id outside the vocabulary fails inside the pipeline: that request gets
    Failed, the others finish."""
    good = smol.tokenizer.encode(PROMPTS[0])
    bad = (smol.hp.n_vocab + 5,)
    sg, sb = QueueSink(), QueueSink()
    sched.submit(Request(tuple(good), GREEDY, 5, frozenset()), sg)
    sched.submit(Request(bad, GREEDY, 5, frozenset()), sb)
    evs_b = list(sb.events())
    assert isinstance(evs_b[-1], Failed)
    evs_g = list(sg.events())
    assert isinstance(evs_g[-1], Finished) and evs_g[-1].n_generated == 5
    ((toks, fin),) = _run(sched, [Request(tuple(good), GREEDY, 5, frozenset())])
    assert toks == _alone(smol, good, 5)


def test_interactive_requests_go_before_waiting_batch_requests(smol: Model) -> None:
    """One sequence at a time: while a batch request runs, another batch request and then a chat
    wait; the chat is admitted first when the slot frees (FIFO within each kind)."""
    from potluck.engine.scheduler import BATCH, INTERACTIVE

    s = Scheduler(smol, SchedulerConfig(max_active=1))
    try:
        ids = tuple(smol.tokenizer.encode("Hello"))
        first_token: dict[str, float] = {}
        running = threading.Event()  # the first request has a token: it holds the one slot

        def sink(name: str) -> QueueSink:
            q = QueueSink()
            inner = q.__call__

            def call(ev) -> None:
                if isinstance(ev, TokenEvent):
                    first_token.setdefault(name, time.perf_counter())
                    if name == "running":
                        running.set()
                inner(ev)

            q.__call__ = call  # type: ignore[method-assign]
            return q

        sinks = {}
        for name, prio in (("running", BATCH), ("batch", BATCH), ("chat", INTERACTIVE)):
            sinks[name] = sink(name)
            s.submit(Request(ids, GREEDY, 24, frozenset(), prio), sinks[name].__call__)
            if name == "running":
                assert running.wait(timeout=30)
        for q in sinks.values():
            assert isinstance(list(q.events(timeout=60))[-1], Finished)
        assert first_token["running"] < first_token["chat"] < first_token["batch"]
    finally:
        s.close()
