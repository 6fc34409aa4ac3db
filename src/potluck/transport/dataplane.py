"""The forward path's fast lane: ForwardRequest / ForwardReply frames on a plain TCP connection.

Why: every token crosses every stage, so the per-message cost of the transport is paid several
times per token. Measured here (two processes pinned to one core each, loopback, 2.3 KB
messages): a gRPC Python stream ping-pong takes ≈ 260 µs (sync and asyncio alike), the same
exchange on a plain socket ≈ 64 µs. Everything else (Hello, Load, weights, Drop, heartbeats, the
handshake that opens gRPC sessions) stays on gRPC; a node's ForwardStream remains the fallback
when its data port cannot be reached (a firewall that lets only the gRPC port through).

Frames: a 4-byte big-endian length, then one message of potluck.proto. The node speaks first:

    node   → DataHello(version, sn)            sn, cn: 32 fresh random bytes each
    client → DataAuth(version, cn, proof)      proof = HMAC(K, "data client", sn, cn, cert)
    node   → DataAuthReply(proof | error)      proof = HMAC(K, "data server", sn, cn, cert)

then ForwardRequest frames one way and ForwardReply frames the other (request_id matches them).
K is the pool key (transport/auth.py), cert the sha256 of the node's TLS certificate ("" without
--tls); without a pool secret (loopback only) the proofs are empty. Both nonces are fresh per connection, so a recorded handshake is worthless. With --tls the
connection is TLS with the worker's certificate: the client checks that its sha256 is the one the
gRPC handshake pinned, and both proofs cover it too (a machine in between that shows its own
certificate cannot prove). Without --tls, as on gRPC, the traffic is authenticated at its start
only, not encrypted.

Threads: a node computes each request in its connection's own thread and writes the answer (or
sends it on to the next node) from there, with no hand-off; a client writes small frames in the
caller's thread and large ones (and whatever follows them) through a writer thread, and one reader
thread per connection settles the futures.

Both ends of one wire protocol (the server, the link, the framing and handshake they share) in one
file, so that the two sides cannot drift apart; over 400 lines on purpose.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import logging
import os
import socket
import ssl
import struct
import threading
from collections.abc import Callable
from concurrent.futures import Future

from google.protobuf.message import DecodeError

from potluck.errors import NodeError, StepRefused
from potluck.transport import potluck_pb2 as pb
from potluck.transport.auth import (
    MISMATCH_HINT,
    NONCE_BYTES,
    AuthError,
    PoolAuth,
    data_client_proof,
    data_server_proof,
)
from potluck.transport.codec import PROTOCOL_VERSION, WireError
from potluck.transport.limits import MAX_REPLY_BYTES, MAX_REQUEST_BYTES, check_message
from potluck.transport.tls import SERVER_NAME, client_ssl_context, split_address

log = logging.getLogger("potluck.transport")

HANDSHAKE_TIMEOUT_S = 10.0  # a connection that has not proved itself by then is closed
CONNECT_TIMEOUT_S = 3.0
MAX_CONNECTIONS = 64  # data connections one node serves at once (heads and upstream nodes)
MAX_HANDSHAKE_BYTES = 1024
_LEN = struct.Struct(">I")
_SMALL = 1 << 18  # frames up to this size go out in one write (length and body together)

# sends a forward request's reply to whoever sent it (may be called later, from any thread)
Answer = Callable[[pb.ForwardReply], None]
# node: handle one request, answering it through the Answer it is given
Handler = Callable[[pb.ForwardRequest, Answer], None]
# called before each blocking read of a frame on a data connection; a worker passes its poll
# (transport/spin.py: the core stays awake for the next token); None: just block
Wait = Callable[[socket.socket], object]


def _no_wait(sock: socket.socket) -> None:
    return None


class FrameError(Exception):
    """A frame that is too large, or a connection that ended inside a frame."""


def _recv_exact(sock: socket.socket, n: int) -> bytearray | None:
    """n bytes, or None if the peer closed the connection before the first one."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise FrameError(f"the connection ended {got} bytes into a {n}-byte read")
        got += k
    return buf


def recv_frame(sock: socket.socket, limit: int) -> bytearray | None:
    """One frame's body (at most `limit` bytes), or None at a clean end of the connection."""
    head = _recv_exact(sock, _LEN.size)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > limit:
        raise FrameError(f"a frame of {n:,} bytes exceeds the limit of {limit:,}")
    if n == 0:
        return bytearray()
    body = _recv_exact(sock, n)
    if body is None:
        raise FrameError("the connection ended between a frame's length and its body")
    return body


def send_frame(sock: socket.socket, data: bytes) -> None:
    if len(data) <= _SMALL:
        sock.sendall(_LEN.pack(len(data)) + data)
    else:  # no copy of a large body
        sock.sendall(_LEN.pack(len(data)))
        sock.sendall(data)


