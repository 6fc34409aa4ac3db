"""Polling for the next frame (transport/spin.py): the rules that
keep it from taking a core away from compute. Real pipes, sockets and threads."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from potluck.transport import potluck_pb2 as pb
from potluck.transport import spin
from potluck.transport.auth import PoolAuth
from potluck.transport.dataplane import DataLink, DataServer
from potluck.transport.spin import spin_wait


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
