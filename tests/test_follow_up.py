"""Follow-up decode steps: over a pool whose first stage is a node, the head sends the step for
token i + 2 before token i + 1 is back, and the first node runs it as soon as it relays token
i + 1 (engine/generate.generate, RemotePipeline.submit_next, NodeService._follow_up).

Real `potluck worker` processes on loopback (standing in for separate machines); every output is
checked against one process running the whole model.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from potluck.engine.contract import Assignment
from potluck.engine.generate import generate, prefill
from potluck.pool.build import load_model
from potluck.pool.pipeline import RemotePipeline
from potluck.sampling import GREEDY, Sampler, SamplingParams
from potluck.transport import potluck_pb2 as pb
from potluck.transport.codec import sampling_to_proto, tensor_to_proto
from workers import Spawn
from workers import spawn_module_worker as spawn_module_worker
from workers import spawn_worker as spawn_worker

PROMPT = "Name three planets."


@pytest.fixture(scope="module")
def workers(spawn_module_worker: Spawn) -> list[str]:
    return [spawn_module_worker().address for _ in range(2)]


def _ids(path: Path) -> list[int]:
    m = load_model(path, n_ctx=64)
    return m.tokenizer.encode(m.chat.render([{"role": "user", "content": PROMPT}]))


def _single(
    path: Path, n: int, params: SamplingParams = GREEDY, n_ctx: int = 256, **kw: object
) -> list[int]:
    """One process's tokens: the reference. Greedy ones (at most 24, the most a test here asks
    for) are the first n of one generation of 24, made once per module run: greedy decoding is
    causal, so its first n tokens of 24 are its tokens for -n n."""
    if params == GREEDY and n_ctx == 256 and not kw and n <= 24:
        return list(_greedy_24(path)[:n])
    m = load_model(path, n_ctx=n_ctx)
    return list(generate(m, _ids(path), n, Sampler(params), **kw))  # type: ignore[arg-type]


@functools.cache
def _greedy_24(path: Path) -> tuple[int, ...]:
    m = load_model(path, n_ctx=256)
    return tuple(generate(m, _ids(path), 24, Sampler(GREEDY)))


_OPEN: list = []  # the pools this test made, closed when it ends (see `_close_pools`)


@pytest.fixture(autouse=True)
def _close_pools() -> Iterator[None]:
    """Close every pool a test made when it ends: a pool left open keeps its heartbeat pinging
    the module's workers (twice a second) and its plan loaded there, for the rest of the module;
    and an old pool whose heartbeat is answered late under load may fail over and load again on
    the workers the next test uses."""
    yield
    while _OPEN:
        _OPEN.pop().close()


def _pool(workers: list[str], path: Path, cut: int = 14, n_ctx: int = 256, **kw: object):
    n = load_model(path, n_ctx=64).hp.n_layer
    plan = [Assignment(workers[0], 0, cut), Assignment(workers[1], cut, n)]
    return _opened(load_model(path, n_ctx=n_ctx, assignments=plan, **kw))  # type: ignore[arg-type]


def _opened(pool):
    _OPEN.append(pool)
    return pool


def test_chained_greedy_equals_one_process(workers: list[str], smollm2_path: Path) -> None:
    want = _single(smollm2_path, 24)
    pool = _pool(workers, smollm2_path)
    assert pool.pipeline.chains  # the first stage is a node: steps go ahead of the tokens
    assert list(generate(pool, _ids(smollm2_path), 24, Sampler(GREEDY))) == want
    # and without failover (a bare RemotePipeline), and on a plan whose first node is also last
    bare = _pool(workers, smollm2_path, cut=20, failover_s=None)
    assert isinstance(bare.pipeline, RemotePipeline) and bare.pipeline.chains
    assert list(generate(bare, _ids(smollm2_path), 24, Sampler(GREEDY))) == want
    n = pool.hp.n_layer
    one = _opened(load_model(smollm2_path, n_ctx=256, assignments=[Assignment(workers[1], 0, n)]))
    assert list(generate(one, _ids(smollm2_path), 24, Sampler(GREEDY))) == want


def test_chained_stops_where_one_process_stops(workers: list[str], smollm2_path: Path) -> None:
    """A stop id ends the generation at the same token (the step sent ahead of it is skipped by
    the node, and the sequence is freed); so do -n and the context."""
    full = _single(smollm2_path, 24)
    pool = _pool(workers, smollm2_path)
    ids = _ids(smollm2_path)
    stop = full[9]
    cut = full.index(stop) + 1
    got = list(generate(pool, ids, 24, Sampler(GREEDY), stop_ids=frozenset({stop})))
    assert got == full[:cut]
    assert list(generate(pool, ids, 3, Sampler(GREEDY))) == full[:3]
    assert list(generate(pool, ids, 1, Sampler(GREEDY))) == full[:1]
    short = len(ids) + 5  # room for 5 tokens
    want = _single(smollm2_path, 24, n_ctx=short)
    assert len(want) == 5
    tight = _pool(workers, smollm2_path, n_ctx=short)
    assert list(generate(tight, ids, 24, Sampler(GREEDY))) == want


@pytest.mark.parametrize("last_n", [0, 1, 3])
def test_chained_penalties_see_the_token_the_node_added(
    workers: list[str], smollm2_path: Path, last_n: int
) -> None:
    """The head sends the recent ids before a step's input token; the first node adds that token
    (and keeps at most repeat_last_n): seeded sampling with penalties equals one process. The
    windows: 0 (the whole history, nothing trimmed), 1 (the head sends no recent id: the node's
    token alone), 3 (the head sends 2, the node adds its token; a history longer than the window,
    so an off-by-one in what either side keeps shows). A window longer than the history (the
    default 64 here) takes the same branches as 3 and trims nothing, so it shows less."""
    params = SamplingParams(
        temperature=1.1,
        top_k=40,
        repeat_penalty=1.3,
        presence_penalty=0.4,
        repeat_last_n=last_n,
        seed=77,
    )
    want = _single(smollm2_path, 20, params)
    pool = _pool(workers, smollm2_path)
    assert list(generate(pool, _ids(smollm2_path), 20, Sampler(params))) == want


def test_closing_a_generation_early_frees_its_sequence(
    workers: list[str], smollm2_path: Path
) -> None:
    """A caller that stops reading (Ctrl-C, a stop string) leaves a step in flight: generate waits
    for it before it drops the sequence, so nothing is left behind on the nodes."""
    pool = _pool(workers, smollm2_path, failover_s=None)
    pipe = pool.pipeline
    ids = _ids(smollm2_path)
    gen = generate(pool, ids, 50, Sampler(GREEDY))
    first = [next(gen) for _ in range(4)]
    seq = pool._next_seq  # the generation's sequence
    gen.close()
    assert first == _single(smollm2_path, 4)
    # the first node forgot the sequence: a batch at position 0 is new again, not stale
    again = pipe.clients[0].link.send(_request(pipe, seq, 0, ids)).result(timeout=30)
    assert list(again.tokens) == [first[0]]
    pipe.drop(seq)


def _request(
    pipe: RemotePipeline, seq: int, pos: int, ids: list[int], follow: bool = False
) -> pb.ForwardRequest:
    chunk = pb.SeqChunk(
        seq_id=seq, n=len(ids), pos=pos, sample=True, sampling=sampling_to_proto(GREEDY, 0)
    )
    chunk.follow = follow
    return pb.ForwardRequest(
        plan_id=pipe.plan_id,
        chunks=[chunk],
        input=tensor_to_proto(np.array(ids, np.int64)),
    )


def test_follow_up_batches_on_the_wire(workers: list[str], smollm2_path: Path) -> None:
    """The protocol itself: a follow-up batch sent before its predecessor ran waits for it and
    takes its token; one whose input would be a stop id is skipped; malformed ones are refused
    with a reason, and the node serves on."""
    pool = _pool(workers, smollm2_path, failover_s=None)
    pipe = pool.pipeline
    assert isinstance(pipe, RemotePipeline)
    ids = _ids(smollm2_path)
    want = _single(smollm2_path, 4)
    seq = pool.new_seq_id()
    assert prefill(pipe, seq, ids, Sampler(GREEDY)) == want[0]
    link = pipe.clients[0].link
    p = len(ids)
    # both sent at once: the second waits on the node for the first's token
    a = link.send(_request(pipe, seq, p, [want[0]]))
    b = link.send(_request(pipe, seq, p + 1, [0], follow=True))
    assert list(a.result(timeout=30).tokens) == [want[1]]
    assert list(b.result(timeout=30).tokens) == [want[2]]
    # the previous token already relayed: it runs at once; a stop id skips it
    stop = _request(pipe, seq, p + 2, [0], follow=True)
    stop.stop_ids.append(want[2])
    skipped = link.send(stop).result(timeout=30)
    assert skipped.skipped and list(skipped.tokens) == [-1]
    c = link.send(_request(pipe, seq, p + 2, [0], follow=True)).result(timeout=30)
    assert list(c.tokens) == [want[3]]

    def refused(req: pb.ForwardRequest, client: int = 0) -> str:
        from potluck.errors import PotluckError

        with pytest.raises(PotluckError) as err:
            pipe.clients[client].link.send(req).result(timeout=30)
        return str(err.value)

    two = _request(pipe, seq, p + 3, [0, 0], follow=True)
    assert "a follow-up batch is one chunk of one token, got [2]" in refused(two)
    other = pb.ForwardRequest()
    other.CopyFrom(_request(pipe, seq, p + 3, [0], follow=True))
    other.input.CopyFrom(tensor_to_proto(np.zeros((1, pool.hp.n_embd), np.float32)))
    assert "only the first stage takes one" in refused(other, client=1)
    dup_a = link.send(_request(pipe, seq, p + 5, [0], follow=True))
    assert "a second follow-up batch for sequence" in refused(
        _request(pipe, seq, p + 5, [0], follow=True)
    )
    # a waiting follow-up batch is answered when its sequence is dropped, not left hanging
    pipe.drop(seq)
    with pytest.raises(Exception, match="was dropped while this follow-up batch waited"):
        dup_a.result(timeout=30)
    # the node serves on
    fresh = pool.new_seq_id()
    assert prefill(pipe, fresh, ids, Sampler(GREEDY)) == want[0]
    pipe.drop(fresh)


def test_follow_up_through_the_grpc_stream(spawn_worker: Spawn, smollm2_path: Path) -> None:
    """Workers whose data port is closed (--no-data-port: the gRPC ForwardStream carries the
    forward path) take follow-up steps the same way."""
    peers = [spawn_worker("--no-data-port").address for _ in range(2)]
    want = _single(smollm2_path, 12)
    pool = _pool(peers, smollm2_path)
    assert pool.pipeline.chains
    assert list(generate(pool, _ids(smollm2_path), 12, Sampler(GREEDY))) == want


# -- the scheduler (potluck serve) ------------------------------------------------------------


def _serve(sched, reqs):
    from potluck.engine.scheduler import Finished, QueueSink, TokenEvent

    sinks = [QueueSink() for _ in reqs]
    streams = [sched.submit(r, s) for r, s in zip(reqs, sinks, strict=True)]
    out = []
    for s in sinks:
        evs = list(s.events(timeout=120))
        assert isinstance(evs[-1], Finished), evs[-1]
        out.append(([e.token for e in evs if isinstance(e, TokenEvent)], evs[-1]))
    return out, streams


def test_scheduler_chains_up_to_one_stream_per_stage(
    workers: list[str], smollm2_path: Path
) -> None:
    """`potluck serve` over a pool of two nodes: one or two streams (≤ one per stage) each get
    follow-up steps and exactly their single-process tokens; three (more than the stages) go in
    batches of several rows again, with the same tokens; a stop id and the length end them
    where one process ends them."""
    from potluck.engine.scheduler import Request, Scheduler

    single = load_model(smollm2_path, n_ctx=256)
    prompts = ["Name three planets.", "What is a cat?", "Count to five."]
    ids = [
        single.tokenizer.encode(single.chat.render([{"role": "user", "content": p}]))
        for p in prompts
    ]
    want = [list(generate(single, i, 16, Sampler(GREEDY), stop_ids=frozenset())) for i in ids]
    pool = _pool(workers, smollm2_path)
    sched = Scheduler(pool)
    try:
        got, _ = _serve(sched, [Request(tuple(ids[0]), GREEDY, 16, frozenset())])
        assert got[0][0] == want[0] and got[0][1].reason == "length"
        one = sched.stats.follow_ups
        assert one >= 12  # nearly every step after the first went ahead of its token
        got, _ = _serve(sched, [Request(tuple(i), GREEDY, 16, frozenset()) for i in ids[:2]])
        assert [t for t, _ in got] == want[:2]
        assert sched.stats.follow_ups >= one + 20
        two = sched.stats.follow_ups
        got, _ = _serve(sched, [Request(tuple(i), GREEDY, 16, frozenset()) for i in ids])
        assert [t for t, _ in got] == want
        # three streams on two stages are batched (≈ 45 follow-ups if they were chained); only
        # a stream that decodes while the others are still in their prompts may chain a few
        assert sched.stats.follow_ups - two < 24
        stop = want[0][6]
        got, _ = _serve(sched, [Request(tuple(ids[0]), GREEDY, 16, frozenset({stop}))])
        end = want[0].index(stop) + 1
        assert got[0][0] == want[0][:end] and got[0][1].reason == "stop"
    finally:
        sched.close()


def test_scheduler_cancel_during_follow_ups_frees_the_sequence(
    workers: list[str], smollm2_path: Path
) -> None:
    """A stream cancelled while a follow-up step is in flight ends as cancelled, and the nodes
    forget its sequence (a batch at position 0 is new again, not stale)."""
    from potluck.engine.scheduler import Finished, QueueSink, Request, Scheduler, TokenEvent

    pool = _pool(workers, smollm2_path, failover_s=None)
    ids = _ids(smollm2_path)
    sched = Scheduler(pool)
    try:
        sink = QueueSink()
        stream = sched.submit(Request(tuple(ids), GREEDY, 200, frozenset()), sink)
        seen = 0
        events = sink.events(timeout=120)
        for ev in events:
            if isinstance(ev, TokenEvent):
                seen += 1
                if seen == 5:
                    stream.cancel()
            if isinstance(ev, Finished):
                assert ev.reason == "cancelled" and ev.n_generated < 200
                break
        seq = pool._next_seq
        pipe = pool.pipeline
        deadline = time.monotonic() + 30
        while True:  # the drop follows the last step in flight; then position 0 is new again
            try:
                again = pipe.clients[0].link.send(_request(pipe, seq, 0, ids)).result(timeout=30)
                break
            except Exception as exc:
                assert "stale" in str(exc) and time.monotonic() < deadline, exc
                time.sleep(0.05)
        assert list(again.tokens)[0] >= 0
        pipe.drop(seq)
    finally:
        sched.close()
