"""Generations that survive a worker going away (pool/failover.py), with real worker processes
on loopback: SIGKILL (dead), SIGSTOP (hung, not dead), and a pool that cannot recover.

(The workers are separate OS processes on 127.0.0.1 standing in for separate machines.)
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from potluck.engine.contract import LOCAL, Assignment
from potluck.engine.generate import generate
from potluck.pool.build import load_model
from potluck.pool.failover import FailoverPipeline, PoolLostError
from potluck.sampling import GREEDY, Sampler, SamplingParams
from workers import Spawn
from workers import spawn_worker as spawn_worker

PROMPT = "Write a short poem about the sea."
N = 48  # long enough that an inexact replay (other kernels, other floats) shows
# the long generation after a failover onto this machine alone: its tokens, its context, and the
# recursion limit it runs under (a stack that grew per token would hit it within ≈ 30 tokens)
LONG_N, LONG_CTX = 120, 256


@pytest.fixture(scope="module")
def want(smollm2_path: Path) -> list[int]:
    m = load_model(smollm2_path, n_ctx=256)
    return list(generate(m, _ids(m), N, Sampler(GREEDY)))


def _ids(m) -> list[int]:
    return m.tokenizer.encode(m.chat.render([{"role": "user", "content": PROMPT}]))


def _run_with_fault(m, at: int, fault) -> list[int]:
    out = []
    for i, tok in enumerate(generate(m, _ids(m), N, Sampler(GREEDY))):
        out.append(tok)
        if i == at:
            fault()
    return out


def test_sigkill_mid_generation(spawn_worker: Spawn, smollm2_path: Path, want: list[int]) -> None:
    """This machine and three workers; the last is killed (it samples): the re-plan on this
    machine and the two left, the replay and the tokens that follow equal one process's. (A pool
    of two workers took the same steps, with one survivor fewer: this pool covers its path.)"""
    workers = [spawn_worker() for _ in range(3)]
    m = load_model(smollm2_path, n_ctx=256, peers=[w.address for w in workers], failover_s=5.0)
    pipe = m.pipeline
    assert isinstance(pipe, FailoverPipeline)
    victim = workers[-1]
    addr = victim.address
    t0 = time.monotonic()
    got = _run_with_fault(m, 5, victim.kill)
    assert got == want
    assert len(pipe.events) == 1
    ev = pipe.events[0]
    assert ev.gone == (addr,) and ev.replayed_tokens > len(_ids(m))
    assert all(addr not in a for a in ev.assignments)
    assert time.monotonic() - t0 < 60
    # the next generation runs on the survivors without another failover
    assert list(generate(m, _ids(m), 4, Sampler(GREEDY))) == want[:4]
    assert len(pipe.events) == 1


@pytest.mark.parametrize(("victim_index", "sig"), [(0, "kill"), (1, "kill"), (0, "stop")])
def test_fault_while_steps_go_ahead(
    spawn_worker: Spawn, smollm2_path: Path, want: list[int], victim_index: int, sig: str
) -> None:
    """A plan of two nodes and no layer here: the head sends each step before the token it
    follows is back (the first node holds it until then). Killing or hanging either node loses
    none of those steps: same tokens, one failover."""
    workers = [spawn_worker(), spawn_worker()]
    n = load_model(smollm2_path, n_ctx=64).hp.n_layer
    plan = [Assignment(workers[0].address, 0, 14), Assignment(workers[1].address, 14, n)]
    m = load_model(smollm2_path, n_ctx=256, assignments=plan, failover_s=2.0)
    pipe = m.pipeline
    assert isinstance(pipe, FailoverPipeline) and pipe.chains
    victim = workers[victim_index]
    fault = victim.kill if sig == "kill" else victim.pause
    assert _run_with_fault(m, 6, fault) == want
    assert len(pipe.events) == 1 and pipe.events[0].gone == (victim.address,)
    assert list(generate(m, _ids(m), 4, Sampler(GREEDY))) == want[:4]


def test_sigstop_hung_worker(spawn_worker: Spawn, smollm2_path: Path, want: list[int]) -> None:
    """A stopped process keeps its sockets open: only the heartbeat can tell it is gone."""
    workers = [spawn_worker(), spawn_worker()]
    timeout = 2.0
    m = load_model(smollm2_path, n_ctx=256, peers=[w.address for w in workers], failover_s=timeout)
    pipe = m.pipeline
    victim = workers[0]
    addr = victim.address
    stopped_at = []

    def stop() -> None:
        victim.pause()
        stopped_at.append(time.monotonic())

    got = _run_with_fault(m, 3, stop)
    assert got == want
    ev = pipe.events[0]
    assert ev.gone == (addr,) and "did not answer for" in ev.reason
    assert ev.detect_s <= timeout + 1.0, ev


def test_unrecoverable_pool_fails_fast_with_a_clear_error(
    spawn_worker: Spawn, smollm2_path: Path
) -> None:
    """When the survivors cannot hold the model, the waiting request ends with PoolLostError
    within the timeout. (The re-plan here is the real planner told that this machine has no
    memory to spare: standing in for a head too small for the model.)"""
    from potluck.model.archs import hparams_from_metadata
    from potluck.modelfile.gguf_file import GGUFFile
    from potluck.planner import NodeInfo, footprint_from_gguf, plan_pool

    victim = spawn_worker()
    addr = victim.address
    f = GGUFFile(smollm2_path)
    hp = hparams_from_metadata(f.metadata)

    def replan(alive: list[str]) -> list[Assignment]:
        nodes = [NodeInfo("this machine", "cpu", 1 << 20, 1, 1e10)]
        plan = plan_pool(footprint_from_gguf(f.tensors, hp, 256), nodes, {})
        return [Assignment(LOCAL, s.start, s.stop) for s in plan.stages]

    m = load_model(
        smollm2_path, n_ctx=256, assignments=[Assignment(addr, 0, hp.n_layer)],
        failover_s=2.0, replan=replan,
    )  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(
        PoolLostError,
        match=r"127.0.0.1:\d+ went away and the machines left cannot run the model: .* short",
    ):
        _run_with_fault(m, 2, victim.kill)
    assert time.monotonic() - t0 < 10
    with pytest.raises(PoolLostError):  # and every later call, at once
        list(generate(m, _ids(m), 2, Sampler(GREEDY)))


def test_cli_run_survives_a_killed_worker(spawn_worker: Spawn, smollm2_path: Path) -> None:
    """`potluck run` over two workers; one is killed once text is flowing: same text, and the
    log says what happened."""
    import subprocess
    import sys

    args = ["run", "-m", str(smollm2_path), "--temp", "0", "-n", "40", "-c", "256", PROMPT]
    env = {**os.environ, "POTLUCK_MDNS": "0"}
    cmd = [sys.executable, "-m", "potluck.cli", *args]
    alone = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert alone.returncode == 0, alone.stderr
    workers = [spawn_worker(), spawn_worker()]
    victim, addr = workers[1], workers[1].address
    peers = ["--peer", workers[0].address, "--peer", addr, "--tensor-split", "1,1,1"]
    proc = subprocess.Popen([*cmd, *peers], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    first = os.read(proc.stdout.fileno(), 1)  # text is flowing (unbuffered: nothing is lost)
    victim.kill()
    rest, err = proc.communicate(timeout=120)
    log = err.decode()
    assert proc.returncode == 0, log
    assert (first + rest).decode() == alone.stdout
    assert f"{addr} went away" in log and "re-planned and replayed" in log
    # the re-plan keeps --tensor-split's shares for the machines left, and says where layers went
    after = log.split("re-planned and replayed")[1]
    assert "layers 0–14 → this machine (cpu)" in after and f"→ {workers[0].address} (cpu)" in after


def test_next_hop_gone_before_first_batch_with_a_secret(
    spawn_worker: Spawn, smollm2_path: Path
) -> None:
    """A middle worker whose next hop vanished before the first batch (its handshake to it fails)
    answers the batch with an error: the head gets it at once, or fails over; it never hangs."""
    from potluck.transport.auth import PoolAuth
    from potluck.transport.client import NodeError
    from potluck.transport.secret import new_secret

    secret = new_secret()
    workers = [spawn_worker(secret=secret), spawn_worker(secret=secret)]
    auth = PoolAuth.from_secret(secret)
    peers = [w.address for w in workers]
    m = load_model(smollm2_path, n_ctx=128, peers=peers, auth=auth, failover_s=None)
    workers[1].kill()
    t0 = time.monotonic()
    with pytest.raises(NodeError, match=peers[1]):
        list(generate(m, _ids(m), 2, Sampler(GREEDY)))
    assert time.monotonic() - t0 < 30


def test_failover_off_a_hung_worker_ends_the_request(
    spawn_worker: Spawn, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--failover-timeout 0 (failover_s=0): no re-plan, but a hung node (SIGSTOP: its sockets stay
    open) still ends the request with one clear error after OFF_TIMEOUT_S (2 s here), instead of
    hanging the head forever."""
    import potluck.pool.failover as failover_mod

    monkeypatch.setattr(failover_mod, "OFF_TIMEOUT_S", 2.0)
    workers = [spawn_worker(), spawn_worker()]
    m = load_model(smollm2_path, n_ctx=256, peers=[w.address for w in workers], failover_s=0)
    victim, addr = workers[1], workers[1].address
    t0 = time.monotonic()
    with pytest.raises(PoolLostError, match=rf"{addr} went away .* failover is off"):
        _run_with_fault(m, 2, victim.pause)
    assert time.monotonic() - t0 < 15
    assert not m.pipeline.events  # nothing was re-planned
    from potluck.cli import _failover

    assert _failover(0) == 0  # the CLI's --failover-timeout 0 is this mode, not a bare pipeline


