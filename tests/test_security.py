"""Security of the pool with real worker processes on 127.0.0.1: the pool secret's mutual
handshake, sessions, TLS pinning, bounds on messages, and a bounded fuzz run. After every attack
the worker is still up, still serves the real head (greedy tokens equal one process's), and its
memory has not grown without bound.

(Workers are separate OS processes on loopback standing in for other machines; the non-loopback
refusal runs in a network namespace this test creates. The "machine in between" of the TLS test is
a relay in this process that shows its own certificate.)
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import re
import select
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from potluck.engine.generate import generate
from potluck.pool.build import load_model
from potluck.sampling import GREEDY, Sampler
from potluck.transport import potluck_pb2 as pb
from potluck.transport import potluck_pb2_grpc as pb_grpc
from potluck.transport.auth import (
    CHALLENGE_TTL_S,
    MAX_SESSIONS,
    SESSION_IDLE_S,
    SESSION_METADATA,
    AuthError,
    Handshakes,
    PoolAuth,
    SessionTable,
    client_proof,
    handshake,
)
from potluck.transport.client import NodeClient, NodeError
from potluck.transport.codec import PROTOCOL_VERSION
from potluck.transport.limits import MAX_CHUNKS, MAX_REQUEST_BYTES
from potluck.transport.secret import new_secret
from potluck.transport.tls import CHANNEL_TLS_OPTIONS, load_or_create_identity
from workers import Spawn, Worker
from workers import spawn_module_worker as spawn_module_worker
from workers import spawn_worker as spawn_worker

PROMPT = "Name three planets."
N_TOKENS = 6
RSS_SLACK = 200 * 2**20  # growth allowed over a whole attack (allocator caches, gRPC buffers)
MISMATCH = "rejected this head: pool secret mismatch (set the same --secret / POTLUCK_SECRET on every machine)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(spawn: Spawn, config: Path, secret: str, *extra: str) -> Worker:
    """A worker of the pool `secret` with its own config folder (its TLS certificate goes there)."""
    return spawn(*extra, secret=secret, env={"POTLUCK_CONFIG": str(config)}, timeout=90)


@pytest.fixture(scope="module")
def secret() -> str:
    return new_secret()


@pytest.fixture(scope="module")
def auth(secret: str) -> PoolAuth:
    return PoolAuth.from_secret(secret)


@pytest.fixture(scope="module")
def worker_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder the shared worker's config folder is in."""
    return tmp_path_factory.mktemp("w")


@pytest.fixture(scope="module")
def worker(spawn_module_worker: Spawn, worker_home: Path, secret: str) -> Worker:
    return _start(spawn_module_worker, worker_home / "config", secret)


@pytest.fixture(scope="module")
def want(smollm2_path: Path) -> list[int]:
    """Greedy tokens of one process: what the pool must give after every attack."""
    m = load_model(smollm2_path, n_ctx=256)
    ids = m.tokenizer.encode(m.chat.render([{"role": "user", "content": PROMPT}]))
    return list(generate(m, ids, N_TOKENS, Sampler(GREEDY)))


def _pool_tokens(path: Path, peers: list[str], auth: PoolAuth) -> tuple[list[int], object]:
    pool = load_model(path, n_ctx=256, peers=peers, auth=auth)
    ids = pool.tokenizer.encode(pool.chat.render([{"role": "user", "content": PROMPT}]))
    return list(generate(pool, ids, N_TOKENS, Sampler(GREEDY))), pool


@pytest.fixture(scope="module")
def pool(worker: Worker, auth: PoolAuth, smollm2_path: Path, want: list[int]):
    """A head holding a plan on the worker (this machine: the first layers; the worker: the rest)."""
    got, m = _pool_tokens(smollm2_path, [worker.address], auth)
    assert got == want
    return m


def _still_serving(pool, worker: Worker, want: list[int], rss_before: int) -> None:
    assert worker.alive(), worker.log[-2000:]
    ids = pool.tokenizer.encode(pool.chat.render([{"role": "user", "content": PROMPT}]))
    assert list(generate(pool, ids, N_TOKENS, Sampler(GREEDY))) == want
    grown = worker.rss() - rss_before
    assert grown < RSS_SLACK, f"worker memory grew by {grown / 2**20:.0f} MiB"


def _session_channel(address: str, auth: PoolAuth, **opts: int) -> tuple[grpc.Channel, tuple]:
    """A raw channel that has proved membership (for sending what NodeClient never would)."""
    options = [(f"grpc.{k}", v) for k, v in opts.items()]
    ch = grpc.insecure_channel(address, options=options)
    token = handshake(pb_grpc.NodeAuthStub(ch), auth, address, b"", 10.0)
    assert token
    return ch, ((SESSION_METADATA, token),)