def settle(fut: Future[pb.ForwardReply], reply: pb.ForwardReply, address: str) -> None:
    """A node's answer to one forward request: its reply, or the error it names."""
    if reply.error:
        why = f"node {address}: {reply.error} ({reply.error_code})"
        refused = reply.error_code in StepRefused.REFUSALS
        fut.set_exception(StepRefused(why, reply.error_code) if refused else NodeError(why))
    else:
        fut.set_result(reply)


# -- the node's side ------------------------------------------------------------------------------


class DataServer:
    """Accepts data connections next to a node's gRPC server and hands each request to `handler`."""

    def __init__(
        self,
        auth: PoolAuth,
        handler: Handler,
        max_connections: int = MAX_CONNECTIONS,
        tls: ssl.SSLContext | None = None,
        wait: Wait | None = None,
    ) -> None:
        """tls: the node's server context (transport/tls.server_ssl_context) when it runs --tls.
        wait: called before each read of a request (see `Wait`)."""
        self.auth, self.handler, self.max_connections = auth, handler, max_connections
        self.tls, self.wait = tls, wait
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._closed = False

    def listen(self, host: str, port: int) -> int:
        """Bind and listen (port 0: any free one); the bound port. OSError if the port is taken."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            if os.name != "nt":  # on Windows SO_REUSEADDR would let another process steal the port
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(64)
        except OSError:
            sock.close()
            raise
        self._listener = sock
        threading.Thread(target=self._accept, name="potluck-data-accept", daemon=True).start()
        bound: int = sock.getsockname()[1]  # (host, port) for IPv4, 4 items for IPv6
        return bound

    def stop(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns), set()
            listener, self._listener = self._listener, None
        for s in [*conns, *([listener] if listener is not None else [])]:
            with contextlib.suppress(OSError):  # already closed by its peer
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self) -> None:
        listener = self._listener
        assert listener is not None
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # stop() closed the listener
                return
            with self._lock:
                if self._closed or len(self._conns) >= self.max_connections:
                    conn.close()
                    continue
                self._conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="potluck-data-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        raw = conn
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
                with self._lock:
                    self._conns.discard(raw)
                    self._conns.add(conn)
            if not self._handshake(conn):
                return
            conn.settimeout(None)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            lock = threading.Lock()

            def answer(reply: pb.ForwardReply) -> None:
                data = reply.SerializeToString()
                with lock, contextlib.suppress(OSError):  # the head went away: nobody to tell
                    send_frame(conn, data)

            wait = self.wait or _no_wait
            while True:
                wait(conn)
                data = recv_frame(conn, MAX_REQUEST_BYTES)
                if data is None:
                    break
                request = pb.ForwardRequest()
                request.ParseFromString(data)  # type: ignore[arg-type]  # takes a bytearray
                try:
                    check_message(request)
                except WireError as exc:
                    answer(
                        pb.ForwardReply(
                            request_id=request.request_id,
                            error=str(exc),
                            error_code="INVALID_ARGUMENT",
                        )
                    )
                    continue
                try:
                    self.handler(request, answer)
                except Exception as exc:  # a bug in the handler: say it, keep serving (as gRPC)
                    log.exception("forward request %d failed", request.request_id)
                    answer(
                        pb.ForwardReply(
                            request_id=request.request_id,
                            error=f"internal error: {exc}",
                            error_code="INTERNAL",
                        )
                    )
        except (OSError, FrameError, DecodeError):  # ssl.SSLError is an OSError
            pass  # a broken or malformed connection ends; the node serves on
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._conns.discard(raw)
            conn.close()
            raw.close()

    def _handshake(self, conn: socket.socket) -> bool:
        sn = os.urandom(NONCE_BYTES)
        send_frame(
            conn, pb.DataHello(protocol_version=PROTOCOL_VERSION, nonce=sn).SerializeToString()
        )
        data = recv_frame(conn, MAX_HANDSHAKE_BYTES)
        if data is None:
            return False
        msg = pb.DataAuth()
        msg.ParseFromString(data)  # type: ignore[arg-type]  # takes a bytearray

        def refuse(why: str) -> bool:
            send_frame(conn, pb.DataAuthReply(error=why).SerializeToString())
            return False

        if msg.protocol_version != PROTOCOL_VERSION:
            return refuse(
                f"protocol version {msg.protocol_version} from the head, this node speaks "
                f"{PROTOCOL_VERSION}; install the same Potluck version on every machine"
            )
        key, cn = self.auth.key, bytes(msg.nonce)
        if key is None:
            send_frame(conn, pb.DataAuthReply().SerializeToString())
            return True
        cert = self.auth.cert_sha256
        if len(cn) != NONCE_BYTES or not hmac.compare_digest(
            bytes(msg.proof), data_client_proof(key, sn, cn, cert)
        ):
            return refuse("pool secret mismatch")
        reply = pb.DataAuthReply(proof=data_server_proof(key, sn, cn, cert))
        send_frame(conn, reply.SerializeToString())
        return True


# -- the client's side ----------------------------------------------------------------------------


class _Conn:
    """One data connection and the replies still awaited on it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pending: dict[int, Future[pb.ForwardReply]] = {}


