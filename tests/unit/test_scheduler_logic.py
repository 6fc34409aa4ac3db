"""The scheduler's logic against a fake pipeline: tokens in order, finish reasons, prompt
micro-batches, batches in flight, fairness, priorities, cancel, failures, close and its stats.
(The same scheduler over a real model and real workers: tests/test_scheduler.py.)"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Iterator

import pytest

from potluck.engine.generate import prompt_ubatch
from potluck.engine.scheduler import (
    BATCH,
    INTERACTIVE,
    Event,
    Failed,
    Finished,
    QueueFullError,
    QueueSink,
    Request,
    Scheduler,
    SchedulerClosedError,
    SchedulerConfig,
    TokenEvent,
)
from potluck.errors import ContextError, NodeError, UnsupportedError
from potluck.sampling import GREEDY, SamplingParams, Token

from .fakes import PEAK, VOCAB, FakeModel, FakePipeline, Releaser, Sent, alone

WAIT_S = 5.0  # the longest any event may take to arrive (they take milliseconds)

Make = Callable[..., Scheduler]


@pytest.fixture
def make() -> Iterator[Make]:
    """Scheduler(FakeModel(pipe, n_ctx), SchedulerConfig(**config)), closed after the test; the
    pipeline must end with every cache freed and no breach of its contract."""
    made: list[tuple[Scheduler, FakePipeline]] = []

    def _make(pipe: FakePipeline, n_ctx: int = 64, **config: int) -> Scheduler:
        s = Scheduler(FakeModel(pipe, n_ctx), SchedulerConfig(**config))
        made.append((s, pipe))
        return s

    yield _make
    for s, pipe in made:
        pipe.hold = False
        pipe.release()
        s.close(WAIT_S)
        assert not s._thread.is_alive()
        assert pipe.caches == {}, "a sequence's cache was not freed"
        assert pipe.misuse == []


def request(prompt: tuple[int, ...], max_tokens: int, stop_ids=(), **kw) -> Request:
    return Request(prompt, kw.pop("params", GREEDY), max_tokens, frozenset(stop_ids), **kw)


def events(sink: QueueSink) -> list[Event]:
    return list(sink.events(timeout=WAIT_S))


def tokens_of(evs: list[Event]) -> list[int]:
    return [e.token for e in evs if isinstance(e, TokenEvent)]


def run(sched: Scheduler, reqs: list[Request]) -> list[list[Event]]:
    sinks = [QueueSink() for _ in reqs]
    for r, s in zip(reqs, sinks, strict=True):
        sched.submit(r, s)
    return [events(s) for s in sinks]


def batches_of(pipe: FakePipeline, seq_id: int) -> list[Sent]:
    return [b for b in pipe.sent if seq_id in b.seq_ids]


PROMPT = (5, 6, 7, 8, 9, 10)


def test_one_request_gives_its_tokens_in_order(make: Make) -> None:
    pipe = FakePipeline()
    sched = make(pipe, n_batch=4)
    (evs,) = run(sched, [request(PROMPT, 8)])
    assert evs[:-1] == [TokenEvent(t, i) for i, t in enumerate(alone(PROMPT, 8))]
    assert evs[-1] == Finished("length", len(PROMPT), 8)
    # the prompt in micro-batches of n_batch, only the last one sampled; then one id per step
    sent = batches_of(pipe, 1)
    assert [b.ids for b in sent[:2]] == [PROMPT[:4], PROMPT[4:]]
    assert [bool(b.sampled) for b in sent[:2]] == [False, True]
    assert [b.ids for b in sent[2:]] == [(t,) for t in alone(PROMPT, 7)]  # no step after the 8th
    assert pipe.dropped == [1]


def test_concurrent_requests_each_give_what_they_give_alone(make: Make) -> None:
    """More requests than max_active, decode steps of several rows: every request gets exactly
    its own tokens, and no decode step is wider than max_rows or a micro-batch than n_batch."""
    pipe = FakePipeline()
    sched = make(pipe, n_batch=3, max_active=4, max_rows=3)
    prompts = [tuple(range(k, k + 2 + k % 5)) for k in range(10)]
    got = run(sched, [request(p, 6 + k % 3) for k, p in enumerate(prompts)])
    for k, (p, evs) in enumerate(zip(prompts, got, strict=True)):
        assert tokens_of(evs) == alone(p, 6 + k % 3)
        assert evs[-1] == Finished("length", len(p), 6 + k % 3)
    decodes = [b for b in pipe.sent if all(c.n == 1 for c in b.chunks) and b.sampled]
    assert max(len(b.chunks) for b in decodes) == 3  # rows were batched, up to max_rows
    assert all(sum(c.n for c in b.chunks) <= 3 for b in pipe.sent)
    st = sched.stats
    assert st.requests_total == 10 and st.requests_finished == {"length": 10}
    assert st.prompt_tokens == sum(map(len, prompts))
    assert st.generated_tokens == sum(6 + k % 3 for k in range(10))


def test_stop_id_ends_the_request_and_is_delivered(make: Make) -> None:
    want = alone(PROMPT, 30)
    stop = want[5]
    k = want.index(stop)
    (evs,) = run(make(FakePipeline()), [request(PROMPT, 30, stop_ids={stop, VOCAB + 1})])
    assert tokens_of(evs) == want[: k + 1]
    assert evs[-1] == Finished("stop", len(PROMPT), k + 1)


def test_a_full_context_ends_with_length(make: Make) -> None:
    sched = make(FakePipeline(), n_ctx=10)
    (evs,) = run(sched, [request(PROMPT[:4], 100)])
    assert tokens_of(evs) == alone(PROMPT[:4], 6)
    assert evs[-1] == Finished("length", 4, 6)


def test_requests_that_cannot_run_are_refused_at_submit(make: Make) -> None:
    sched = make(FakePipeline(supports_logprobs=False), n_ctx=6)
    with pytest.raises(ContextError, match="empty"):
        sched.submit(request((), 4), QueueSink())
    with pytest.raises(ContextError, match="prompt is 6 tokens but the context is 6"):
        sched.submit(request(PROMPT, 4), QueueSink())
    with pytest.raises(UnsupportedError, match="logprobs"):
        sched.submit(request((1,), 4, params=SamplingParams(logprobs=1)), QueueSink())
    assert sched.stats.requests_total == 0
    for bad in ({"n_batch": 0}, {"max_active": 0}, {"max_rows": 0}, {"max_queue": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SchedulerConfig(**bad)


def test_logprobs_are_the_pipelines(make: Make) -> None:
    """Each token carries its logprob under the pipeline's logits and the top alternatives."""
    params = SamplingParams(temperature=0.0, logprobs=2)
    (evs,) = run(make(FakePipeline()), [request(PROMPT, 3, params=params)])
    toks = tokens_of(evs)
    assert toks == alone(PROMPT, 3)
    norm = math.log(math.exp(PEAK) + VOCAB - 1)  # PEAK at the token, 0 at the VOCAB - 1 others
    for tok in toks:
        assert isinstance(tok, Token)
        runner_up = 0 if tok != 0 else 1  # ties go to the lower id
        assert tok.logprob == pytest.approx(PEAK - norm, abs=1e-5)
        assert [i for i, _ in tok.top] == [tok, runner_up]
        assert [lp for _, lp in tok.top] == pytest.approx([PEAK - norm, -norm], abs=1e-5)


