"""Polling for the next frame (transport/spin.py): the rules that
keep it from taking a core away from compute. Real pipes, sockets and threads. And a pool whose
processes lack the POSIX-only calls (as on Windows) computes what one process does."""

from __future__ import annotations

import functools
import json
import os
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from potluck.transport import potluck_pb2 as pb
from potluck.transport import spin
from potluck.transport.auth import PoolAuth
from potluck.transport.dataplane import DataLink, DataServer
from potluck.transport.spin import spin_wait
from workers import Spawn
from workers import spawn_worker as spawn_worker


@pytest.fixture
def pipe():
    r, w = os.pipe()
    yield r, w
    os.close(r)
    os.close(w)


def test_returns_when_readable_or_when_the_budget_ends(pipe) -> None:
    r, w = pipe
    t = time.perf_counter()
    assert spin.spin_readable(r, 0.05) is False
    assert time.perf_counter() - t >= 0.045
    threading.Timer(0.05, os.write, args=(w, b"x")).start()
    t = time.perf_counter()
    assert spin.spin_readable(r, 5.0) is True  # the GIL is free: the timer thread ran
    assert time.perf_counter() - t < 4.0
    assert spin.spin_readable(r, 0.0) is False  # no budget: no polling at all


def test_one_thread_per_process_and_never_during_compute(pipe) -> None:
    r, w = pipe
    r2, w2 = os.pipe()
    try:
        with ThreadPoolExecutor(1) as ex:
            first = ex.submit(spin.spin_readable, r, 10.0)
            time.sleep(0.1)  # the first thread is polling now
            t = time.perf_counter()
            assert spin.spin_readable(r2, 10.0) is False  # another thread polls: block instead
            assert time.perf_counter() - t < 1.0
            with spin.computing():  # a stage starts: the polling thread stops at once
                assert first.result(timeout=5) is False
                t = time.perf_counter()
                assert spin.spin_readable(r2, 10.0) is False
                assert time.perf_counter() - t < 1.0
            os.write(w, b"x")
            assert spin.spin_readable(r, 10.0) is True  # compute over: polling again
    finally:
        os.close(r2)
        os.close(w2)


def test_data_connections_poll_before_each_read() -> None:
    """A node's DataServer and DataLink call their wait before every frame they read, and the
    requests and replies are the same with it."""
    calls = {"server": 0, "link": 0}
    poll = spin_wait(0.02)
    assert poll is not None and spin_wait(0) is None

    def counted(side: str):
        def wait(sock) -> None:
            calls[side] += 1
            poll(sock)

        return wait

    def echo(request: pb.ForwardRequest, answer) -> None:
        answer(pb.ForwardReply(request_id=request.request_id, tokens=[request.chunks[0].n]))

    auth = PoolAuth.from_secret("correct horse battery staple")
    srv = DataServer(auth, echo, wait=counted("server"))
    port = srv.listen("127.0.0.1", 0)
    link = DataLink(f"127.0.0.1:{port}", port, auth, wait=counted("link"))
    try:
        for k in range(1, 6):
            req = pb.ForwardRequest(plan_id="p", chunks=[pb.SeqChunk(seq_id=1, n=k)])
            assert list(link.send(req).result(timeout=5).tokens) == [k]
        assert calls["server"] >= 5 and calls["link"] >= 5
    finally:
        link.close()
        srv.stop()


def test_rehearses_while_it_polls_and_only_then(pipe) -> None:
    """spin_wait's rehearse (a worker checks its last request again while it waits) runs between
    short polls until the frame comes, never once the frame is there, and never while a stage
    computes in this process (the thread then blocks at once)."""
    r, w = pipe
    calls = []

    def rehearse() -> None:
        calls.append(1)
        if len(calls) == 5:  # the frame comes during the fifth rehearsal
            os.write(w, b"x")

    wait = spin_wait(10.0, rehearse=rehearse)
    assert wait is not None

    class Fd:  # what spin_wait needs of a socket
        def fileno(self) -> int:
            return r

    # one thread per process polls: a data link another test left open may hold that turn for
    # its 20 ms budget, and then this wait returns at once (its caller blocks), so try again
    for _ in range(100):
        wait(Fd())  # type: ignore[arg-type]
        if calls:
            break
        time.sleep(0.05)
    assert len(calls) == 5  # rehearsed while nothing came; read as soon as something did
    calls.clear()
    wait(Fd())  # type: ignore[arg-type]  # readable already: read at once, no rehearsal
    assert calls == []
    os.read(r, 1)
    with spin.computing():  # a stage computes: no polling, so no rehearsal (it would block)
        wait(Fd())  # type: ignore[arg-type]
        assert calls == []


