"""The gRPC client a head (or an upstream stage) uses to talk to a node, with deadlines.

NodeClient (the RPCs with their deadlines and errors) and ForwardLink (its forward stream) share
the channel and its error mapping; over 400 lines on purpose.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import grpc

from potluck.errors import NodeError, PotluckError
from potluck.transport import codec
from potluck.transport import potluck_pb2 as pb
from potluck.transport import potluck_pb2_grpc as pb_grpc
from potluck.transport.auth import (
    SESSION_IDLE_S,
    SESSION_MAX_S,
    SESSION_METADATA,
    SESSION_PREFIX,
    AuthError,
    PoolAuth,
    explain_refusal,
    handshake,
)
from potluck.transport.dataplane import DataLink, Wait, open_data_link, settle
from potluck.transport.limits import CLIENT_SIZE_OPTIONS, MAX_REQUEST_BYTES, SERVER_OPTIONS
from potluck.transport.tls import (
    CHANNEL_TLS_OPTIONS,
    TlsError,
    channel_credentials,
    fetch_certificate,
    speaks_tls,
)

if TYPE_CHECKING:
    from potluck.modelfile.gguf_file import Matrix

_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# Each channel keeps its own connections: by default gRPC shares them between channels to the
# same address, so a fresh client to a node that was just restarted inherited the old
# connection's "refused" state and its reconnect backoff, and failed at once although the node
# listened again (a node rejoining a training at a checkpoint was refused that way under load).
_OWN_CONNECTIONS = [("grpc.use_local_subchannel_pool", 1)]
CHANNEL_OPTIONS = CLIENT_SIZE_OPTIONS + _KEEPALIVE + _OWN_CONNECTIONS
# a node's server: the size bounds of transport/limits.py, and it accepts the clients' keepalive
# pings (else it would send them away after a few minutes, and their sessions with them)
NODE_SERVER_OPTIONS = SERVER_OPTIONS + [
    *_KEEPALIVE,
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # gRPC sets SO_REUSEPORT by default on Linux: a second worker on a taken port would share it
    # (and answer some heads in place of the first) instead of failing to start.
    ("grpc.so_reuseport", 0),
]
HANDSHAKE_TIMEOUT_S = 10.0

__all__ = ["CHANNEL_OPTIONS", "NODE_SERVER_OPTIONS", "AuthError", "NodeClient", "NodeError"]


def _explain(address: str, exc: grpc.RpcError, timeout: float | None = None) -> NodeError:
    """One line for a failed call; `timeout`: the call's deadline in seconds, said when it passed."""
    code = exc.code() if hasattr(exc, "code") else None
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.UNAVAILABLE:
        return NodeError(
            f"node {address} is unreachable ({detail}); is `potluck worker` running there and the port open?"
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        within = f"within {timeout:g} s" if timeout is not None else "in time"
        return NodeError(
            f"node {address} did not answer {within}: it may be overloaded, hung, not a Potluck "
            "worker, or the link is down (`potluck doctor` checks)"
        )
    if code is not None and (refused := explain_refusal(address, code, detail or "")):
        return refused
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "message larger than max" in (detail or ""):
        return NodeError(
            f"node {address}: a message is larger than the {MAX_REQUEST_BYTES // 2**20} MiB "
            f"allowed between nodes ({detail}); use a smaller prompt batch (-b)"
        )
    name = code.name if code is not None else "ERROR"
    return NodeError(f"node {address}: {detail} ({name})")


_END = object()  # ends a ForwardLink's request stream


class ForwardLink:
    """One long-lived ForwardStream to a node: `send` returns at once with a future of the reply.

    Requests go out in the order sent; replies are matched by request_id. If the stream breaks
    (the node died, the link went down), every waiting future fails with a NodeError and the next
    `send` opens a new stream."""

    def __init__(self, client: NodeClient) -> None:
        self.client = client
        self._lock = threading.Lock()
        self._next_id = 0
        # request id -> (its future, the request: sent again if the node refuses the stream's
        # session at its start, before reading any request)
        self._pending: dict[int, tuple[Future[pb.ForwardReply], pb.ForwardRequest]] = {}
        self._queue: queue.SimpleQueue[object] | None = None

    def _open(self, resend: bool = True) -> queue.SimpleQueue[object]:
        q: queue.SimpleQueue[object] = queue.SimpleQueue()

        def requests() -> Iterator[pb.ForwardRequest]:
            while (item := q.get()) is not _END:
                yield item  # type: ignore[misc]

        replies = self.client.stub.ForwardStream(requests(), metadata=self.client.metadata())
        threading.Thread(
            target=self._read, args=(replies, q, resend), name=f"potluck-link-{self.client.address}",
            daemon=True,
        ).start()  # fmt: skip
        return q

    def _read(
        self, replies: Iterator[pb.ForwardReply], q: queue.SimpleQueue[object], resend: bool
    ) -> None:
        answered = False
        try:
            for reply in replies:
                answered = True
                with self._lock:
                    fut = self._pending.pop(reply.request_id, (None, None))[0]
                if fut is not None:  # else an answer nobody waits for: ignore it
                    settle(fut, reply, self.client.address)
            failure = NodeError(f"node {self.client.address} closed the stream")
        except grpc.RpcError as exc:
            if self.client.session_refused(exc) and resend and not answered and self._reopen(q):
                return
            failure = _explain(self.client.address, exc)
        with self._lock:
            if self._queue is q:
                self._queue = None
            waiting, self._pending = self._pending, {}
        q.put(_END)
        for fut, _ in waiting.values():
            fut.set_exception(failure)

    def _reopen(self, old: queue.SimpleQueue[object]) -> bool:
        """The node refused the stream's session at its start (it restarted, the session ended,
        the connection was re-made), so it read none of the requests: prove again on a new stream
        and send them again, in order. False if that cannot be done."""
        with self._lock:
            if self._queue is not old:
                return False
            try:
                self._queue = self._open(resend=False)
            except NodeError:
                self._queue = None
                return False
            for _, request in sorted(self._pending.values(), key=lambda e: e[1].request_id):
                self._queue.put(request)
        old.put(_END)
        return True

    def send(self, request: pb.ForwardRequest) -> Future[pb.ForwardReply]:
        """Never raises: a node that cannot be reached (or refuses this head) fails the future."""
        fut: Future[pb.ForwardReply] = Future()
        with self._lock:
            if self._queue is None:
                try:
                    self._queue = self._open()
                except PotluckError as exc:
                    fut.set_exception(exc)
                    return fut
                except grpc.RpcError as exc:
                    fut.set_exception(_explain(self.client.address, exc))
                    return fut
            self._next_id += 1
            request.request_id = self._next_id
            self._pending[self._next_id] = (fut, request)
            self._queue.put(request)
        return fut

    def close(self) -> None:
        with self._lock:
            q, self._queue = self._queue, None
        if q is not None:
            q.put(_END)

    def fail_all(self, exc: BaseException) -> None:
        """Give up on every reply still awaited (the node was declared gone) and end the stream."""
        with self._lock:
            q, self._queue = self._queue, None
            waiting, self._pending = self._pending, {}
        if q is not None:
            q.put(_END)
        for fut, _ in waiting.values():
            fut.set_exception(exc)


_OPEN_CLIENTS: weakref.WeakSet[NodeClient] = weakref.WeakSet()


@atexit.register
def _close_open_clients() -> None:
    """Close every channel still open when the process exits: a stream's reader thread blocked
    in gRPC at interpreter teardown makes gRPC's C++ core abort ("terminate called without an
    active exception", exit code 134)."""
    for client in list(_OPEN_CLIENTS):
        with contextlib.suppress(Exception):  # best effort at exit: nothing left to report to
            client.close()


class NodeClient:
    """One channel to one node. Every call has a deadline (seconds).

    With a pool secret (`auth`), the client proves membership before its first call and checks the
    node's proof (transport/auth.py); with `auth.tls` the channel trusts exactly the certificate
    the node presents, which the handshake pins. A call the node refuses for want of a session
    (it restarted, or the connection was re-made) proves again and is retried once."""

    def __init__(self, address: str, auth: PoolAuth | None = None) -> None:
        self.address = address
        self.auth = auth if auth is not None else PoolAuth()
        self._lock = threading.Lock()
        self._closed = False  # for good: a closed client never opens its channel again
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.NodeStub | None = None
        self._cert_sha256 = b""
        self._metadata: tuple[tuple[str, str], ...] | None = None  # None: no handshake yet
        self._session_made = self._session_used = 0.0  # time.monotonic()
        self.data_port = 0  # the node's data port (transport/dataplane.py), told by Hello
        self._stream_link = ForwardLink(self)
        self._data_link: DataLink | None = None
        _OPEN_CLIENTS.add(self)

    @property
    def link(self) -> ForwardLink | DataLink:
        """Where forward requests go: the data connection once `use_data_port` opened it, else
        the gRPC ForwardStream."""
        return self._data_link or self._stream_link

    def use_data_port(self, wait: Wait | None = None) -> bool:
        """Send forward requests over the node's data port from now on, if it has one (Hello
        says) and it can be reached; else they stay on the gRPC stream. With --tls the data
        connection must show the certificate this client's gRPC handshake pinned. wait: called
        before each read of a reply (a node's spin-wait; transport/dataplane.Wait)."""
        if self._data_link is not None:
            return True
        if not self.data_port or (self.auth.tls and not self._cert_sha256):
            return False
        self._data_link = open_data_link(
            self.address, self.data_port, self.auth, self._cert_sha256, wait
        )
        return self._data_link is not None

    # -- connection and session ----------------------------------------------------------------
    def _connect(self) -> pb_grpc.NodeStub:
        """The stub, opening the channel on first use (with TLS: fetch the node's certificate)."""
        with self._lock:
            if self._closed:
                raise NodeError(f"the connection to node {self.address} was closed")
            if self._stub is None:
                if self.auth.tls:
                    try:
                        pem, self._cert_sha256 = fetch_certificate(self.address)
                    except TlsError as exc:
                        raise NodeError(str(exc)) from None
                    self._channel = grpc.secure_channel(
                        self.address,
                        channel_credentials(pem),
                        options=CHANNEL_OPTIONS + CHANNEL_TLS_OPTIONS,
                    )
                else:
                    self._channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
                # the generated gRPC module is unannotated (grpc's plugin writes no type hints)
                self._stub = pb_grpc.NodeStub(self._channel)  # type: ignore[no-untyped-call]
            return self._stub

    @property
    def stub(self) -> pb_grpc.NodeStub:
        return self._connect()

    @property
    def channel(self) -> grpc.Channel:
        self._connect()
        assert self._channel is not None
        return self._channel

    def metadata(self, timeout: float = HANDSHAKE_TIMEOUT_S) -> tuple[tuple[str, str], ...]:
        """The metadata every call carries: the session, proving membership first if needed
        (within `timeout` seconds, at most HANDSHAKE_TIMEOUT_S)."""
        self._connect()
        with self._lock:
            now = time.monotonic()
            if self._metadata and (
                now - self._session_used > SESSION_IDLE_S / 2
                or now - self._session_made > SESSION_MAX_S / 2
            ):  # prove again well before the node ends the session (a stream refused at its
                # start would fail the batches queued on it)
                self._metadata = None
            self._session_used = now
            if self._metadata is None:
                assert self._channel is not None
                try:  # (NodeAuthStub: generated and unannotated, as NodeStub)
                    session = handshake(
                        pb_grpc.NodeAuthStub(self._channel),  # type: ignore[no-untyped-call]
                        self.auth,
                        self.address,
                        self._cert_sha256,
                        min(timeout, HANDSHAKE_TIMEOUT_S),
                    )
                except grpc.RpcError as exc:
                    raise self._handshake_error(exc, min(timeout, HANDSHAKE_TIMEOUT_S)) from None
                self._metadata = ((SESSION_METADATA, session),) if session else ()
                self._session_made = now
            return self._metadata

    def authenticate(self) -> None:
        """Prove membership now (else it happens before the first call)."""
        self.metadata()

    def _handshake_error(self, exc: grpc.RpcError, timeout: float | None = None) -> NodeError:
        code = exc.code() if hasattr(exc, "code") else None
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return NodeError(
                f"node {self.address} does not know the pool handshake (an older Potluck); "
                "install the same Potluck version on every machine"
            )
        if code == grpc.StatusCode.UNAVAILABLE and not self.auth.tls and speaks_tls(self.address):
            return NodeError(
                f"node {self.address} speaks TLS (its worker runs with --tls); pass --tls here too"
            )
        return _explain(self.address, exc, timeout)

    def session_refused(self, exc: BaseException) -> bool:
        """If `exc` is a node's refusal of this client's session, forget the session (the next
        call proves again) and say so."""
        if not (
            isinstance(exc, grpc.RpcError)
            and hasattr(exc, "code")
            and exc.code() == grpc.StatusCode.UNAUTHENTICATED
            and (exc.details() or "").startswith(SESSION_PREFIX)
        ):
            return False
        with self._lock:
            had = bool(self._metadata)
            self._metadata = None
        return had

    def _call(self, method: str, request: object, timeout: float, retry: bool = True) -> Any:
        """The stub's `method` called with the session's metadata; Any: the generated stub is
        unannotated, so each caller names the reply type the method returns."""
        for attempt in range(2):
            md = self.metadata(timeout)
            try:
                return getattr(self.stub, method)(request, timeout=timeout, metadata=md)
            except grpc.RpcError as exc:
                if self.session_refused(exc) and retry and attempt == 0:
                    continue  # refused before the handler ran: safe to send again
                raise _explain(self.address, exc, timeout) from None
        raise AssertionError("unreachable")

    def hello(
        self,
        head_name: str = "",
        plan_ids: Sequence[str] = (),
        timeout: float = 5.0,
        authenticate: bool = True,
    ) -> pb.HelloReply:
        """What the node is. Hello is open to anyone; by default the client proves membership first,
        so that a secret mismatch shows up here (authenticate=False: ask a node of another pool).
        head_name: who asks (the node's log); plan_ids: plans this head still uses (a node keeps
        them while the head is idle)."""
        request = codec.hello_request(head_name, plan_ids)
        reply: pb.HelloReply
        if not authenticate:
            try:
                reply = self._connect().Hello(request, timeout=timeout)
            except grpc.RpcError as exc:
                raise _explain(self.address, exc, timeout) from None
        else:
            reply = self._call("Hello", request, timeout)
        self.data_port = reply.data_port
        return reply

    def probe_speed(
        self, request: pb.ProbeSpeedRequest, timeout: float = 30.0
    ) -> pb.ProbeSpeedReply:
        """A ProbeSpeed as it is (tests send malformed ones); the planner calls decode_speed."""
        reply: pb.ProbeSpeedReply = self._call("ProbeSpeed", request, timeout)
        return reply

    def decode_speed(self, matrices: Iterable[Matrix], timeout: float = 30.0) -> float:
        """The node's decode speed (weight bytes per second) through `matrices`, one layer of the
        model being planned."""
        return self.probe_speed(codec.probe_speed_request(matrices), timeout).bytes_per_s

    def probe_link(self, address: str, timeout: float = 15.0) -> pb.ProbeLinkReply:
        """Ask this node to measure its link to the node at `address` (transport/linkprobe.py)."""
        request = codec.probe_link_request(address)
        reply: pb.ProbeLinkReply = self._call("ProbeLink", request, timeout)
        return reply

    def load(self, request: pb.LoadRequest, timeout: float = 300.0) -> pb.LoadReply:
        """request: codec.load_request (sent again after PutTensors when the node lacked some)."""
        reply: pb.LoadReply = self._call("Load", request, timeout)
        return reply

    def put_tensors(self, chunks: Iterator[pb.TensorChunk], timeout: float = 3600.0) -> pb.PutReply:
        reply: pb.PutReply = self._call("PutTensors", chunks, timeout, retry=False)
        return reply

    def get_tensors(
        self, request: pb.GetTensorsRequest, timeout: float = 3600.0
    ) -> Iterator[pb.TensorChunk]:
        """A peer's tensors of a model file it has (node/transfer.py); NodeError when it lacks
        the file or the link breaks, also midway."""
        replies: Iterator[pb.TensorChunk] = self._call("GetTensors", request, timeout, retry=False)
        try:
            yield from replies
        except grpc.RpcError as exc:
            raise _explain(self.address, exc, timeout) from None

    def forward(self, request: pb.ForwardRequest, timeout: float = 120.0) -> pb.ForwardReply:
        reply: pb.ForwardReply = self._call("Forward", request, timeout)
        return reply

    def drop(self, request: pb.DropRequest, timeout: float = 10.0) -> pb.DropReply:
        """A Drop as it is (a node relays its head's down the chain); a head calls
        drop_sequences or release."""
        reply: pb.DropReply = self._call("Drop", request, timeout)
        return reply

    def drop_sequences(self, plan_id: str, seq_ids: Sequence[int], timeout: float = 10.0) -> None:
        """Free these sequences' caches on every stage of the plan (passed down the chain)."""
        self.drop(codec.drop_request(plan_id, seq_ids), timeout)

    def release(self, plan_id: str, timeout: float = 10.0) -> None:
        """The head is done with the plan: every stage frees it (passed down the chain)."""
        self.drop(codec.drop_request(plan_id, release=True), timeout)

    # -- training (node/training.py) -------------------------------------------------------------
    def train_open(self, request: pb.TrainOpenRequest, timeout: float = 120.0) -> pb.TrainOpenReply:
        """request: codec.train_open_request (and add_model_file when the node asks)."""
        reply: pb.TrainOpenReply = self._call("TrainOpen", request, timeout)
        return reply

    def train_grad(
        self,
        session_id: str,
        step: int,
        n_learned: int,
        sequences: Iterable[tuple[Sequence[int], Sequence[bool]]],
        timeout: float = 600.0,
    ) -> pb.TrainGradReply:
        """The gradient of a share of a batch: (ids, learned per position) per sequence."""
        request = codec.train_grad_request(session_id, step, n_learned, sequences)
        reply: pb.TrainGradReply = self._call("TrainGrad", request, timeout)
        return reply

    def train_apply(self, session_id: str, step: int, grads: bytes, timeout: float = 600.0) -> None:
        """Take the step with the summed gradient (f32 bytes, as TrainGradReply.grads)."""
        self._call("TrainApply", codec.train_apply_request(session_id, step, grads), timeout)

    def train_close(self, session_id: str, timeout: float = 10.0) -> None:
        self._call("TrainClose", codec.train_close_request(session_id), timeout)

    def close(self) -> None:
        """Hang up for good: later calls and sends fail at once (a freed plan's relay, a pool
        after a failover) instead of opening a new connection that nobody would close."""
        with self._lock:
            self._closed = True
        self._stream_link.close()
        if self._data_link is not None:
            self._data_link.close()
        with self._lock:
            channel, self._channel, self._stub, self._metadata = self._channel, None, None, None
        if channel is not None:
            channel.close()