def test_batches_in_flight_keep_each_sequence_apart(make: Make) -> None:
    """A pipeline of depth 3 whose batches come back in a shuffled order (each sequence's in
    order, as the contract says): several batches go in flight, never more than the depth, and
    every request still gets its own tokens; prompts go in micro-batches sized for the depth."""
    pipe = FakePipeline(depth=3, hold=True)
    sched = make(pipe, n_ctx=256, n_batch=512, max_active=8)
    prompts = [tuple(range(k, k + 40 + 9 * k)) for k in range(8)]
    releaser = Releaser(pipe, seed=1)
    try:
        got = run(sched, [request(p, 7) for p in prompts])
    finally:
        releaser.stop()
    for p, evs in zip(prompts, got, strict=True):
        assert tokens_of(evs) == alone(p, 7) and evs[-1] == Finished("length", len(p), 7)
    assert 1 < pipe.max_held <= 3 and 1 < sched.stats.max_in_flight <= 3
    for sid, p in enumerate(prompts, start=1):
        prompt_sizes = [b.chunks[0].n for b in batches_of(pipe, sid)][:-6]  # 6 decode steps
        size = prompt_ubatch(len(p), 512, 3)
        assert prompt_sizes == [size] * (len(p) // size) + (
            [len(p) % size] if len(p) % size else []
        )


