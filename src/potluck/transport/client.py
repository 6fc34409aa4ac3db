"""The gRPC client a head (or an upstream stage) uses to talk to a node, with deadlines."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future

import grpc

from potluck.errors import PotluckError
from potluck.transport import potluck_pb2 as pb
from potluck.transport import potluck_pb2_grpc as pb_grpc
from potluck.transport.codec import MAX_MESSAGE_BYTES

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


class NodeError(PotluckError):
    """A node could not be reached or refused a call; the message names the node and the reason."""


def _explain(address: str, exc: grpc.RpcError) -> NodeError:
    code = exc.code() if hasattr(exc, "code") else None
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.UNAVAILABLE:
        return NodeError(
            f"node {address} is unreachable ({detail}); is `potluck worker` running there and the port open?"
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return NodeError(
            f"node {address} did not answer in time; it may be overloaded or the link is down"
        )
    name = code.name if code is not None else "ERROR"
    return NodeError(f"node {address}: {detail} ({name})")


class NodeClient:
    """One channel to one node. Every call has a deadline (seconds)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.NodeStub(self.channel)

    def _call(self, method: str, request: object, timeout: float) -> object:
        try:
            return getattr(self.stub, method)(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise _explain(self.address, exc) from None

    def hello(self, request: pb.HelloRequest, timeout: float = 5.0) -> pb.HelloReply:
        return self._call("Hello", request, timeout)  # type: ignore[return-value]

    def load(self, request: pb.LoadRequest, timeout: float = 300.0) -> pb.LoadReply:
        return self._call("Load", request, timeout)  # type: ignore[return-value]

    def put_tensors(self, chunks: Iterator[pb.TensorChunk], timeout: float = 3600.0) -> pb.PutReply:
        return self._call("PutTensors", chunks, timeout)  # type: ignore[return-value]

    def forward(self, request: pb.ForwardRequest, timeout: float = 120.0) -> pb.ForwardReply:
        return self._call("Forward", request, timeout)  # type: ignore[return-value]

    def forward_async(
        self, request: pb.ForwardRequest, timeout: float = 120.0
    ) -> Future[pb.ForwardReply]:
        """Forward without waiting: the reply (or a NodeError) arrives in the returned future."""
        out: Future[pb.ForwardReply] = Future()
        call = self.stub.Forward.future(request, timeout=timeout)

        def done(c: grpc.Future) -> None:
            try:
                out.set_result(c.result())
            except grpc.RpcError as exc:
                out.set_exception(_explain(self.address, exc))
            except grpc.FutureCancelledError:
                out.set_exception(NodeError(f"node {self.address}: the call was cancelled"))

        call.add_done_callback(done)
        return out

    def drop(self, request: pb.DropRequest, timeout: float = 10.0) -> pb.DropReply:
        return self._call("Drop", request, timeout)  # type: ignore[return-value]

    def close(self) -> None:
        self.channel.close()