def _own_connection(address: str) -> grpc.Channel:
    """A channel with a TCP connection of its own (gRPC shares one between equal channels)."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details() or ""


# -- the secret ------------------------------------------------------------------------------------


def _cli(*args: str, env: dict[str, str], stdin: str | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "POTLUCK_SECRET"}
    return subprocess.run(
        [sys.executable, "-m", "potluck.cli", *args], capture_output=True, text=True, timeout=120,
        env={**base, "COLUMNS": "300", **env}, input=stdin,
    )  # fmt: skip


def test_secret_command(tmp_path: Path) -> None:
    env = {"POTLUCK_CONFIG": str(tmp_path / "cfg")}
    a, b = _cli("secret", env=env), _cli("secret", env=env)
    assert a.returncode == 0 and len(a.stdout.strip()) == 43 and a.stdout != b.stdout
    assert not (tmp_path / "cfg").exists()  # printing alone keeps nothing
    saved = _cli("secret", "--save", env=env)
    path = tmp_path / "cfg" / "secret"
    assert saved.returncode == 0 and path.read_text().strip() == saved.stdout.strip()
    assert path.stat().st_mode & 0o777 == 0o600
    again = _cli("secret", "--save", env=env)
    assert again.returncode == 1 and "already holds a pool secret; pass --force" in again.stderr
    other = new_secret()
    joined = _cli("secret", "--set", "-", "--force", env=env, stdin=other + "\n")
    assert joined.returncode == 0 and path.read_text().strip() == other
    weak = _cli("secret", "--set", "hunter2", "--force", env=env)
    assert weak.returncode == 1 and "has 7 characters, fewer than 16" in weak.stderr
    path.chmod(0o644)  # others could read it: refused, as ssh does with keys
    loose = _cli("worker", "-p", str(_free_port()), env={**env, "POTLUCK_MDNS": "0"})
    assert loose.returncode == 1 and f"run `chmod 600 {path}`" in loose.stderr
    tls_alone = _cli(
        "worker", "--tls", "-p", str(_free_port()), env={"POTLUCK_CONFIG": str(tmp_path / "x")}
    )
    assert tls_alone.returncode == 1 and "--tls needs a pool secret" in tls_alone.stderr


def test_wrong_secret_and_no_secret(
    worker: Worker, pool, want: list[int], smollm2_path: Path
) -> None:
    rss = worker.rss()
    with pytest.raises(AuthError, match=re.escape(f"node {worker.address} {MISMATCH}")):
        NodeClient(worker.address, PoolAuth.from_secret(new_secret())).hello()
    with pytest.raises(AuthError, match="pool secret mismatch \\(this head has none; set the same"):
        NodeClient(worker.address).load(pb.LoadRequest())
    with pytest.raises(AuthError, match=re.escape(MISMATCH)):
        load_model(
            smollm2_path, n_ctx=256, peers=[worker.address],
            auth=PoolAuth.from_secret(new_secret()),
        )  # fmt: skip
    # Hello stays open (it says what mDNS already announces), so a doctor can name the node
    assert NodeClient(worker.address).hello(authenticate=False).protocol_version
    # the CLI says it in one line and exits 1
    done = _cli(
        "run", "-m", str(smollm2_path), "-c", "256", "-n", "2", "--peer", worker.address, "Hi",
        env={"POTLUCK_SECRET": new_secret(), "POTLUCK_MDNS": "0", "POTLUCK_CONFIG": "/nonexistent"},
    )  # fmt: skip
    assert done.returncode == 1
    assert f"error: node {worker.address} {MISMATCH}" in done.stderr
    _still_serving(pool, worker, want, rss)


def test_calls_without_a_session_are_refused_unread(
    worker: Worker, auth: PoolAuth, pool, want: list[int]
) -> None:
    """Every method but Hello and the handshake needs a session; a refused call's message is not
    even read (a 100 MiB Forward without a session costs the worker nothing)."""
    rss = worker.rss()
    stub = pb_grpc.NodeStub(
        grpc.insecure_channel(
            worker.address, options=[("grpc.max_send_message_length", 200 * 2**20)]
        )
    )
    calls = {
        "Load": lambda md: stub.Load(pb.LoadRequest(), timeout=5, metadata=md),
        "Drop": lambda md: stub.Drop(pb.DropRequest(), timeout=5, metadata=md),
        "Forward": lambda md: stub.Forward(pb.ForwardRequest(), timeout=5, metadata=md),
        "PutTensors": lambda md: stub.PutTensors(iter([pb.TensorChunk()]), timeout=5, metadata=md),
        "ForwardStream": lambda md: list(
            stub.ForwardStream(iter([pb.ForwardRequest()]), timeout=5, metadata=md)
        ),
    }
    for name, call in calls.items():
        for md in ((), ((SESSION_METADATA, "forged-token"),), ((SESSION_METADATA, ""),)):
            code, detail = _code(lambda call=call, md=md: call(md))
            assert code == grpc.StatusCode.UNAUTHENTICATED, (name, code, detail)
            assert "this node requires the pool secret" in detail
    big = pb.ForwardRequest(input=pb.Tensor(data=bytes(100 * 2**20), shape=[1], dtype="float32"))
    before = worker.rss()
    for _ in range(3):
        code, _ = _code(lambda: stub.Forward(big, timeout=30))
        assert code == grpc.StatusCode.UNAUTHENTICATED
    assert worker.rss() - before < 50 * 2**20, "the refused message was read into memory"
    _still_serving(pool, worker, want, rss)


def test_replayed_handshake_fails(worker: Worker, auth: PoolAuth, pool, want: list[int]) -> None:
    rss = worker.rss()
    key = auth.key
    assert key is not None
    ch = grpc.insecure_channel(worker.address)
    stub = pb_grpc.NodeAuthStub(ch)
    cn = os.urandom(32)
    challenge = stub.Challenge(
        pb.ChallengeRequest(protocol_version=PROTOCOL_VERSION, client_nonce=cn), timeout=5
    ).challenge
    prove = pb.ProveRequest(
        client_nonce=cn, challenge=challenge, client_proof=client_proof(key, cn, challenge, b"")
    )
    first = stub.Prove(prove, timeout=5)
    assert first.session
    # the same proof again (a recorded handshake played back): refused
    code, detail = _code(lambda: stub.Prove(prove, timeout=5))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "already used" in detail
    # a challenge is bound to the connection that asked for it
    other = pb_grpc.NodeAuthStub(_own_connection(worker.address))
    code, detail = _code(lambda: other.Prove(prove, timeout=5))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "not issued by this node" in detail
    # a forged challenge
    forged = pb.ProveRequest(
        client_nonce=cn,
        challenge=bytes(len(challenge)),
        client_proof=client_proof(key, cn, bytes(len(challenge)), b""),
    )
    code, _ = _code(lambda: stub.Prove(forged, timeout=5))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    # the session works on its own connection only
    md = ((SESSION_METADATA, first.session),)
    pb_grpc.NodeStub(ch).Drop(pb.DropRequest(), timeout=5, metadata=md)
    code, detail = _code(
        lambda: pb_grpc.NodeStub(_own_connection(worker.address)).Drop(
            pb.DropRequest(), timeout=5, metadata=md
        )
    )
    assert code == grpc.StatusCode.UNAUTHENTICATED and "session of another connection" in detail
    # a malformed proof
    code, _ = _code(lambda: stub.Prove(pb.ProveRequest(client_nonce=b"x"), timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    _still_serving(pool, worker, want, rss)


class _FakeNode(pb_grpc.NodeAuthServicer):
    """A machine posing as a pool worker without the secret: it accepts any proof and answers
    with a proof it cannot make (random, or one recorded from the real worker)."""

    def __init__(self, reply: pb.ProveReply | None) -> None:
        self.reply = reply

    def Challenge(self, request, context):
        return pb.ChallengeReply(secret_required=True, challenge=os.urandom(56))

    def Prove(self, request, context):
        return self.reply or pb.ProveReply(server_proof=os.urandom(32), session="s")


def test_head_checks_the_workers_proof(worker: Worker, auth: PoolAuth) -> None:
    key = auth.key
    assert key is not None
    ch = grpc.insecure_channel(worker.address)
    stub = pb_grpc.NodeAuthStub(ch)
    cn = os.urandom(32)
    c = stub.Challenge(
        pb.ChallengeRequest(protocol_version=PROTOCOL_VERSION, client_nonce=cn), timeout=5
    ).challenge
    recorded = stub.Prove(
        pb.ProveRequest(client_nonce=cn, challenge=c, client_proof=client_proof(key, cn, c, b"")),
        timeout=5,
    )
    for reply in (None, recorded):
        server = grpc.server(futures.ThreadPoolExecutor(2))
        pb_grpc.add_NodeAuthServicer_to_server(_FakeNode(reply), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            with pytest.raises(AuthError, match="did not prove it knows the pool secret"):
                NodeClient(f"127.0.0.1:{port}", auth).authenticate()
        finally:
            server.stop(0)


def test_handshake_state_is_bounded_and_expires() -> None:
    """The node's side alone, with a clock the test moves: challenges expire, used ones are
    forgotten once expired, sessions are capped (least recently used goes) and expire."""
    now = [1000.0]
    sessions = SessionTable(max_sessions=3, idle_s=60, max_s=600, clock=lambda: now[0])
    key = os.urandom(32)
    hs = Handshakes(PoolAuth(key), sessions, clock=lambda: now[0])

    def prove(peer: str = "ipv4:1.2.3.4:5") -> pb.ProveReply:
        cn = os.urandom(32)
        ch = hs.challenge(cn, peer)
        return hs.prove(pb.ProveRequest(client_nonce=cn, challenge=ch, client_proof=client_proof(key, cn, ch, b"")), peer)  # fmt: skip

    tokens = [prove().session for _ in range(5)]
    assert len(sessions) == 3
    assert sessions.check(tokens[0]) == "unknown or ended session"
    assert sessions.check(tokens[4], "ipv4:1.2.3.4:5") is None
    assert sessions.check(tokens[4], "ipv4:6.6.6.6:7") == "session of another connection"
    cn = os.urandom(32)
    old = hs.challenge(cn, "p")
    now[0] += CHALLENGE_TTL_S + 1
    with pytest.raises(Exception, match="older than 30 s"):
        hs.prove(pb.ProveRequest(client_nonce=cn, challenge=old, client_proof=client_proof(key, cn, old, b"")), "p")  # fmt: skip
    prove()
    assert len(hs._used) == 1  # the five used earlier expired and were forgotten
    now[0] += 61
    assert sessions.check(tokens[4]) == "expired session"


def test_proof_must_cover_the_nodes_own_certificate(tmp_path: Path) -> None:
    """A client proof made over another certificate (the one a machine in between showed) is
    refused even when the client claims to have seen that one."""
    key = os.urandom(32)
    own = load_or_create_identity(tmp_path)
    hs = Handshakes(PoolAuth(key, True, own), SessionTable())
    fake = os.urandom(32)
    cn = os.urandom(32)
    ch = hs.challenge(cn, "p")
    req = pb.ProveRequest(client_nonce=cn, challenge=ch, seen_cert_sha256=fake, client_proof=client_proof(key, cn, ch, fake))  # fmt: skip
    with pytest.raises(Exception, match="TLS certificate mismatch"):
        hs.prove(req, "p")
    ok = pb.ProveRequest(client_nonce=cn, challenge=ch, seen_cert_sha256=own.sha256, client_proof=client_proof(key, cn, ch, own.sha256))  # fmt: skip
    assert hs.prove(ok, "p").session


def test_client_proves_again_after_the_worker_restarts(auth: PoolAuth) -> None:
    """A node that restarted forgot its sessions: the client proves again and the call goes
    through (it was refused before its handler ran, so sending it again is safe)."""
    from potluck.model.stage import Compute
    from potluck.node.worker import serve

    port = _free_port()
    server, _ = serve("127.0.0.1", port, settings=Compute(threads=1), auth=auth)
    client = NodeClient(f"127.0.0.1:{port}", auth)
    try:
        client.drop(pb.DropRequest())
        first = client.metadata()
        server.stop(0).wait()
        server, _ = serve("127.0.0.1", port, settings=Compute(threads=1), auth=auth)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.drop(pb.DropRequest())
                break
            except NodeError:  # the channel may still be reconnecting
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert client.metadata() != first
        # a session unused for half the node's idle limit is renewed before the node would end it
        # (a stream refused at its start would fail the batches queued on it)
        held = client.metadata()
        assert client.metadata() == held
        client._session_used -= SESSION_IDLE_S / 2 + 1
        assert client.metadata() != held
        client.drop(pb.DropRequest())
    finally:
        client.close()
        server.stop(0)


def test_forward_stream_proves_again_when_its_session_is_gone(auth: PoolAuth) -> None:
    """A node that dropped this head's session (here: 266 other heads proved since, and it keeps
    256) refuses the next ForwardStream at its start, before reading a request: the link proves
    again and sends the queued requests on a new stream, so they are answered, not failed."""
    from potluck.model.stage import Compute
    from potluck.node.worker import serve

    server, port = serve("127.0.0.1", 0, settings=Compute(threads=1), auth=auth)
    address = f"127.0.0.1:{port}"
    client = NodeClient(address, auth)
    try:
        first = client.link.send(pb.ForwardRequest(plan_id="nothing-loaded")).exception(timeout=20)
        assert "is not loaded on this node" in str(first)
        client.link.close()  # the next send opens a new stream
        others = pb_grpc.NodeAuthStub(_own_connection(address))
        for _ in range(MAX_SESSIONS + 10):
            assert handshake(others, auth, address, b"", 10.0)
        later = [client.link.send(pb.ForwardRequest(plan_id=f"p{i}")) for i in range(3)]
        for i, f in enumerate(later):
            assert f"plan p{i} is not loaded on this node" in str(f.exception(timeout=30))
    finally:
        client.close()
        server.stop(0)


# -- bounds --------------------------------------------------------------------------------------


def test_oversized_message(worker: Worker, auth: PoolAuth, pool, want: list[int]) -> None:
    rss = worker.rss()
    ch, md = _session_channel(worker.address, auth, max_send_message_length=MAX_REQUEST_BYTES * 2)
    stub = pb_grpc.NodeStub(ch)
    huge = pb.ForwardRequest(
        plan_id=pool.pipeline.plan_id,
        chunks=[pb.SeqChunk(seq_id=99, n=1)],
        input=pb.Tensor(data=bytes(MAX_REQUEST_BYTES + 1), shape=[1], dtype="float32"),
    )
    code, detail = _code(lambda: stub.Forward(huge, timeout=60, metadata=md))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, detail
    # the head's own client stops it before sending, with what to do
    client = NodeClient(worker.address, auth)
    with pytest.raises(NodeError, match="larger than the 128 MiB allowed between nodes.*-b"):
        client.forward(huge)
    _still_serving(pool, worker, want, rss)


def test_wrong_dtype_shape_and_counts(
    worker: Worker, worker_home: Path, auth: PoolAuth, pool, want: list[int]
) -> None:
    """Bad tensors, counts and names from a peer that has the secret: INVALID_ARGUMENT each,
    and paths in names are never opened."""
    rss = worker.rss()
    ch, md = _session_channel(worker.address, auth)
    stub = pb_grpc.NodeStub(ch)
    plan = pool.pipeline.plan_id
    n_embd = pool.hp.n_embd

    def fwd(t: pb.Tensor, chunks=None) -> tuple[grpc.StatusCode, str]:
        req = pb.ForwardRequest(plan_id=plan, chunks=chunks or [pb.SeqChunk(seq_id=7, n=2)], input=t)  # fmt: skip
        return _code(lambda: stub.Forward(req, timeout=10, metadata=md))

    f32 = bytes(2 * n_embd * 4)
    cases = {
        "complex dtype": pb.Tensor(data=f32, shape=[2, n_embd], dtype="complex128"),
        "token ids where hidden states go": pb.Tensor(data=bytes(16), shape=[2], dtype="int64"),
        "wrong width": pb.Tensor(data=bytes(2 * 577 * 4), shape=[2, 577], dtype="float32"),
        "bytes short of the shape": pb.Tensor(data=f32[:12], shape=[2, n_embd], dtype="float32"),
        "negative dimension": pb.Tensor(data=b"", shape=[-2, n_embd], dtype="float32"),
        "five dimensions": pb.Tensor(data=b"", shape=[1, 1, 1, 2, n_embd], dtype="float32"),
        "a shape of 2^40 elements": pb.Tensor(data=b"", shape=[1 << 20, 1 << 20], dtype="float32"),
    }
    for what, t in cases.items():
        code, detail = fwd(t)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (what, code, detail)
    good = pb.Tensor(data=f32, shape=[2, n_embd], dtype="float32")
    for what, chunks in {
        "too many chunks": [pb.SeqChunk(seq_id=i, n=1) for i in range(MAX_CHUNKS + 1)],
        "negative recent token id": [pb.SeqChunk(seq_id=7, n=2, recent=[-1])],
        "recent token id 2^40": [pb.SeqChunk(seq_id=7, n=2, recent=[1 << 40])],
    }.items():
        code, detail = fwd(good, chunks)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (what, code, detail)
        assert "limit" in detail or "must be in" in detail
    # names that look like paths: refused before anything touches the disk
    code, detail = _code(
        lambda: stub.Load(
            pb.LoadRequest(plan_id="p", tensor_sha256={"blk.0.attn_q.weight": "../../etc/passwd"}),
            timeout=10,
            metadata=md,
        )  # fmt: skip
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a sha256 hex digest" in detail
    code, detail = _code(
        lambda: stub.Load(
            pb.LoadRequest(plan_id="p", next_hop="/tmp/x.sock"), timeout=10, metadata=md
        )  # fmt: skip
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not host:port" in detail
    chunk = pb.TensorChunk(name="t", sha256="../" * 21 + "x", total_bytes=4, data=b"abcd")
    code, detail = _code(lambda: stub.PutTensors(iter([chunk]), timeout=10, metadata=md))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a sha256 hex digest" in detail
    assert not (worker_home / "x").exists()
    _still_serving(pool, worker, want, rss)


# -- fuzz ----------------------------------------------------------------------------------------

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload  # fmt: skip


def _send_raw(address: str, data: bytes) -> None:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=2) as s:
        s.settimeout(0.3)
        with contextlib.suppress(OSError):
            s.sendall(data)
            s.recv(65536)  # whatever the node answers (a GOAWAY, usually), or a timeout


def _fuzz_raw(rng: random.Random, address: str, n: int, deadline: float) -> int:
    """Raw TCP garbage, and HTTP/2 that starts right then goes wrong."""
    sent = 0
    for i in range(n):
        if time.monotonic() > deadline:
            break
        kind = i % 4
        if kind == 0:  # noise
            data = rng.randbytes(rng.randint(1, 32768))
        elif kind == 1:  # the preface, then random frames
            data = H2_PREFACE + b"".join(
                _frame(
                    rng.randint(0, 12),
                    rng.randint(0, 255),
                    rng.randint(0, 9),
                    rng.randbytes(rng.randint(0, 64)),
                )  # fmt: skip
                for _ in range(rng.randint(1, 8))
            )
        elif kind == 2:  # settings, then a HEADERS frame of garbage HPACK on stream 1
            data = H2_PREFACE + _frame(4, 0, 0, b"") + _frame(1, 0x5, 1, rng.randbytes(rng.randint(1, 200)))  # fmt: skip
        else:  # a frame that claims to be huge
            data = H2_PREFACE + _frame(4, 0, 0, b"") + b"\xff\xff\xff\x00\x00\x00\x00\x00\x01"
        _send_raw(address, data)
        sent += 1
    return sent


NODE_METHODS = [
    "/potluck.v1.Node/Hello",
    "/potluck.v1.Node/Load",
    "/potluck.v1.Node/Forward",
    "/potluck.v1.Node/Drop",
    "/potluck.v1.NodeAuth/Challenge",
    "/potluck.v1.NodeAuth/Prove",
]


def _two(stream, data: bytes, timeout: float, metadata: tuple) -> object:
    return stream(iter([data, data]), timeout=timeout, metadata=metadata)


def _fuzz_protobuf(
    rng: random.Random, ch: grpc.Channel, md: tuple, n: int, deadline: float, plan_id: str
) -> dict[str, int]:
    """Random and mutated protobuf bytes to every method (and a few to the streams)."""
    seeds = [
        pb.ForwardRequest(
            plan_id=plan_id,
            chunks=[pb.SeqChunk(seq_id=5, n=1, sample=True, recent=[1, 2])],
            input=pb.Tensor(data=bytes(8), shape=[1], dtype="int64"),
        ).SerializeToString(),
        pb.LoadRequest(plan_id="p", start=0, stop=1, n_ctx=8).SerializeToString(),
        pb.DropRequest(plan_id=plan_id, seq_ids=[1, 2]).SerializeToString(),
    ]
    codes: dict[str, int] = {}
    for i in range(n):
        if time.monotonic() > deadline:
            break
        if i % 2:
            data = bytearray(rng.choice(seeds))
            for _ in range(rng.randint(1, 4)):
                if data:
                    data[rng.randrange(len(data))] = rng.randrange(256)
            if rng.random() < 0.3:
                data = data[: rng.randint(0, len(data))]
            data = bytes(data)
        else:
            data = rng.randbytes(rng.randint(0, 512))
        method = NODE_METHODS[i % len(NODE_METHODS)]
        if i % 17 == 0:  # a client stream: two messages of the same bytes
            stream = ch.stream_unary("/potluck.v1.Node/PutTensors")
            call = functools.partial(_two, stream)
        else:
            call = ch.unary_unary(method)  # raw bytes both ways
        try:
            call(data, timeout=10, metadata=md)
            codes["OK"] = codes.get("OK", 0) + 1
        except grpc.RpcError as exc:
            codes[exc.code().name] = codes.get(exc.code().name, 0) + 1
    return codes


def test_fuzz_port(worker: Worker, auth: PoolAuth, pool, want: list[int]) -> None:
    """A bounded fuzz run (a fixed seed, at most ~25 s): raw TCP garbage, malformed HTTP/2,
    malformed protobuf without and with a session. The worker stays up, serves the real head,
    and its memory stays flat from one round to the next."""
    rng = random.Random(20261129)
    _still_serving(pool, worker, want, worker.rss())
    rss: list[int] = []
    for _round in range(3):
        deadline = time.monotonic() + 8
        assert _fuzz_raw(rng, worker.address, 60, deadline) > 0
        stranger = grpc.insecure_channel(worker.address)
        codes = _fuzz_protobuf(rng, stranger, (), 60, deadline, pool.pipeline.plan_id)
        ch, md = _session_channel(worker.address, auth)
        member = _fuzz_protobuf(rng, ch, md, 60, deadline, pool.pipeline.plan_id)
        stranger.close()
        ch.close()
        assert "UNKNOWN" not in codes and "UNKNOWN" not in member, (codes, member)
        assert set(codes) <= {"OK", "UNAUTHENTICATED", "INTERNAL", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "UNIMPLEMENTED"}, codes  # fmt: skip
        assert worker.alive()
        rss.append(worker.rss())
    assert rss[2] - rss[0] < RSS_SLACK, (
        f"worker memory over the rounds: {[r >> 20 for r in rss]} MiB"
    )
    _still_serving(pool, worker, want, rss[0])


# -- worker to worker ----------------------------------------------------------------------------


def test_worker_to_worker_hop_authenticates(
    spawn_worker: Spawn,
    tmp_path: Path,
    worker: Worker,
    secret: str,
    auth: PoolAuth,
    smollm2_path: Path,
    want: list[int],
) -> None:
    """The head → worker → worker chain: the second worker requires a session, so the first
    proved the secret to it (over its own NodeClient) for the tokens to come back."""
    second = _start(spawn_worker, tmp_path / "config", secret)
    got, m = _pool_tokens(smollm2_path, [worker.address, second.address], auth)
    assert got == want
    assert len(m.pipeline.last_stage_ms) == 3


# -- non-loopback addresses ----------------------------------------------------------------------


@contextlib.contextmanager
def _netns() -> Iterator[tuple[str, str]]:
    """A network namespace of our own with an interface 10.231.0.1/24 (a veth pair whose both ends
    stay inside it: nothing leaves the namespace)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make a network namespace")
    name = f"potluck-sec-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        for cmd in (
            "ip link set lo up",
            "ip link add psec0 type veth peer name psec1",  # both ends inside the namespace
            "ip addr add 10.231.0.1/24 dev psec0",
            "ip link set psec0 up",
            "ip link set psec1 up",
        ):
            subprocess.run(["ip", "netns", "exec", name, *cmd.split()], check=True, timeout=30)
        yield name, "10.231.0.1"
    finally:
        subprocess.run(["ip", "netns", "del", name], timeout=30)