def test_follow_up_steps_over_a_chaining_pipeline(make: Make) -> None:
    """A pipeline that chains: decode steps are sent before the token they follow is back, with
    the same tokens, no step beyond max_tokens, and none beyond a stop id."""
    pipe = FakePipeline(depth=2, chains=True, hold=True)
    sched = make(pipe)
    want, want2 = alone(PROMPT, 12), alone(PROMPT[1:], 40)
    stop = want2[8]
    k = want2.index(stop)
    releaser = Releaser(pipe, seed=2)
    try:
        long, stopped = run(sched, [request(PROMPT, 12), request(PROMPT[1:], 40, {stop})])
    finally:
        releaser.stop()
    assert tokens_of(long) == want and long[-1] == Finished("length", len(PROMPT), 12)
    assert tokens_of(stopped) == want2[: k + 1] and stopped[-1] == Finished("stop", 5, k + 1)
    assert sched.stats.follow_ups > 0
    # one sampled batch per token: nothing computed past the 12th token or the stop id
    assert sum(1 for b in batches_of(pipe, 1) if b.sampled) == 12
    assert sum(1 for b in batches_of(pipe, 2) if b.sampled) == k + 1


def test_decode_steps_take_turns(make: Make) -> None:
    """Four sequences decoding, two rows per step: between two steps of one sequence, every other
    sequence that was already decoding gets a step (the ready ones that waited longest go first)."""
    pipe = FakePipeline(hold=True)
    sched = make(pipe, max_rows=2)
    sinks = [QueueSink() for _ in range(4)]
    for k, sink in enumerate(sinks):  # all four arrive while the first prompt is in flight
        sched.submit(request((k,), 12), sink)
    releaser = Releaser(pipe)
    try:
        assert all(tokens_of(events(s)) == alone((k,), 12) for k, s in enumerate(sinks))
    finally:
        releaser.stop()
    seqs = [b.seq_ids for b in pipe.sent]
    prompted = {sid: seqs.index((sid,)) for sid in range(1, 5)}  # a 1-token prompt: one batch
    last = {sid: max(i for i, ids in enumerate(seqs) if sid in ids) for sid in range(1, 5)}
    checked = 0
    for x in range(1, 5):
        steps = [i for i, ids in enumerate(seqs) if x in ids and i > prompted[x]]
        for j, i in itertools.pairwise(steps):
            for y in range(1, 5):
                if y != x and prompted[y] < j and last[y] > i:  # y was decoding all along
                    assert any(y in ids for ids in seqs[j : i + 1]), (x, y, j, i, seqs)
                    checked += 1
    assert checked > 20
    assert max(len(ids) for ids in seqs) == 2


def test_a_long_prompt_does_not_stall_decoding(make: Make) -> None:
    """A 40-token prompt in micro-batches of 4 arrives while another request decodes: prompt
    micro-batches and decode steps alternate."""
    pipe = FakePipeline(hold=True)
    sched = make(pipe, n_batch=4)
    first = QueueSink()
    sched.submit(request((1, 2), 30), first)
    pipe.wait_held(1)
    pipe.release(1)  # its prompt: the first token comes, a decode step goes
    assert first.q.get(timeout=WAIT_S) == TokenEvent(alone((1, 2), 1)[0], 0)
    second = QueueSink()
    sched.submit(request(tuple(range(40)), 2), second)
    releaser = Releaser(pipe)
    try:
        assert tokens_of(events(second)) == alone(tuple(range(40)), 2)
        assert tokens_of(events(first)) == alone((1, 2), 30)[1:]
    finally:
        releaser.stop()
    kinds = "".join("p" if b.seq_ids == (2,) and len(b.ids) == 4 else "d" for b in pipe.sent)
    prompt = kinds[kinds.index("p") : kinds.rindex("p") + 1]
    assert prompt == "pd" * 9 + "p"


