"""The forward path's data port (transport/dataplane.py): real sockets on loopback, a real node
server, and real worker processes. Nothing is faked."""

from __future__ import annotations

import logging
import os
import random
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from potluck.engine.contract import LOCAL, Assignment
from potluck.engine.generate import generate
from potluck.errors import NodeError
from potluck.pool.build import load_model
from potluck.sampling import GREEDY, Sampler
from potluck.transport import potluck_pb2 as pb
from potluck.transport.auth import AuthError, PoolAuth
from potluck.transport.client import ForwardLink, NodeClient
from potluck.transport.codec import PROTOCOL_VERSION
from potluck.transport.dataplane import DataLink, DataServer, recv_frame, send_frame
from workers import Spawn
from workers import spawn_worker as spawn_worker

A = PoolAuth.from_secret("correct horse battery staple")
B = PoolAuth.from_secret("another pool's secret")
NONE = PoolAuth()


GATE = threading.Event()  # plan "gated": the node's connection thread waits here (a busy node)


def _echo(request: pb.ForwardRequest, answer) -> None:
    """Answers with the number of chunks; plan "later" answers from another thread after 50 ms."""
    reply = pb.ForwardReply(request_id=request.request_id, tokens=[len(request.chunks)])
    if request.plan_id == "later":
        threading.Timer(0.05, answer, args=(reply,)).start()
    elif request.plan_id == "never":
        return
    elif request.plan_id == "gated":
        GATE.wait(30)
        answer(reply)
    elif request.plan_id == "bug":
        raise ZeroDivisionError("a handler bug")
    else:
        answer(reply)


@pytest.fixture
def server() -> Iterator[tuple[DataServer, int]]:
    srv = DataServer(A, _echo)
    port = srv.listen("127.0.0.1", 0)
    yield srv, port
    srv.stop()


def _req(plan: str, n_chunks: int = 1) -> pb.ForwardRequest:
    return pb.ForwardRequest(
        plan_id=plan, chunks=[pb.SeqChunk(seq_id=i, n=1) for i in range(n_chunks)]
    )


def test_replies_match_their_requests_in_any_order(server: tuple[DataServer, int]) -> None:
    _, port = server
    link = DataLink(f"127.0.0.1:{port - 1}", port, A)
    try:
        slow = link.send(_req("later", 3))  # answered after the ones sent behind it
        fast = [link.send(_req("now", k)) for k in range(1, 40)]
        assert [list(f.result(timeout=5).tokens) for f in fast] == [[k] for k in range(1, 40)]
        assert not slow.done() or list(slow.result().tokens) == [3]
        assert list(slow.result(timeout=5).tokens) == [3]
    finally:
        link.close()


@pytest.mark.parametrize(
    ("node", "head", "says"),
    [
        (A, B, "pool secret mismatch"),
        (A, NONE, "pool secret mismatch"),
        (NONE, A, "did not prove on its data port that it knows the pool secret"),
    ],
)
def test_a_stranger_is_refused(node: PoolAuth, head: PoolAuth, says: str) -> None:
    srv = DataServer(node, _echo)
    port = srv.listen("127.0.0.1", 0)
    try:
        link = DataLink(f"127.0.0.1:{port}", port, head)
        with pytest.raises(AuthError, match=says):
            link.open()
        fut = link.send(_req("now"))  # send never raises: the future says it
        assert isinstance(fut.exception(timeout=5), AuthError)
    finally:
        srv.stop()