@pytest.mark.netns
def test_non_loopback_address_needs_a_secret(
    spawn_worker: Spawn, tmp_path: Path, secret: str
) -> None:
    with _netns() as (ns, ip):
        base = ["ip", "netns", "exec", ns, sys.executable, "-m", "potluck.cli", "worker"]
        env = {**os.environ, "POTLUCK_CONFIG": str(tmp_path), "POTLUCK_MDNS": "0", "COLUMNS": "300"}
        env.pop("POTLUCK_SECRET", None)
        done = subprocess.run(
            [*base, "-H", ip, "-p", "50052"], capture_output=True, text=True, timeout=120, env=env
        )
        assert done.returncode == 1
        assert f"refusing to listen on {ip} without a pool secret" in done.stderr
        assert "potluck secret --save" in done.stderr
        # with the secret it starts (and binds inside the namespace only)
        w = spawn_worker(
            "-H", ip, port=50052, secret=secret, prefix=("ip", "netns", "exec", ns), timeout=90,
            env={"POTLUCK_CONFIG": str(tmp_path), "COLUMNS": "300"},
        )  # fmt: skip
        assert f"listening on {ip}:50052" in w.log
        assert "pool secret from POTLUCK_SECRET" in w.log
        w.stop(timeout=20)


# -- TLS -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _tls_relay(target: str, cert_dir: Path) -> Iterator[str]:
    """A machine in between: it accepts TLS with its own certificate and relays the bytes to the
    real worker over TLS (as an attacker on the path would)."""
    identity = load_or_create_identity(cert_dir)
    (cert_dir / "pair.pem").write_bytes(identity.cert_pem + identity.key_pem)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert_dir / "pair.pem")
    server_ctx.set_alpn_protocols(["h2"])
    client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client_ctx.check_hostname, client_ctx.verify_mode = False, ssl.CERT_NONE
    client_ctx.set_alpn_protocols(["h2"])
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()
    host, port = target.rsplit(":", 1)

    def pump(a: ssl.SSLSocket, b: ssl.SSLSocket) -> None:
        """Both directions in one thread: an SSL socket must not be read in one thread while
        another writes to it (OpenSSL's objects are not thread-safe: with a thread per direction
        the head's handshake through the relay now and then ended in "Socket closed")."""
        for s in (a, b):
            s.settimeout(10)  # for sendall; reads only happen when select says so
        try:
            while not stop.is_set():
                ready = [s for s in (a, b) if s.pending()]
                if not ready:
                    ready = select.select([a, b], [], [], 0.2)[0]
                for s in ready:
                    try:
                        data = s.recv(65536)
                    except (ssl.SSLWantReadError, TimeoutError):
                        continue  # a TLS record not complete yet
                    if not data:
                        return
                    (b if s is a else a).sendall(data)
        except OSError:
            return
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.close()

    def serve() -> None:
        while not stop.is_set():
            try:
                raw, _ = listener.accept()
            except TimeoutError:
                continue
            try:
                raw.settimeout(10)
                down = server_ctx.wrap_socket(raw, server_side=True)
                up = client_ctx.wrap_socket(socket.create_connection((host, int(port)), timeout=10))
                down.settimeout(None)
                up.settimeout(None)
            except OSError:
                continue
            threading.Thread(target=pump, args=(down, up), daemon=True).start()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        t.join(timeout=5)
        listener.close()