def test_a_drop_queued_behind_the_local_stage_survives_the_hang_up(
    spawn_worker: Spawn, smollm2_path: Path
) -> None:
    """The race that ended a failover-off request with CancelledError instead of PoolLostError:
    the request's `drop` (generate's cleanup) waits in the local stage's queue while the heartbeat
    hangs up on the lost pool, which cancels what is queued. The drop must return quietly, so that
    the caller sees the pool's error. Made deterministic here: the local stage's thread is held
    busy while the drop is queued and the pipeline is abandoned."""
    import threading

    worker = spawn_worker()
    n_layer = load_model(smollm2_path, n_ctx=64).hp.n_layer
    m = load_model(
        smollm2_path, n_ctx=64, failover_s=0,
        assignments=[Assignment(LOCAL, 0, 2), Assignment(worker.address, 2, n_layer)],
    )  # fmt: skip
    inner = m.pipeline.inner
    busy, release = threading.Event(), threading.Event()

    def hold() -> None:
        busy.set()
        release.wait(30)

    inner._local_thread.submit(hold)
    assert busy.wait(30)
    errors: list[BaseException] = []

    def drop() -> None:
        try:
            m.pipeline.drop(7)
        except BaseException as e:  # noqa: BLE001 - the test reports what escaped
            errors.append(e)

    dropper = threading.Thread(target=drop)
    dropper.start()
    deadline = time.monotonic() + 30
    while inner._local_thread._work_queue.qsize() == 0:  # the drop is queued behind `hold`
        assert time.monotonic() < deadline, "the drop never reached the local stage's queue"
        time.sleep(0.01)
    m.pipeline.abandon()  # what the heartbeat does when the pool is lost
    release.set()
    dropper.join(30)
    assert not dropper.is_alive() and errors == []


