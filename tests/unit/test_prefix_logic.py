"""Cached prefixes in the scheduler, against the fake pipeline: a request that begins with the ids
of a finished sequence computes only the rest, rewinding that sequence's cache to the shared part.
The fake's next token hashes every id its cache holds, in order, so a reused prefix that is wrong
by one position changes every token after it. (Over a real model and real workers:
tests/test_prefix_cache.py.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from potluck.engine.prefix import MIN_REUSE, PrefixCache, common_prefix
from potluck.engine.scheduler import Failed, Finished, QueueSink, Scheduler, SchedulerConfig
from potluck.errors import NodeError

from .fakes import FakeModel, FakePipeline, Releaser, alone
from .test_scheduler_logic import WAIT_S, events, request, run, tokens_of

BIG = 10_000  # a budget (positions: the fake model counts one byte per position) nothing exceeds


@pytest.fixture
def made() -> Iterator[list[tuple[Scheduler, FakePipeline]]]:
    out: list[tuple[Scheduler, FakePipeline]] = []
    yield out
    for s, pipe in out:
        pipe.hold = False
        pipe.release()
        s.close(WAIT_S)
        assert pipe.caches == {}, "a cached sequence was not freed at close"
        assert pipe.misuse == []


def sched(made: list, pipe: FakePipeline, **config: int) -> Scheduler:
    s = Scheduler(FakeModel(pipe, 256), SchedulerConfig(**config))
    made.append((s, pipe))
    return s


def finished(evs: list) -> Finished:
    assert isinstance(evs[-1], Finished), evs[-1]
    return evs[-1]


def test_a_chat_turn_computes_only_what_is_new(made: list) -> None:
    pipe = FakePipeline()
    s = sched(made, pipe, n_batch=4, cache_bytes=BIG)
    p1 = (11, 12, 13, 14, 15, 16)
    (evs,) = run(s, [request(p1, 5)])
    t1 = tokens_of(evs)
    assert finished(evs).n_cached == 0
    p2 = (*p1, *t1, 21, 22, 23)  # the history and a new message
    n_before = len(pipe.sent)
    (evs,) = run(s, [request(p2, 6)])
    assert tokens_of(evs) == alone(p2, 6)
    # the stages held p1 and t1 but its last token (never fed): that much is reused
    reuse = len(p1) + len(t1) - 1
    assert finished(evs) == Finished("length", len(p2), 6, n_cached=reuse)
    first = pipe.sent[n_before]
    assert first.chunks[0].pos == reuse and first.ids == p2[reuse : reuse + 4]
    assert sum(c.n for b in pipe.sent[n_before:] for c in b.chunks) == len(p2) - reuse + 5
    st = s.stats
    assert (st.prefix_hits, st.prefix_misses, st.cached_tokens) == (1, 1, reuse)
    assert st.prefix_entries == 1 and st.prefix_bytes == len(p2) + 5
    assert pipe.dropped == []  # the first sequence became the second


def test_a_prompt_that_parts_ways_rewinds_the_cache(made: list) -> None:
    pipe = FakePipeline()
    s = sched(made, pipe, cache_bytes=BIG)
    base = tuple(range(30, 50))
    (evs,) = run(s, [request(base, 4)])
    other = (*base[:12], 99, 98, 97)
    (evs,) = run(s, [request(other, 5)])
    assert tokens_of(evs) == alone(other, 5)
    assert finished(evs).n_cached == 12


def test_the_same_prompt_again_computes_its_last_token(made: list) -> None:
    pipe = FakePipeline()
    s = sched(made, pipe, cache_bytes=BIG)
    p = tuple(range(1, 10))
    first = tokens_of(run(s, [request(p, 3)])[0])
    (evs,) = run(s, [request(p, 3)])
    assert tokens_of(evs) == first == alone(p, 3)
    assert finished(evs).n_cached == len(p) - 1
    assert pipe.sent[-3].chunks[0].n == 1  # the prompt's last token, for its logits


def test_cache_off_reuses_nothing(made: list) -> None:
    pipe = FakePipeline()
    s = sched(made, pipe, cache_bytes=0)
    p = tuple(range(1, 10))
    run(s, [request(p, 3)])
    (evs,) = run(s, [request((*p, 7, 7), 3)])
    assert finished(evs).n_cached == 0 and s.stats.prefix_hits == 0
    assert pipe.dropped == [1, 2]  # each freed when it ended
    assert all(c.pos == -1 for b in pipe.sent for c in b.chunks)


def test_the_budget_keeps_the_most_recently_used(made: list) -> None:
    pipe = FakePipeline()
    s = sched(made, pipe, cache_bytes=30)  # two 14-position sequences fit, not three
    prompts = [tuple(range(k * 100, k * 100 + 10)) for k in range(3)]
    for p in prompts:
        run(s, [request(p, 5)])  # each holds 10 + 4 positions
    assert s.stats.prefix_entries == 2 and pipe.dropped == [1]
    (evs,) = run(s, [request((*prompts[0], 1), 2)])
    assert finished(evs).n_cached == 0  # evicted
    (evs,) = run(s, [request((*prompts[2], 1), 2)])
    assert finished(evs).n_cached == 10
    big = tuple(range(500, 540))  # over the whole budget alone: not kept
    sink = QueueSink()
    stream = s.submit(request(big, 2), sink)
    events(sink)
    assert pipe.dropped[-1] == stream.seq_id and s.stats.prefix_entries == 2


def test_a_short_common_prefix_is_not_reused(made: list) -> None:
    pipe = FakePipeline()
    s = sched(made, pipe, cache_bytes=BIG)
    run(s, [request((1, 2, 3, 4, 5, 6), 2)])
    (evs,) = run(s, [request((1, 2, 3, 9, 9, 9), 2)])
    assert MIN_REUSE > 3 and finished(evs).n_cached == 0


def test_an_adapter_only_reuses_its_own_prefixes(made: list) -> None:
    pipe = FakePipeline()
    s = sched(made, pipe, cache_bytes=BIG)
    p = tuple(range(1, 12))
    run(s, [request(p, 2, lora=0)])
    (evs,) = run(s, [request((*p, 5), 2, lora=-1)])
    assert finished(evs).n_cached == 0
    (evs,) = run(s, [request((*p, 5), 2, lora=0)])
    assert finished(evs).n_cached == len(p)


def test_a_failed_sequence_is_not_kept(made: list) -> None:
    pipe = FakePipeline()
    s = sched(made, pipe, cache_bytes=BIG)
    pipe.fail_if = lambda sent: NodeError("gone") if len(sent.ids) == 1 else None
    sink = QueueSink()
    s.submit(request(tuple(range(1, 9)), 4), sink)
    assert isinstance(events(sink)[-1], Failed)
    assert s.stats.prefix_entries == 0 and pipe.dropped == [1]


def test_chats_in_flight_over_a_pipelined_pool(made: list) -> None:
    """Three conversations at once over a pipeline that holds batches in flight (released in a
    random order that keeps each sequence's batches in order): every turn gives exactly the
    tokens of its whole history computed alone."""
    pipe = FakePipeline(depth=2, hold=True)
    s = sched(made, pipe, n_batch=3, cache_bytes=BIG)
    rel = Releaser(pipe, seed=3)
    try:
        hist = [tuple(range(k * 50, k * 50 + 7)) for k in range(3)]
        for turn in range(3):
            got = run(s, [request(h, 4) for h in hist])
            for k, evs in enumerate(got):
                assert tokens_of(evs) == alone(hist[k], 4)
                assert finished(evs).n_cached == (0 if turn == 0 else len(hist[k]) - 3)
            hist = [(*h, *tokens_of(e), 70 + turn, 71) for h, e in zip(hist, got, strict=True)]
    finally:
        rel.stop()


def test_prefix_cache_bookkeeping() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([], [1]) == 0
    c = PrefixCache(100, 2)
    assert c.put(1, range(10), None) == []
    assert c.put(2, range(30), None) == []
    assert c.nbytes == 80 and c.entries == 2
    assert c.put(3, range(20), None) == [1]  # LRU out
    hit = c.take([*range(25), 7], None)
    assert hit is not None and (hit.entry.seq_id, hit.reuse) == (2, 25)
    assert c.entries == 1 and c.clear() == [3]
    assert PrefixCache(0, 2).put(5, range(3), None) == [5]


def test_a_shared_system_prompt_is_copied_and_stays_cached(made: list) -> None:
    """Requests that share only a long system prompt with a cached conversation each copy that
    part (a fork: the cached sequence stays for the next one), and give their own tokens."""
    pipe = FakePipeline()
    s = sched(made, pipe, cache_bytes=BIG)
    system = tuple(range(200, 230))
    first = (*system, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20)
    run(s, [request(first, 12)])  # an entry of 30 + 20 + 11 positions
    asks = [(*system, 40 + k, 41, 42) for k in range(3)]
    got = run(s, [request(a, 5) for a in asks])
    for a, evs in zip(asks, got, strict=True):
        assert tokens_of(evs) == alone(a, 5)
        assert finished(evs).n_cached == len(system)
    forks = [c for b in pipe.sent for c in b.chunks if c.fork is not None]
    # (one that comes after another ended may take that one over: it keeps most of it)
    assert forks and all(c.pos == len(system) and c.fork == 1 for c in forks)
    # the first conversation is still cached: its next turn reuses all of it
    (evs,) = run(s, [request((*first, *alone(first, 12), 9), 2)])
    assert finished(evs).n_cached == len(first) + 11 and s.stats.prefix_hits == 4


def test_a_fork_in_flight_completes(made: list) -> None:
    pipe = FakePipeline(hold=True)
    s = sched(made, pipe, cache_bytes=60)
    system = tuple(range(300, 320))
    rel = Releaser(pipe, seed=1)
    try:
        run(s, [request((*system, *range(1, 30)), 2)])  # 49 + 1 positions: alone in the budget
    finally:
        rel.stop()
    sink = QueueSink()
    s.submit(request((*system, 77, 78), 3), sink)  # forks the 20 positions...
    pipe.wait_held(1)
    assert pipe.in_flight[0].chunks[0].fork is not None  # (its source pinned meanwhile)
    assert s.stats.prefix_entries == 1 and pipe.dropped == []
    pipe.hold = False
    pipe.release()
    assert tokens_of(events(sink)) == alone((*system, 77, 78), 3)
    assert pipe.misuse == []


def test_a_pinned_entry_is_never_evicted() -> None:
    c = PrefixCache(100, 1)
    c.put(1, range(50), None)
    hit = c.take([*range(10), 99, 98], None)
    assert hit is not None and hit.fork and hit.reuse == 10 and c.entries == 1
    assert c.put(2, range(500, 560), None) == [2]  # over the budget: not the pinned one
    assert c.unpin(1) == []
    assert c.put(3, range(600, 660), None) == [1]  # unpinned: least recently used goes
    # an entry a fork copies from now is copied again rather than taken over
    assert c.take([*range(600, 620), 1], None).fork  # type: ignore[union-attr]
    again = c.take(list(range(600, 660)), None)
    assert again is not None and again.fork and c.entries == 1


def test_a_hybrids_entry_is_reused_from_its_end_or_its_checkpoint_only() -> None:
    """With a recurrent state (state_bytes > 0) an entry serves a prompt up to its end or its
    checkpoint (the end of its last prompt), never from a position between: a prompt that
    parts ways elsewhere takes the furthest of those two it keeps, or misses."""
    cache = PrefixCache(1 << 20, bytes_per_token=1, state_bytes=100)
    ids = list(range(100, 130))  # prompt 100..119 (checkpoint at 20), answer 120..129
    assert cache.put(1, ids, None, mark=20) == []
    assert cache.nbytes == 30 + 100
    hit = cache.take([*ids, 7, 8], None)  # the next turn: all of it
    assert hit is not None and (hit.entry.seq_id, hit.reuse, hit.fork) == (1, 30, False)
    cache.put(1, ids, None, mark=20)
    hit = cache.take([*ids[:25], 7, 8], None)  # parts ways in the answer: its checkpoint
    assert hit is not None and hit.reuse == 20 and not hit.fork
    cache.put(1, ids, None, mark=20)
    assert cache.take([*ids[:15], 7, 8], None) is None  # before the checkpoint: nothing
    assert cache.take([*ids[:12], 7], None) is None
    plain = PrefixCache(1 << 20, bytes_per_token=1)  # (without a recurrent state: 15 of them)
    plain.put(1, ids, None)
    hit = plain.take([*ids[:15], 7, 8], None)
    assert hit is not None and hit.reuse == 15


def test_a_hybrid_marks_each_prompts_end(made: list) -> None:
    """The scheduler marks one id before every prompt's end (a checkpoint on the stages; the last
    id goes alone) when the model has a recurrent state and the cache is on; never otherwise."""
    for state, budget, marked in ((100, BIG, True), (0, BIG, False), (100, 0, False)):
        pipe = FakePipeline()
        model = FakeModel(pipe, 256)
        model.state_bytes = state  # type: ignore[misc]
        s = Scheduler(model, SchedulerConfig(cache_bytes=budget, n_batch=4))
        made.append((s, pipe))
        run(s, [request(tuple(range(10, 20)), 3)])
        marks = [c.mark for b in pipe.sent for c in b.chunks]
        assert sum(marks) == (1 if marked else 0)
        if marked:  # one id before the prompt's end (10 ids in batches of 4: 18 alone, then 19)
            (last,) = [b for b in pipe.sent if any(c.mark for c in b.chunks)]
            assert last.ids == (18,) and pipe.sent[pipe.sent.index(last) + 1].ids == (19,)
