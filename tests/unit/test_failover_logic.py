"""FailoverPipeline's state machine against fake pipelines and node links: what a failure or a
silent node leads to (a new plan, the confirmed batches replayed, the failed ones sent again, the
epoch), PoolLostError within the timeout when the survivors cannot run the model, and failover
off. (Real workers killed and stopped mid-generation: tests/test_failover.py.)"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from potluck.engine.contract import NodeStatus
from potluck.errors import NodeError, PotluckError
from potluck.model.stage import SeqChunk
from potluck.pool.failover import MAX_RECOVERIES_IN_A_ROW, FailoverPipeline, PoolLostError
from potluck.sampling import GREEDY, Sampler

from .fakes import FakePipeline, Sent, alone

# the failover timeout when a test waits for the heartbeat to declare a silent node gone; the
# others take one long enough that a healthy node is never declared gone on a busy machine
SILENT_S, PATIENT_S = 1.0, 30.0
WAIT_S = 5.0  # the longest any outcome may take to arrive


class Connect:
    """`connect` for FailoverPipeline: records each call, returns the next pipeline given (or
    raises what it is given)."""

    def __init__(self, *results: FakePipeline | BaseException) -> None:
        self.results = list(results)
        self.calls: list[tuple[frozenset[str], int]] = []
        self.called = threading.Event()

    def __call__(self, gone: frozenset[str], epoch: int) -> FakePipeline:
        self.calls.append((gone, epoch))
        self.called.set()
        result = self.results.pop(0) if len(self.results) > 1 else self.results[0]
        if isinstance(result, BaseException):
            raise result
        return result


Make = Callable[..., FailoverPipeline]


@pytest.fixture
def make() -> Iterator[Make]:
    made: list[FailoverPipeline] = []

    def _make(first: FakePipeline, connect: Connect | None, **kw) -> FailoverPipeline:
        fo = FailoverPipeline(first, connect, kw.pop("timeout_s", PATIENT_S), **kw)
        made.append(fo)
        return fo

    yield _make
    for fo in made:
        fo.close()


PROMPT = (3, 1, 4, 1, 5)
SAMPLERS = {1: Sampler(GREEDY)}


def prompt_step(fo: FailoverPipeline, seq_id: int = 1, prompt=PROMPT):
    return fo.submit(
        np.array(prompt, np.int64),
        [SeqChunk(seq_id, len(prompt))],
        {seq_id: Sampler(GREEDY)},
        {seq_id: list(prompt)},
    )


def decode_step(fo: FailoverPipeline, token: int, seq_id: int = 1):
    return fo.submit(np.array([token], np.int64), [SeqChunk(seq_id, 1)], SAMPLERS, {})


def replay(ids: tuple[int, ...], *chunks: SeqChunk) -> Sent:
    """A batch as the replay sends it: the same ids and chunks, nothing sampled."""
    return Sent(ids, chunks, frozenset())


def test_a_failed_batch_fails_over_replays_and_is_sent_again(make: Make) -> None:
    """Node b stops answering and a batch fails: the survivors are connected (epoch 1, b gone),
    the confirmed batches of the live sequences are replayed in order with their shapes, the
    failed batch is sent again, and the caller only sees the right token."""
    first, second = FakePipeline(["a:1", "b:2"]), FakePipeline(["a:1"])
    connect = Connect(second)
    fo = make(first, connect)
    want = alone(PROMPT, 3)
    assert prompt_step(fo).result(WAIT_S) == want[:1]
    assert decode_step(fo, want[0]).result(WAIT_S) == want[1:2]
    assert prompt_step(fo, 2, (9, 9)).result(WAIT_S) == alone((9, 9), 1)
    fo.drop(2)  # a finished sequence is not replayed
    first.clients[1].down = True
    first.fail_if = lambda b: NodeError("node b:2 closed the stream")
    assert decode_step(fo, want[1]).result(WAIT_S) == want[2:3]
    assert connect.calls == [(frozenset({"b:2"}), 1)]
    assert fo.epoch == 1 and fo.gone == {"b:2"} and fo.inner is second
    assert first.abandoned and not first.closed
    assert second.sent == [
        replay(PROMPT, SeqChunk(1, 5)),
        replay((want[0],), SeqChunk(1, 1)),
        Sent((want[1],), (SeqChunk(1, 1),), frozenset({1})),  # the failed batch, again
    ]
    assert second.caches == {1: [*PROMPT, *want[:2]]}
    (event,) = fo.events
    assert event.gone == ("b:2",) and event.replayed_tokens == 6
    assert event.assignments == ("layers 0–0 → a:1 (cpu)",)
    # later steps go to the new plan
    assert decode_step(fo, want[2]).result(WAIT_S) == alone(PROMPT, 4)[3:]
    assert len(first.sent) == 4 and len(second.sent) == 4


def test_a_silent_node_is_declared_gone_with_nothing_in_flight(make: Make) -> None:
    """No batch fails: the heartbeat finds node a silent for the timeout and recovers at once,
    so the next request finds the caches rebuilt on the survivors."""
    first, second = FakePipeline(["a:1", "b:2"], plan_id="p1"), FakePipeline(["b:2"])
    recovered = threading.Event()
    connect = Connect(second)
    fo = make(first, connect, on_event=lambda e: recovered.set(), timeout_s=SILENT_S)
    want = alone(PROMPT, 2)
    assert prompt_step(fo).result(WAIT_S) == want[:1]
    assert first.clients[0].pinged.wait(WAIT_S)
    # the heartbeat names the plan (the nodes keep it while this head is idle)
    assert first.clients[0].hellos[-1] == ("head", ("p1",))
    # what the dashboard shows comes from those Hellos: names, memory, and who answers
    assert fo.node_status["a:1"] == NodeStatus("box-a:1", 8 << 30, True)
    first.clients[0].down = True
    assert recovered.wait(WAIT_S)
    assert connect.calls == [(frozenset({"a:1"}), 1)]
    assert set(fo.node_status) == {"b:2"}  # the new plan's nodes
    assert "did not answer" in fo.events[0].reason
    assert second.caches == {1: list(PROMPT)}
    assert decode_step(fo, want[0]).result(WAIT_S) == want[1:]
    assert second.caches == {1: [*PROMPT, want[0]]}


def test_a_hung_node_fails_the_batches_in_flight_over(make: Make) -> None:
    """A batch waits on a node that went silent: within the timeout the heartbeat fails it on the
    old plan, and it is sent again on the new one (a pause, not an error)."""
    first = FakePipeline(["a:1", "b:2"], hold=True)
    second = FakePipeline(["a:1"])
    fo = make(first, Connect(second), timeout_s=SILENT_S)
    fut = prompt_step(fo)
    first.wait_held(1)
    first.clients[1].down = True
    assert fut.result(WAIT_S) == alone(PROMPT, 1)
    assert fo.epoch == 1 and first.in_flight == []
    assert second.sent == [Sent(PROMPT, (SeqChunk(1, 5),), frozenset({1}))]  # nothing to replay


def test_a_follow_up_step_is_replayed_with_the_ids_it_followed(make: Make) -> None:
    """submit_next sent before its input token is known: once done, the replay sends that step
    with the token it followed."""
    first = FakePipeline(["a:1", "b:2"], chains=True, hold=True)
    second = FakePipeline(["a:1"], chains=True)
    fo = make(first, Connect(second))
    want = alone(PROMPT, 3)
    prev = prompt_step(fo)
    nxt = fo.submit_next(prev, [SeqChunk(1, 1)], SAMPLERS, {1: list(PROMPT)})
    first.wait_held(1)
    first.release(1)  # the prompt
    first.wait_held(1)
    first.release(1)  # the follow-up, submitted once the prompt's token was known
    assert prev.result(WAIT_S) == want[:1] and nxt.result(WAIT_S) == want[1:2]
    first.clients[1].down = True
    first.fail_if = lambda b: NodeError("node b:2 went away")
    first.hold = False
    assert decode_step(fo, want[1]).result(WAIT_S) == want[2:]
    assert second.sent[:2] == [
        replay(PROMPT, SeqChunk(1, 5)),
        replay((want[0],), SeqChunk(1, 1)),
    ]


def test_a_follow_up_after_a_stop_id_computes_nothing(make: Make) -> None:
    first = FakePipeline(["a:1"], chains=True)
    fo = make(first, Connect(FakePipeline(["a:1"])))
    prev = prompt_step(fo)
    stop = alone(PROMPT, 1)[0]
    nxt = fo.submit_next(prev, [SeqChunk(1, 1)], SAMPLERS, {1: list(PROMPT)}, {stop})
    assert nxt.result(WAIT_S) == []
    assert len(first.sent) == 1


def test_pool_lost_when_the_survivors_cannot_run_the_model(make: Make) -> None:
    """connect fails (the rest cannot hold the model): the waiting batch and every later call
    end with PoolLostError naming why, within the wait; nothing hangs."""
    first = FakePipeline(["a:1", "b:2"], hold=True)
    connect = Connect(PotluckError("the model needs 2.0 GiB; the nodes have 1.0 GiB"))
    fo = make(first, connect, timeout_s=SILENT_S)
    fut = prompt_step(fo)
    first.wait_held(1)
    first.clients[0].down = True
    with pytest.raises(PoolLostError, match=r"a:1 went away .* cannot run the model: the model"):
        fut.result(WAIT_S)
    with pytest.raises(PoolLostError):
        prompt_step(fo).result(WAIT_S)
    with pytest.raises(PoolLostError):
        fo.forward(np.array(PROMPT, np.int64), [SeqChunk(1, 5)])
    assert connect.calls == [(frozenset({"a:1"}), 1)]


def test_nodes_that_keep_failing_during_recovery_lose_the_pool(make: Make) -> None:
    """Every new plan fails its replay: after MAX_RECOVERIES_IN_A_ROW attempts, PoolLostError."""
    first = FakePipeline(["a:1", "b:2"])
    broken = FakePipeline(["a:1"])
    broken.fail_if = lambda b: NodeError("node a:1 closed the stream")
    connect = Connect(broken)
    fo = make(first, connect)
    prompt_step(fo).result(WAIT_S)
    first.fail_if = lambda b: NodeError("node b:2 closed the stream")
    first.clients[1].down = True
    with pytest.raises(PoolLostError, match="kept failing while recovering"):
        decode_step(fo, 1).result(WAIT_S)
    assert [epoch for _, epoch in connect.calls] == list(range(1, MAX_RECOVERIES_IN_A_ROW + 1))
    assert fo._closed.is_set()  # nothing left to watch: the heartbeat stops


def test_failover_off_passes_on_an_answering_nodes_own_error(make: Make) -> None:
    """Without connect, a batch refused by a node that still answers fails with that error, and
    the pool goes on."""
    first = FakePipeline(["a:1", "b:2"])
    fo = make(first, None)
    first.fail_if = lambda b: NodeError("node b:2 refused the plan")
    with pytest.raises(NodeError, match=r"refused the plan \(failover is off") as err:
        prompt_step(fo).result(WAIT_S)
    assert not isinstance(err.value, PoolLostError)
    first.fail_if = None
    assert prompt_step(fo).result(WAIT_S) == alone(PROMPT, 1)
    assert fo.epoch == 0 and not first.abandoned


def test_failover_off_a_silent_node_ends_the_request(make: Make) -> None:
    """Without connect, a node silent for the timeout ends the waiting batch and every later call
    with PoolLostError (a hung machine never hangs the head)."""
    first = FakePipeline(["a:1", "b:2"], hold=True)
    fo = make(first, None, timeout_s=SILENT_S)
    fut = prompt_step(fo)
    first.wait_held(1)
    first.clients[1].down = True
    with pytest.raises(PoolLostError, match=r"b:2 went away .* failover is off"):
        fut.result(WAIT_S)
    with pytest.raises(PoolLostError):
        prompt_step(fo).result(WAIT_S)
    assert first.in_flight == []
    # the pool is let go as a failover lets the old plan go: hung up without a goodbye to a node
    # that may hang, nothing watched any more
    assert fo._closed.wait(WAIT_S) and first.abandoned
    assert not fo.node_status["b:2"].ok  # the dashboard shows it as not answering
    fo.close()
    assert not first.closed


def test_close_lets_the_pool_go_once(make: Make) -> None:
    first = FakePipeline(["a:1"])
    fo = make(first, Connect(FakePipeline(["a:1"])))
    with pytest.raises(ValueError, match="must be positive"):
        FailoverPipeline(first, None, 0.0)
    fo.close()
    assert first.closed and not first.abandoned
    first.closed = False
    fo.close()
    assert not first.closed  # once only


def test_a_dead_node_the_heartbeat_never_watched_is_found_without_a_last_answer(
    make: Make,
) -> None:
    """_find_dead on a pipeline whose nodes the heartbeat has not watched yet (the health table
    still holds another pipeline's nodes, as right after a re-plan): the node that does not
    answer is named, with no time of a last answer (0), instead of min() of nothing raising."""
    first = FakePipeline(["a:1"])
    fo = make(first, None)
    fresh = FakePipeline(["c:3", "d:4"])
    fresh.clients[1].down = True
    dead, reason, last = fo._find_dead(fresh)  # type: ignore[arg-type]
    assert dead == ["d:4"] and "d:4 is unreachable" in reason and last == 0.0


def test_rewound_and_forked_sequences_are_replayed_as_the_stages_held_them(make: Make) -> None:
    """A sequence rewound into its prompt (a cached prefix reused in part) and one forked from
    another's prefix: after a failover the new plan's caches hold exactly what the old one's
    did, and the tokens go on as without the fault."""
    first, second = FakePipeline(["a:1", "b:2"]), FakePipeline(["a:1"])
    connect = Connect(second)
    fo = make(first, connect)
    long = (3, 1, 4, 1, 5, 9, 2, 6)
    assert prompt_step(fo, 1, long).result(WAIT_S) == alone(long, 1)
    # sequence 1 rewound to its first 3 positions, then 2 new ids
    new = (*long[:3], 7, 7)
    step = fo.submit(np.array([7, 7]), [SeqChunk(1, 2, pos=3)], SAMPLERS, {})
    assert step.result(WAIT_S) == alone(new, 1)
    # sequence 2 forks sequence 1's first 4 positions and adds one id
    fork = (*new[:4], 8)
    samplers = {2: Sampler(GREEDY)}
    step = fo.submit(np.array([8]), [SeqChunk(2, 1, pos=4, fork=1)], samplers, {})
    assert step.result(WAIT_S) == alone(fork, 1)
    assert first.caches == {1: list(new), 2: list(fork)} and first.misuse == []
    first.clients[1].down = True
    first.fail_if = lambda b: NodeError("node b:2 closed the stream")
    two = {2: Sampler(GREEDY)}
    assert fo.submit(np.array([5]), [SeqChunk(2, 1)], two, {}).result(WAIT_S) == alone(
        (*fork, 5), 1
    )
    assert second.caches == {1: list(new), 2: [*fork, 5]} and second.misuse == []
    assert fo.events[0].replayed_tokens == len(new) + len(fork)
    fo.drop(1)  # the fork's own batches do not depend on the source's
    assert fo.submit(np.array([6]), [SeqChunk(2, 1)], two, {}).result(WAIT_S) == alone(
        (*fork, 5, 6), 1
    )