def test_failover_onto_this_machine_alone_then_a_long_generation(
    spawn_worker: Spawn, smollm2_path: Path
) -> None:
    """The only worker dies early in a long generation; the re-plan puts every layer on this
    machine, where follow-up steps (sent ahead while the first stage was a node) now compute in
    this process, and generation stops chaining. 120 more tokens: the same as one process. (Those
    steps once nested a call per token and ended in RecursionError after ≈ 120 tokens;
    tests/unit/test_chain.py and tests/test_engine.py check that the chain stays flat.)"""
    victim = spawn_worker()
    addr = victim.address
    n_layer = load_model(smollm2_path, n_ctx=64).hp.n_layer
    single = load_model(smollm2_path, n_ctx=LONG_CTX)
    ids = _ids(single)
    want = list(generate(single, ids, LONG_N, Sampler(GREEDY), stop_ids=frozenset()))
    m = load_model(
        smollm2_path, n_ctx=LONG_CTX, assignments=[Assignment(addr, 0, n_layer)], failover_s=2.0,
        replan=lambda alive: [Assignment(LOCAL, 0, n_layer)],
    )  # fmt: skip
    assert m.pipeline.chains
    got = []
    for i, tok in enumerate(generate(m, ids, LONG_N, Sampler(GREEDY), stop_ids=frozenset())):
        got.append(tok)
        if i == 5:
            victim.kill()
    assert got == want
    assert len(m.pipeline.events) == 1 and not m.pipeline.chains