def test_tls_pinning(
    spawn_worker: Spawn, tmp_path: Path, secret: str, smollm2_path: Path, want: list[int]
) -> None:
    config = tmp_path / "config"
    tls_worker = _start(spawn_worker, config, secret, "--tls")
    tls_auth = PoolAuth.from_secret(secret, tls=True)
    got, m = _pool_tokens(smollm2_path, [tls_worker.address], tls_auth)
    assert got == want
    rss = tls_worker.rss()
    # the certificate was made once and kept; the worker said which
    cert = config / "tls" / "worker-cert.pem"
    assert (config / "tls" / "worker-key.pem").stat().st_mode & 0o777 == 0o600
    assert load_or_create_identity(config).sha256.hex()[:16] in tls_worker.log
    assert cert.is_file()
    # a machine in between with its own certificate cannot finish the handshake
    with _tls_relay(tls_worker.address, tmp_path / "mitm") as relay:
        with pytest.raises(AuthError, match="TLS certificate mismatch: the head was shown"):
            NodeClient(relay, tls_auth).authenticate()
        # nor can a channel that trusts another certificate talk to the real worker
        other = load_or_create_identity(tmp_path / "other")
        ch = grpc.secure_channel(
            tls_worker.address,
            grpc.ssl_channel_credentials(root_certificates=other.cert_pem),
            options=CHANNEL_TLS_OPTIONS,
        )
        code, _ = _code(lambda: pb_grpc.NodeStub(ch).Hello(pb.HelloRequest(), timeout=5))
        assert code == grpc.StatusCode.UNAVAILABLE
    # a head without --tls is told what to do, as is a TLS head at a plain worker
    with pytest.raises(NodeError, match="speaks TLS .*pass --tls here too"):
        NodeClient(tls_worker.address, PoolAuth.from_secret(secret)).authenticate()
    # garbage at the TLS port
    assert _fuzz_raw(random.Random(7), tls_worker.address, 40, time.monotonic() + 8) > 0
    assert tls_worker.alive()
    ids = m.tokenizer.encode(m.chat.render([{"role": "user", "content": PROMPT}]))
    assert list(generate(m, ids, N_TOKENS, Sampler(GREEDY))) == want
    assert tls_worker.rss() - rss < RSS_SLACK


def test_tls_head_at_a_plain_worker(worker: Worker, secret: str) -> None:
    with pytest.raises(NodeError, match="did not answer in TLS .*start its worker with --tls"):
        NodeClient(worker.address, PoolAuth.from_secret(secret, tls=True)).authenticate()