def test_interactive_requests_are_admitted_before_batch_requests(make: Make) -> None:
    pipe = FakePipeline(hold=True)
    sched = make(pipe, max_active=1)
    sinks = [QueueSink() for _ in range(3)]
    sched.submit(request((1,), 2, priority=BATCH), sinks[0])
    pipe.wait_held(1)  # the first holds the one slot
    sched.submit(request((2,), 2, priority=BATCH), sinks[1])
    sched.submit(request((3,), 2, priority=INTERACTIVE), sinks[2])
    releaser = Releaser(pipe)
    try:
        for s in sinks:
            assert isinstance(events(s)[-1], Finished)
    finally:
        releaser.stop()
    # sequence ids follow submission: 1 running, 2 the batch request, 3 the chat
    first = {sid: next(i for i, b in enumerate(pipe.sent) if sid in b.seq_ids) for sid in (1, 2, 3)}
    assert sorted(first, key=first.__getitem__) == [1, 3, 2]


def test_a_full_queue_refuses(make: Make) -> None:
    pipe = FakePipeline(hold=True)
    sched = make(pipe, max_active=1, max_queue=1)
    sched.submit(request((1,), 2), QueueSink())
    sched.submit(request((2,), 2), QueueSink())
    with pytest.raises(QueueFullError, match="limit 1"):
        sched.submit(request((3,), 2), QueueSink())
    assert sched.stats.requests_rejected == 1 and sched.stats.requests_total == 2


def test_cancel_with_a_batch_in_flight(make: Make) -> None:
    """Cancelled while its decode step is in flight: that step's token is not sent, it finishes
    with the reason given, and its cache is freed only once the step is back."""
    pipe = FakePipeline(hold=True)
    sched = make(pipe)
    sink = QueueSink()
    stream = sched.submit(request(PROMPT, 20), sink)
    pipe.wait_held(1)
    pipe.release(1)
    assert sink.q.get(timeout=WAIT_S) == TokenEvent(alone(PROMPT, 1)[0], 0)
    pipe.wait_held(1)  # the next decode step
    stream.cancel("stop")
    stream.cancel()  # a second cancel changes nothing
    pipe.release(1)
    assert events(sink) == [Finished("stop", len(PROMPT), 1)]
    assert pipe.dropped == [stream.seq_id]
    assert sched.stats.requests_finished == {"stop": 1}


def test_cancel_while_waiting_never_touches_the_pipeline(make: Make) -> None:
    pipe = FakePipeline(hold=True)
    sched = make(pipe, max_active=1)
    running, waiting = QueueSink(), QueueSink()
    sched.submit(request((1,), 3), running)
    pipe.wait_held(1)
    stream = sched.submit(request((2, 3), 3), waiting)
    stream.cancel()
    releaser = Releaser(pipe)
    try:
        assert events(running)[-1] == Finished("length", 1, 3)
        assert events(waiting) == [Finished("cancelled", 2, 0)]
    finally:
        releaser.stop()
    assert batches_of(pipe, stream.seq_id) == []


def test_a_failed_batch_fails_its_request_and_the_others_go_on(make: Make) -> None:
    pipe = FakePipeline()
    boom = NodeError("node b:1 is unreachable")
    pipe.fail_if = lambda b: boom if 666 in b.ids else None
    sched = make(pipe, max_rows=1)
    good, bad = run(sched, [request(PROMPT, 5), request((4, 666), 5)])
    assert tokens_of(good) == alone(PROMPT, 5) and good[-1] == Finished("length", len(PROMPT), 5)
    assert bad == [Failed(boom)]
    (again,) = run(sched, [request(PROMPT, 5)])
    assert tokens_of(again) == alone(PROMPT, 5)