def test_failover_off_passes_on_an_answering_nodes_own_error(
    spawn_worker: Spawn, smollm2_path: Path
) -> None:
    """Failover off, and a node that still answers refuses a call (here its plan was freed by
    hand, as another head's Load may free an idle one): the request ends with that node's own
    error, not "went away", and the pool is not written off for later calls."""
    from potluck.transport import potluck_pb2 as pb
    from potluck.transport.client import NodeClient, NodeError

    addr = spawn_worker().address
    n_layer = load_model(smollm2_path, n_ctx=64).hp.n_layer
    m = load_model(
        smollm2_path, n_ctx=256, assignments=[Assignment(addr, 0, n_layer)], failover_s=0
    )
    assert len(list(generate(m, _ids(m), 2, Sampler(GREEDY)))) == 2
    client = NodeClient(addr)
    client.drop(pb.DropRequest(plan_id=m.pipeline.plan_id, release=True))
    client.close()
    with pytest.raises(NodeError, match=r"not loaded on this node") as err:
        list(generate(m, _ids(m), 2, Sampler(GREEDY)))
    assert "went away" not in str(err.value)
    assert m.pipeline._failed is None


def test_seeded_sampling_goes_on_exactly_after_a_failover(
    spawn_worker: Spawn, smollm2_path: Path
) -> None:
    """The last stage is killed in the middle of a seeded sampled stream: the new last stage
    draws each token's random number from the seed and the token's position (not from a stream
    of its own), so the answer is the one a run without the fault gives."""
    params = SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=21)
    single = load_model(smollm2_path, n_ctx=256)
    want = list(generate(single, _ids(single), N, Sampler(params)))
    assert want != list(generate(single, _ids(single), N, Sampler(GREEDY)))  # (sampled)
    workers = [spawn_worker(), spawn_worker()]
    n = single.hp.n_layer
    plan = [Assignment(workers[0].address, 0, 14), Assignment(workers[1].address, 14, n)]
    m = load_model(smollm2_path, n_ctx=256, assignments=plan, failover_s=2.0)
    out = []
    for i, tok in enumerate(generate(m, _ids(m), N, Sampler(params))):
        out.append(tok)
        if i == 6:
            workers[1].kill()
    assert out == want
    assert isinstance(m.pipeline, FailoverPipeline) and len(m.pipeline.events) == 1


def test_a_step_a_node_refuses_fails_that_request_not_the_pool(
    spawn_worker: Spawn, smollm2_path: Path, want: list[int]
) -> None:
    """A node that answers but refuses the step itself: the step is sent once more after a
    re-plan (which sends every sequence's settings and ids afresh), and refused again it fails
    with the node's reason instead of re-planning for ever; the pool goes on serving. (Here the
    last stage is asked to sample under a grammar from position 0 without the ids since then: it
    cannot catch its matcher up, FAILED_PRECONDITION, relayed through the first node.)"""
    import numpy as np

    from potluck.errors import StepRefused
    from potluck.grammar import Vocabulary, json_object_grammar
    from potluck.model.stage import SeqChunk

    workers = [spawn_worker(), spawn_worker()]
    plan = [Assignment(workers[0].address, 0, 14), Assignment(workers[1].address, 14, 30)]
    m = load_model(smollm2_path, n_ctx=256, assignments=plan, failover_s=2.0)
    ids = _ids(m)
    params = SamplingParams(temperature=0.0, grammar=json_object_grammar(), grammar_from=0)
    seq = m.new_seq_id()
    sampler = Sampler(params, Vocabulary.of(m.tokenizer))
    t0 = time.monotonic()
    with pytest.raises(StepRefused, match="cannot catch up") as refused:
        chunk = SeqChunk(seq, len(ids))
        fut = m.pipeline.submit(np.array(ids, np.int64), [chunk], {seq: sampler}, {})
        fut.result(timeout=60)  # (before the fix: a failover loop that never ended)
    assert refused.value.code == "FAILED_PRECONDITION"
    assert time.monotonic() - t0 < 30
    assert isinstance(m.pipeline, FailoverPipeline) and len(m.pipeline.events) <= 1
    m.pipeline.drop(seq)
    assert list(generate(m, ids, N, Sampler(GREEDY))) == want
    m.close()