def _raw(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    hello = pb.DataHello()
    hello.ParseFromString(recv_frame(s, 1024) or b"")
    assert hello.protocol_version == PROTOCOL_VERSION and len(hello.nonce) == 32
    return s


def test_bad_frames_end_only_their_connection(server: tuple[DataServer, int]) -> None:
    """Oversized lengths, garbage, wrong proofs, a wrong protocol version and random bytes each
    close their own connection; the node keeps serving a proper client exactly."""
    _, port = server
    s = _raw(port)
    s.sendall(struct.pack(">I", 2**31))  # a frame far over the handshake's limit
    assert s.recv(1) == b""
    s.close()
    s = _raw(port)
    send_frame(
        s, pb.DataAuth(protocol_version=PROTOCOL_VERSION, nonce=b"x" * 32).SerializeToString()
    )
    reply = pb.DataAuthReply()
    reply.ParseFromString(recv_frame(s, 1024) or b"")
    assert reply.error == "pool secret mismatch"
    s.close()
    s = _raw(port)
    send_frame(s, pb.DataAuth(protocol_version=PROTOCOL_VERSION + 7).SerializeToString())
    reply.ParseFromString(recv_frame(s, 1024) or b"")
    assert f"protocol version {PROTOCOL_VERSION + 7}" in reply.error
    s.close()
    rng = random.Random(7)
    for _ in range(40):  # bounded fuzz of the handshake
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(rng.randbytes(rng.randrange(1, 300)))
        s.close()
    link = DataLink(f"127.0.0.1:{port}", port, A)
    try:
        assert list(link.send(_req("now", 5)).result(timeout=5).tokens) == [5]
        # an authenticated peer sending a malformed frame loses its connection, nothing else: a
        # request still waiting on it fails (sent first: sent after the break, it could go out on
        # a new connection when the reader has already seen the old one end)
        conn = link._conn
        assert conn is not None
        waiting = link.send(_req("never"))
        conn.sock.sendall(struct.pack(">I", 5) + b"\xff" * 5)
        assert isinstance(waiting.exception(timeout=5), NodeError)
        assert list(link.send(_req("now", 2)).result(timeout=5).tokens) == [2]  # reconnected
    finally:
        link.close()


def test_a_handler_bug_is_answered_and_the_connection_lives(
    server: tuple[DataServer, int], caplog: pytest.LogCaptureFixture
) -> None:
    _, port = server
    link = DataLink(f"127.0.0.1:{port}", port, A)
    try:
        with caplog.at_level(logging.ERROR, "potluck.transport"):
            err = link.send(_req("bug")).exception(timeout=5)
        assert isinstance(err, NodeError) and "internal error: a handler bug (INTERNAL)" in str(err)
        assert "forward request" in caplog.text
        conn = link._conn
        assert list(link.send(_req("now", 2)).result(timeout=5).tokens) == [2]
        assert link._conn is conn  # the same connection
    finally:
        link.close()


def test_large_frames_do_not_block_the_sender_while_the_node_is_busy(
    server: tuple[DataServer, int],
) -> None:
    """Prompt micro-batches of hidden states are large: while the node computes (here: its
    connection thread waits on a gate, reading nothing) the sender's sends return at once, so a
    stage goes on with its next micro-batch; the frames then arrive complete and in order."""
    _, port = server
    link = DataLink(f"127.0.0.1:{port}", port, A)
    big = pb.Tensor(data=bytes(4 * 2**20), shape=[2**20], dtype="float32")  # 4 MiB each
    GATE.clear()
    futures: list[Future[pb.ForwardReply]] = []

    def send_all() -> None:
        for k in range(1, 9):  # 32 MiB in all: far more than the sockets buffer
            futures.append(link.send(pb.ForwardRequest(plan_id="gated", input=big, chunks=[
                pb.SeqChunk(seq_id=i, n=1) for i in range(k)])))  # fmt: skip
        futures.append(link.send(_req("gated", 9)))  # a small one behind them keeps its place

    sender = threading.Thread(target=send_all)
    try:
        sender.start()
        sender.join(timeout=20)
        assert not sender.is_alive(), "send() blocked while the node was busy"
        assert not any(f.done() for f in futures)
    finally:
        GATE.set()
        sender.join(timeout=20)
    try:
        assert [list(f.result(timeout=30).tokens) for f in futures] == [[k] for k in range(1, 10)]
    finally:
        link.close()


def test_bounds_are_checked_before_the_handler(server: tuple[DataServer, int]) -> None:
    from potluck.transport.limits import MAX_CHUNKS

    _, port = server
    link = DataLink(f"127.0.0.1:{port}", port, A)
    try:
        err = link.send(_req("now", MAX_CHUNKS + 1)).exception(timeout=5)
        assert isinstance(err, NodeError) and "exceeds the limit" in str(err)
        assert "INVALID_ARGUMENT" in str(err)
    finally:
        link.close()


def test_a_broken_connection_fails_what_waits_and_the_next_send_reconnects() -> None:
    srv = DataServer(A, _echo)
    port = srv.listen("127.0.0.1", 0)
    link = DataLink(f"127.0.0.1:{port}", port, A)
    waiting = link.send(_req("never"))
    srv.stop()  # the node goes away with a request unanswered
    assert isinstance(waiting.exception(timeout=5), NodeError)
    assert "connection" in str(waiting.exception())
    refused = link.send(_req("now"))
    assert "cannot open its data port" in str(refused.exception(timeout=5))
    srv = DataServer(A, _echo)
    srv.listen("127.0.0.1", port)  # back on the same port
    try:
        assert list(link.send(_req("now", 4)).result(timeout=5).tokens) == [4]
        given_up: Future[pb.ForwardReply] = link.send(_req("never"))
        link.fail_all(NodeError("declared gone"))
        assert str(given_up.exception(timeout=5)) == "declared gone"
    finally:
        link.close()
        srv.stop()


def test_connections_are_bounded() -> None:
    srv = DataServer(A, _echo, max_connections=2)
    port = srv.listen("127.0.0.1", 0)
    held = [_raw(port), _raw(port)]
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        assert s.recv(4) == b""  # closed at once: no DataHello
        s.close()
    finally:
        for s in held:
            s.close()
        time.sleep(0.2)
    try:
        link = DataLink(f"127.0.0.1:{port}", port, A)
        assert list(link.send(_req("now")).result(timeout=5).tokens) == [1]
        link.close()
    finally:
        srv.stop()


def test_tls_data_port_pins_the_certificate(tmp_path: Path) -> None:
    """With --tls the data connection is TLS with the worker's certificate; the client accepts
    only the certificate the gRPC handshake pinned, and a plain client gets nowhere."""
    from potluck.transport.tls import load_or_create_identity, server_ssl_context

    own = load_or_create_identity(tmp_path / "node")
    node = PoolAuth(A.key, True, own)
    head = PoolAuth(A.key, True)
    srv = DataServer(node, _echo, tls=server_ssl_context(own))
    port = srv.listen("127.0.0.1", 0)
    try:
        link = DataLink(f"127.0.0.1:{port}", port, head, own.sha256)
        assert list(link.send(_req("now", 3)).result(timeout=5).tokens) == [3]
        assert isinstance(link._conn.sock, ssl.SSLSocket)  # type: ignore[union-attr]
        link.close()
        other = load_or_create_identity(tmp_path / "other").sha256
        with pytest.raises(AuthError, match="TLS certificate mismatch on its data port"):
            DataLink(f"127.0.0.1:{port}", port, head, other).open()
        with pytest.raises(NodeError, match="handshake on its data port"):
            DataLink(f"127.0.0.1:{port}", port, A).open()  # plain TCP to a TLS port
        with pytest.raises(ValueError, match="pinned certificate"):
            DataLink(f"127.0.0.1:{port}", port, head)
    finally:
        srv.stop()


def test_client_keeps_the_grpc_stream_when_the_data_port_is_closed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    client = NodeClient(f"127.0.0.1:{closed}", NONE)
    client.data_port = closed
    with caplog.at_level(logging.WARNING, "potluck.transport"):
        assert client.use_data_port() is False
    assert isinstance(client.link, ForwardLink)
    assert "using the slower gRPC stream instead" in caplog.text
    tls = NodeClient("127.0.0.1:1", PoolAuth(key=b"k" * 32, tls=True))
    tls.data_port = 2
    assert tls.use_data_port() is False  # no certificate pinned yet: no TLS data link
    client.close()
    tls.close()


# -- real workers ---------------------------------------------------------------------------------


def test_pool_over_data_ports_and_grpc_streams_equals_one_process(
    spawn_worker: Spawn, smollm2_path: Path
) -> None:
    """A head with a local first stage, a worker on its data port and one with --no-data-port
    (hidden states then travel on gRPC streams): the same greedy tokens as one process, and each
    link is the one it should be."""
    fast, slow = spawn_worker("--data-port", "0"), spawn_worker("--no-data-port")
    assert fast.data_port > 0 and slow.data_port == 0
    single = load_model(smollm2_path, n_ctx=256)
    ids = single.tokenizer.encode("The three primary colours are")
    want = list(generate(single, ids, 12, Sampler(GREEDY)))
    n = single.hp.n_layer
    pool = load_model(
        smollm2_path,
        n_ctx=256,
        assignments=[
            Assignment(LOCAL, 0, 10),
            Assignment(fast.address, 10, 20),
            Assignment(slow.address, 20, n),
        ],
    )
    clients = pool.pipeline.inner.clients  # type: ignore[attr-defined]
    assert isinstance(clients[0].link, DataLink)
    assert clients[0].data_port == fast.data_port
    assert isinstance(clients[1].link, ForwardLink)
    assert list(generate(pool, ids, 12, Sampler(GREEDY))) == want
    # logits of every row (perplexity) relayed back through the middle worker: exact
    import numpy as np

    from potluck.model.stage import SeqChunk

    rows = np.arange(len(ids))
    got = pool.pipeline.forward(np.array(ids), [SeqChunk(901, len(ids))], rows)
    ref = single.pipeline.forward(np.array(ids), [SeqChunk(901, len(ids))], rows)
    assert got.shape == (len(ids), single.hp.n_vocab) and np.array_equal(got, ref)
    pool.close()


def test_tls_worker_computes_over_its_tls_data_port(
    spawn_worker: Spawn, smollm2_path: Path, tmp_path: Path
) -> None:
    secret = "tls data port test secret"
    env_config = str(tmp_path / "config")
    w = spawn_worker("--tls", secret=secret, env={"POTLUCK_CONFIG": env_config})
    addr, data = w.address, w.data_port
    assert data > 0
    auth = PoolAuth.from_secret(secret, tls=True)
    n = load_model(smollm2_path, n_ctx=64).hp.n_layer
    pool = load_model(smollm2_path, n_ctx=256, assignments=[Assignment(addr, 0, n)], auth=auth)
    link = pool.pipeline.inner.clients[0].link  # type: ignore[attr-defined]
    assert isinstance(link, DataLink) and link.cert_sha256
    single = load_model(smollm2_path, n_ctx=256)
    ids = single.tokenizer.encode("The moon orbits")
    assert list(generate(pool, ids, 6, Sampler(GREEDY))) == list(
        generate(single, ids, 6, Sampler(GREEDY))
    )
    assert isinstance(link._conn.sock, ssl.SSLSocket)  # type: ignore[union-attr]
    pool.close()


def test_worker_data_port_needs_the_pool_secret(spawn_worker: Spawn, smollm2_path: Path) -> None:
    """A worker with a secret: a head with the secret computes over the data port (first stage
    and last stage on the worker, token ids in and out); a stranger's data connection is refused."""
    secret = "data port test secret"
    w = spawn_worker(secret=secret)
    addr, data = w.address, w.data_port
    auth = PoolAuth.from_secret(secret)
    n = load_model(smollm2_path, n_ctx=64).hp.n_layer
    pool = load_model(smollm2_path, n_ctx=256, assignments=[Assignment(addr, 0, n)], auth=auth)
    assert isinstance(pool.pipeline.inner.clients[0].link, DataLink)  # type: ignore[attr-defined]
    single = load_model(smollm2_path, n_ctx=256)
    ids = single.tokenizer.encode("Water boils at")
    assert list(generate(pool, ids, 6, Sampler(GREEDY))) == list(
        generate(single, ids, 6, Sampler(GREEDY))
    )
    pool.close()
    with pytest.raises(AuthError, match="pool secret mismatch"):
        DataLink(addr, data, B).open()
    with pytest.raises(AuthError, match="pool secret mismatch"):
        DataLink(addr, data, NONE).open()
    stranger = DataLink(addr, data, B)
    assert isinstance(stranger.send(_req("x")).exception(timeout=10), AuthError)
    assert w.alive()


def test_doctor_warns_when_the_data_port_is_closed() -> None:
    """`potluck doctor`: a worker's data port that cannot be reached is a warning (the pool still
    works, over the slower gRPC stream) with the command that opens it; an open one is ok."""
    from potluck.discovery.doctor import OK, WARN, _data_port_check
    from potluck.discovery.static import Peer

    srv = DataServer(A, _echo)
    port = srv.listen("127.0.0.1", 0)
    peer = Peer(f"127.0.0.1:{port - 1}", "--peer")
    try:
        ok = _data_port_check(peer, port, 2.0)
        assert ok.status == OK and f"data port {port} open" in ok.detail
    finally:
        srv.stop()
    closed = _data_port_check(peer, port, 2.0)  # nothing listens there any more
    assert closed.status == WARN
    assert f"data port {port} cannot be reached" in closed.detail
    assert "slower gRPC stream" in closed.detail and str(port) in closed.advice


@pytest.mark.parametrize("wire", [None, "float16", "bfloat16"])
def test_tensor_codec_round_trip(wire: str | None) -> None:
    """What crosses the wire comes back equal (floats as fp32; f16/bf16 exact on values they
    hold), in memory the array owns (a stage may write its input in place), for every dtype
    and an empty array; bf16 rounds to nearest even, as torch does."""
    import numpy as np
    import torch

    from potluck.transport.codec import tensor_from_proto, tensor_to_proto

    for src in [(np.arange(12) - 5).reshape(3, 4).astype(np.float32), np.arange(6) - 2]:
        msg = tensor_to_proto(src, wire)
        floats = src.dtype.kind == "f"
        assert msg.dtype == ((wire or "float32") if floats else "int64")
        assert list(msg.shape) == list(src.shape)
        back = tensor_from_proto(msg)
        want = src.astype(np.float32) if floats else src.astype(np.int64)
        assert back.dtype == want.dtype and np.array_equal(back, want)
        back += 1  # writable, and not a view of the message's bytes
        assert np.array_equal(tensor_from_proto(msg), want)
        empty = tensor_from_proto(tensor_to_proto(np.empty((0, 4), src.dtype), wire))
        assert empty.shape == (0, 4)
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32) * 100
    got = tensor_from_proto(tensor_to_proto(x, "bfloat16"))
    ref = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    assert np.array_equal(got, ref)