def test_a_failed_prompt_micro_batch_frees_the_cache_once_the_rest_are_back(make: Make) -> None:
    """A pool of depth 3 with a long prompt's micro-batches in flight: the first fails, the
    request fails at once, no batch of it is sent after, and its cache is freed only when the
    micro-batches still in flight have come back (not under them)."""
    pipe = FakePipeline(depth=3, hold=True)
    sched = make(pipe, n_ctx=256)
    sink = QueueSink()
    boom = NodeError("node b:1 closed the stream")
    stream = sched.submit(request(tuple(range(100)), 5), sink)
    pipe.wait_held(3)
    first = pipe.in_flight[0]
    pipe.fail_if = lambda b: boom if b is first else None
    pipe.release(1)
    assert events(sink) == [Failed(boom)]
    assert stream.seq_id not in pipe.dropped
    pipe.fail_if, pipe.hold = None, False
    pipe.release()
    (evs,) = run(sched, [request(PROMPT, 2)])  # the scheduler goes on (and has dropped it)
    assert tokens_of(evs) == alone(PROMPT, 2)
    assert pipe.dropped[0] == stream.seq_id
    assert [b.chunks[0].n for b in batches_of(pipe, stream.seq_id)] == [32, 32, 32]


def test_a_pipeline_that_raises_at_submit_fails_the_request(make: Make) -> None:
    pipe = FakePipeline()
    pipe.submit_raises = RuntimeError("cannot send")
    sched = make(pipe)
    (evs,) = run(sched, [request(PROMPT, 5)])
    assert len(evs) == 1 and isinstance(evs[0], Failed) and str(evs[0].error) == "cannot send"
    pipe.submit_raises = None
    (evs,) = run(sched, [request(PROMPT, 2)])
    assert tokens_of(evs) == alone(PROMPT, 2)


def test_a_sink_that_fails_cancels_its_request(make: Make) -> None:
    pipe = FakePipeline()
    sched = make(pipe)
    finished = threading.Event()

    def broken(ev: Event) -> None:
        if isinstance(ev, Finished):
            finished.set()
        if isinstance(ev, TokenEvent) and ev.index == 2:
            raise RuntimeError("the caller's loop is closed")

    sched.submit(request(PROMPT, 50), broken)
    assert finished.wait(WAIT_S)
    assert sched.stats.requests_finished == {"cancelled": 1}
    assert sum(1 for b in pipe.sent if b.sampled) == 3  # nothing computed after the failure


def test_close_fails_the_waiting_and_cancels_the_running(make: Make) -> None:
    pipe = FakePipeline(hold=True)
    sched = make(pipe, max_active=1)
    running, waiting = QueueSink(), QueueSink()
    sched.submit(request(PROMPT, 10), running)
    pipe.wait_held(1)
    sched.submit(request((1,), 10), waiting)
    closer = threading.Thread(target=sched.close)
    closer.start()
    (failed,) = events(waiting)
    assert isinstance(failed, Failed) and isinstance(failed.error, SchedulerClosedError)
    assert closer.is_alive()  # it waits for the batch in flight
    pipe.release()
    closer.join(WAIT_S)
    assert not closer.is_alive()
    assert events(running) == [Finished("cancelled", len(PROMPT), 0)]
    with pytest.raises(SchedulerClosedError):
        sched.submit(request((1,), 1), QueueSink())


def test_stats_per_stage_timings(make: Make) -> None:
    """Per-stage compute and the hop into each remote stage come from the pipeline (a local
    first stage has no hop); a pipeline without per-stage figures counts the whole step as one
    stage's compute."""
    pipe = FakePipeline(nodes=["b:1", "c:2"])
    pipe.last_stage_ms, pipe.last_hop_ms = [2.0, 3.0, 4.0], [0.5, 0.25]
    sched = make(pipe)
    run(sched, [request(PROMPT, 4)])
    st = sched.stats
    assert st.stage_ms == [2.0, 3.0, 4.0] and st.hop_ms == [0.0, 0.5, 0.25]
    assert st.decode_steps == 3 and st.decode_rows == 1.0
    local = make(FakePipeline())
    run(local, [request(PROMPT, 4)])
    assert len(local.stats.stage_ms) == 1 and local.stats.hop_ms == [0.0]
    assert local.stats.tokens_per_s(window_s=60.0) == pytest.approx(4 / 60.0)