class DataLink:
    """The same contract as transport.client.ForwardLink, on a data connection: `send` returns at
    once with a future of the reply and never raises; if the connection breaks, every waiting
    future fails with a NodeError and the next `send` connects again."""

    def __init__(
        self,
        address: str,
        port: int,
        auth: PoolAuth,
        cert_sha256: bytes = b"",
        wait: Wait | None = None,
    ) -> None:
        """cert_sha256: with auth.tls, the node's certificate as the gRPC handshake pinned it.
        wait: called before each read of a reply (see `Wait`)."""
        self.wait = wait or _no_wait
        if auth.tls and not cert_sha256:
            raise ValueError("a TLS data link needs the node's pinned certificate")
        self.address = address  # the node's gRPC host:port: how messages name it
        self.host, self.port, self.auth = split_address(address)[0], port, auth
        self.cert_sha256 = cert_sha256 if auth.tls else b""
        self._lock = threading.Lock()  # the connection and its pending replies
        self._write = threading.Lock()  # one frame at a time, in the order requests are numbered
        self._conn: _Conn | None = None
        self._closed = False  # for good: no reconnecting after close()
        self._next_id = 0
        # frames the writer thread still has to send, in order (see send)
        self._backlog: collections.deque[tuple[_Conn, bytes]] = collections.deque()
        self._more = threading.Condition(self._write)
        self._writer: threading.Thread | None = None
        self._stopping = False

    def open(self, timeout: float = CONNECT_TIMEOUT_S) -> None:
        """Connect and prove membership now (else the first `send` does). Raises NodeError."""
        with self._lock:
            if self._conn is None:
                self._conn = self._connect(timeout)

    def _connect(self, timeout: float) -> _Conn:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=timeout)
        except OSError as exc:
            raise NodeError(
                f"node {self.address}: cannot open its data port {self.port} ({exc}); "
                "is the port open in its firewall?"
            ) from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(max(timeout, HANDSHAKE_TIMEOUT_S))
            if self.auth.tls:
                sock = client_ssl_context().wrap_socket(sock, server_hostname=SERVER_NAME)
                seen = hashlib.sha256(sock.getpeercert(binary_form=True) or b"").digest()
                if not hmac.compare_digest(seen, self.cert_sha256):
                    raise AuthError(
                        f"node {self.address}: TLS certificate mismatch on its data port "
                        f"({seen.hex()[:16]}, pinned {self.cert_sha256.hex()[:16]}): something "
                        "between the two machines answers in its place"
                    )
            self._handshake(sock)
            sock.settimeout(None)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        except (OSError, FrameError, DecodeError) as exc:
            sock.close()
            raise NodeError(
                f"node {self.address}: the handshake on its data port {self.port} failed ({exc})"
            ) from None
        except NodeError:
            sock.close()
            raise
        conn = _Conn(sock)
        threading.Thread(
            target=self._read, args=(conn,), name=f"potluck-data-{self.address}", daemon=True
        ).start()
        return conn

    def _handshake(self, sock: socket.socket) -> None:
        data = recv_frame(sock, MAX_HANDSHAKE_BYTES)
        if data is None:
            raise NodeError(
                f"node {self.address}: the handshake on its data port {self.port} failed (the node "
                "closed the connection before greeting; --tls on one side only?)"
            )
        hello = pb.DataHello()
        hello.ParseFromString(data)  # type: ignore[arg-type]  # takes a bytearray
        if hello.protocol_version != PROTOCOL_VERSION:
            raise NodeError(
                f"node {self.address} speaks protocol {hello.protocol_version}, this machine "
                f"{PROTOCOL_VERSION}; install the same Potluck version on every machine"
            )
        sn, cn, key = bytes(hello.nonce), os.urandom(NONCE_BYTES), self.auth.key
        proof = data_client_proof(key, sn, cn, self.cert_sha256) if key is not None else b""
        send_frame(
            sock,
            pb.DataAuth(
                protocol_version=PROTOCOL_VERSION, nonce=cn, proof=proof
            ).SerializeToString(),
        )
        data = recv_frame(sock, MAX_HANDSHAKE_BYTES)
        if data is None:
            raise NodeError(
                f"node {self.address}: the handshake on its data port {self.port} failed (the node "
                "closed the connection before answering the proof)"
            )
        reply = pb.DataAuthReply()
        reply.ParseFromString(data)  # type: ignore[arg-type]  # takes a bytearray
        if reply.error:
            raise AuthError(
                f"node {self.address} rejected this machine: {reply.error} ({MISMATCH_HINT})"
            )
        if key is not None and not hmac.compare_digest(
            bytes(reply.proof), data_server_proof(key, sn, cn, self.cert_sha256)
        ):
            raise AuthError(
                f"node {self.address} did not prove on its data port that it knows the pool "
                "secret: something else answers there"
            )

    def _read(self, conn: _Conn) -> None:
        try:
            while True:
                self.wait(conn.sock)
                data = recv_frame(conn.sock, MAX_REPLY_BYTES)
                if data is None:
                    break
                reply = pb.ForwardReply()
                reply.ParseFromString(data)  # type: ignore[arg-type]  # takes a bytearray
                with self._lock:
                    fut = conn.pending.pop(reply.request_id, None)
                if fut is not None:  # else an answer nobody waits for (its batch was given up)
                    settle(fut, reply, self.address)
            failure = NodeError(f"node {self.address} closed the data connection")
        except (OSError, FrameError, DecodeError) as exc:
            failure = NodeError(f"node {self.address}: the data connection broke ({exc})")
        self._end(conn, failure)
        # Only this thread closes the socket, once it reads no more: an SSL socket closed while
        # another thread is in its read keeps reading its old descriptor number, which the next
        # connection may already have been given (that read stole the next TLS handshake's bytes:
        # "wrong version number")
        conn.sock.close()

    def _end(self, conn: _Conn, failure: BaseException) -> None:
        """Fail what the connection still awaits and shut it down (its reader then ends)."""
        with self._lock:
            if self._conn is conn:
                self._conn = None
            waiting, conn.pending = conn.pending, {}
        with contextlib.suppress(OSError):  # already shut down
            conn.sock.shutdown(socket.SHUT_RDWR)
        for fut in waiting.values():
            fut.set_exception(failure)

    def send(self, request: pb.ForwardRequest) -> Future[pb.ForwardReply]:
        fut: Future[pb.ForwardReply] = Future()
        with self._write:
            with self._lock:
                if self._closed:
                    fut.set_exception(NodeError(f"the link to node {self.address} was closed"))
                    return fut
                if self._conn is None:
                    try:
                        self._conn = self._connect(CONNECT_TIMEOUT_S)
                    except NodeError as exc:
                        fut.set_exception(exc)
                        return fut
                conn = self._conn
                self._next_id += 1
                request.request_id = self._next_id
                conn.pending[self._next_id] = fut
            data = request.SerializeToString()
            if self._backlog or len(data) > _SMALL:
                # A large frame (a prompt micro-batch of hidden states) goes through the writer
                # thread, and everything after it until it is out: a send blocks while the node
                # computes and its socket buffers are full, and the caller (a stage) should
                # compute its next micro-batch meanwhile. Small frames go out at once.
                self._backlog.append((conn, data))
                self._stopping = False
                if self._writer is None:
                    self._writer = threading.Thread(
                        target=self._write_backlog, name=f"potluck-send-{self.address}",
                        daemon=True,
                    )  # fmt: skip
                    self._writer.start()
                self._more.notify()
            else:
                self._send(conn, data)
        return fut

    def _send(self, conn: _Conn, data: bytes) -> None:
        try:
            send_frame(conn.sock, data)
        except OSError as exc:  # the reader sees the same break; make sure it does
            self._end(conn, NodeError(f"node {self.address}: the data connection broke ({exc})"))

    def _write_backlog(self) -> None:
        while True:
            with self._write:
                while not self._backlog:
                    if self._stopping:  # closed: the next large send starts a new writer
                        self._writer = None
                        return
                    self._more.wait()
                conn, data = self._backlog[0]  # stays queued while it is sent: keeps the order
            self._send(conn, data)
            with self._write:
                self._backlog.popleft()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        with self._write:
            self._stopping = True
            self._more.notify()
        self.fail_all(NodeError(f"the link to node {self.address} was closed"))

    def fail_all(self, exc: BaseException) -> None:
        """Give up on every reply still awaited and close the connection."""
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            self._end(conn, exc)


def open_data_link(
    address: str, port: int, auth: PoolAuth, cert_sha256: bytes = b"", wait: Wait | None = None
) -> DataLink | None:
    """A connected DataLink to the node, or None (said in the log) when its data port cannot be
    used: the caller then keeps the gRPC stream."""
    link = DataLink(address, port, auth, cert_sha256, wait)
    try:
        link.open()
    except NodeError as exc:
        log.warning("%s; using the slower gRPC stream instead", exc)
        return None
    return link