def test_without_poll_select_and_sleep_answer_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the system has no poll(2) and no sched_yield(2) (Windows), the node polls with
    select() and yields with time.sleep(0): the same answers (readable on data and on the
    stream's end, timed out otherwise)."""
    monkeypatch.delattr(select, "poll")  # (never called below: it is gone)
    monkeypatch.setattr(spin, "POLL", "select")
    monkeypatch.setattr(spin, "_yield_core", functools.partial(time.sleep, 0))
    r, w = os.pipe()
    try:
        t = time.perf_counter()
        assert spin.poll_readable(r, 0.05) == spin.TIMED_OUT
        assert time.perf_counter() - t >= 0.045
        threading.Timer(0.05, os.write, args=(w, b"x")).start()
        assert spin.poll_readable(r, 5.0) == spin.READABLE
        assert os.read(r, 1) == b"x"
        with spin.computing():
            assert spin.poll_readable(r, 5.0) == spin.NOT_POLLING
        os.close(w)
        w = -1
        assert spin.poll_readable(r, 5.0) == spin.READABLE  # the end of the stream
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


# Run first in a child process, before potluck is imported: takes away what Windows lacks on a
# worker's and a head's path, so that Linux runs the code a Windows machine runs there.
_WITHOUT_POSIX = """
import os, select, sys
del select.poll, os.sched_yield  # transport/spin.py
"""
# `potluck worker ...` (tests/workers.py starts `PREFIX python -m potluck.cli worker ...`)
_WORKER = (
    _WITHOUT_POSIX
    + """
from potluck.cli import main
assert sys.argv[1:4] == [sys.executable, "-m", "potluck.cli"], sys.argv
sys.argv = ["potluck", *sys.argv[4:]]
main()
"""
)
# a head that sends token ids to two workers, each half of the layers, over their data ports
_HEAD = (
    _WITHOUT_POSIX
    + """
import json
from potluck.engine.contract import Assignment
from potluck.engine.generate import generate
from potluck.pool.build import load_model
from potluck.sampling import GREEDY, Sampler

path, prompt, n, n_layer, first, second = sys.argv[1:]
half = int(n_layer) // 2
plan = [Assignment(first, 0, half), Assignment(second, half, int(n_layer))]
pool = load_model(path, n_ctx=256, assignments=plan)
ids = pool.tokenizer.encode(pool.chat.render([{"role": "user", "content": prompt}]))
tokens = [int(t) for t in generate(pool, ids, int(n), Sampler(GREEDY))]
links = [type(c.link).__name__ for c in pool.pipeline.clients]
pool.close()
print(json.dumps({"tokens": tokens, "links": links}))
"""
)


def test_a_pool_without_poll_and_sched_yield_equals_one_process(
    spawn_worker: Spawn, smollm2_path: Path
) -> None:
    """Two workers and a head, each a process without select.poll and os.sched_yield (Windows
    has neither): the workers poll their data connections (the head's and the one between them)
    with the fallbacks, and the tokens are one process's."""
    from potluck.engine.generate import generate
    from potluck.pool.build import load_model
    from potluck.sampling import GREEDY, Sampler

    prompt, n = "Name three planets.", 8
    single = load_model(smollm2_path, n_ctx=256)
    ids = single.tokenizer.encode(single.chat.render([{"role": "user", "content": prompt}]))
    want = list(generate(single, ids, n, Sampler(GREEDY)))
    prefix = [sys.executable, "-c", _WORKER]
    with ThreadPoolExecutor(2) as ex:  # (both start at once: a worker takes ≈ 2 s)
        workers = list(ex.map(lambda _: spawn_worker(prefix=prefix), range(2)))
    assert all(w.data_port for w in workers)
    args = [
        str(smollm2_path),
        prompt,
        str(n),
        str(single.hp.n_layer),
        *(w.address for w in workers),
    ]
    try:  # (≈ 5 s; a worker whose poll fails drops the connection, and the head waits on)
        head = subprocess.run(
            [sys.executable, "-c", _HEAD, *args], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        pytest.fail(
            "the head did not finish; the workers said:\n" + "".join(w.stop() for w in workers)
        )
    logs = [w.stop() for w in workers]
    assert head.returncode == 0, head.stderr + "".join(logs)
    for log in logs:  # (an exception in a connection's thread: the head might recover)
        assert "Traceback" not in log, log
    pooled = json.loads(head.stdout.splitlines()[-1])
    assert pooled["links"] == ["DataLink", "DataLink"]
    assert pooled["tokens"] == want