def test_a_worker_on_the_data_port_of_another_says_so(spawn_worker: Spawn) -> None:
    """Workers on one machine with consecutive ports: the second one's gRPC port is the first
    one's data port; it says what to do instead of a bare 'port taken'."""
    first = spawn_worker()
    port, data = first.port, first.data_port
    assert data == port + 1
    env = {**os.environ, "POTLUCK_MDNS": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "potluck.cli", "worker", "-p", str(port + 1), "-t", "1"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port + 1}" in done.stderr
    assert "ports two apart" in done.stderr


def test_a_second_worker_on_a_taken_port_does_not_start(spawn_worker: Spawn) -> None:
    """gRPC sets SO_REUSEPORT by default: a second worker on the same port used to start and
    share it (answering some heads in place of the first). It must fail in one line."""
    port = spawn_worker().port
    env = {**os.environ, "POTLUCK_MDNS": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "potluck.cli", "worker", "-p", str(port), "-t", "1",
         "--data-port", "0"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}: the port is taken" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_taken_data_port_given_by_hand_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "POTLUCK_MDNS": "0"}
        done = subprocess.run(
            [sys.executable, "-m", "potluck.cli", "worker", "-p", "0", "-t", "1",
             "--data-port", str(port)],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 1
    assert f"cannot listen on data port 127.0.0.1:{port}" in done.stderr
    assert "--data-port" in done.stderr and "Traceback" not in done.stderr


def test_polling_and_sleeping_workers_equal_one_process(
    spawn_worker: Spawn, smollm2_path: Path
) -> None:
    """A worker that polls its data connections between tokens (the default, here 50 ms) and one
    that sleeps at once (--spin-ms 0), with a head that only sends ids: one process's tokens."""
    polling_addr = spawn_worker("--spin-ms", "50").address
    sleeping_addr = spawn_worker("--spin-ms", "0").address
    single = load_model(smollm2_path, n_ctx=256)
    ids = single.tokenizer.encode("Rivers flow into")
    want = list(generate(single, ids, 10, Sampler(GREEDY)))
    n = single.hp.n_layer
    for first, second in ((polling_addr, sleeping_addr), (sleeping_addr, polling_addr)):
        pool = load_model(
            smollm2_path,
            n_ctx=256,
            assignments=[Assignment(first, 0, 14), Assignment(second, 14, n)],
        )
        assert list(generate(pool, ids, 10, Sampler(GREEDY))) == want
        pool.pipeline.close()  # type: ignore[attr-defined]


def test_spin_ms_out_of_range_is_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "potluck.cli", "worker", "-p", "0", "--spin-ms", "-1"],
        env={**os.environ, "POTLUCK_MDNS": "0"}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "--spin-ms must be in [0, 1000], got -1" in done.stderr
    assert "Traceback" not in done.stderr


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads CPU time from /proc")
def test_a_worker_polls_after_a_frame_only_when_asked(spawn_worker: Spawn) -> None:
    """After answering a frame, a worker with --spin-ms 1000 keeps polling its connection (CPU
    time while nothing arrives); with --spin-ms 0 it sleeps. A shared machine may give the poller
    only part of a core, so the poller is sent frames (each buys 1 s of polling) until it has
    used 0.2 s of CPU, up to 8 of them; the sleeper, sent one, uses next to none after it."""
    used = {}
    for spin in ("1000", "0"):
        w = spawn_worker("--spin-ms", spin)
        link = DataLink(w.address, w.data_port, NONE)
        try:
            time.sleep(1.0)  # the worker's start-up work is over
            before = _cpu_s(w.proc.pid)
            for _ in range(8 if spin == "1000" else 1):
                failure = link.send(_req("no such plan")).exception(timeout=10)
                assert isinstance(failure, NodeError) and "is not loaded on this node" in str(
                    failure
                )
                time.sleep(0.8)
                used[spin] = _cpu_s(w.proc.pid) - before
                if used[spin] >= 0.2:
                    break
        finally:
            link.close()
            w.stop()
    assert used["1000"] >= 0.2, used
    assert used["0"] < 0.1, used
