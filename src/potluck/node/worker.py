"""`potluck worker`: build and start a node's gRPC server and its data port.

The node's parts live beside this file: the gRPC servicer (node/service.py) over its plan store
(node/plans.py), loader (node/loading.py), forward passes (node/compute.py) and follow-up batches
(node/followup.py). A stage forwards its hidden states straight to the next stage's node and
passes the reply (token ids) back up the chain.
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc

from potluck.errors import PotluckError
from potluck.model.stage import DEFAULT_COMPUTE, Compute
from potluck.node.plans import DEFAULT_IDLE_S
from potluck.node.service import NodeService
from potluck.node.weights import LocalModels
from potluck.transport import potluck_pb2_grpc as pb_grpc
from potluck.transport.auth import AuthService, Handshakes, PoolAuth, SessionTable
from potluck.transport.client import NODE_SERVER_OPTIONS
from potluck.transport.dataplane import DataServer
from potluck.transport.guard import Guard
from potluck.transport.spin import DEFAULT_SPIN_S
from potluck.transport.tls import server_credentials, server_ssl_context


class NodeServer:
    """A node's gRPC server and its data port (transport/dataplane.py), started and stopped
    together."""

    def __init__(self, grpc_server: grpc.Server, data: DataServer | None, data_port: int) -> None:
        self.grpc, self.data, self.data_port = grpc_server, data, data_port

    def stop(self, grace: float | None) -> threading.Event:
        if self.data is not None:
            self.data.stop()
        return self.grpc.stop(grace)

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self.grpc.wait_for_termination(timeout)


def serve(host: str, port: int, name: str | None = None, settings: Compute = DEFAULT_COMPUTE,
          models: LocalModels | None = None, auth: PoolAuth | None = None,
          mem_limit: int | None = None, idle_s: float = DEFAULT_IDLE_S,
          data_port: int | None = -1, spin_s: float = DEFAULT_SPIN_S,
          ) -> tuple[NodeServer, int]:  # fmt: skip
    """Start the node's gRPC server and its data port; returns them and the bound gRPC port
    (port 0 picks a free one). data_port: -1 = the gRPC port + 1, or any free port if that one is
    taken; 0 = any free port; None = no data port (forward requests then come on gRPC streams).
    With TLS the data port speaks TLS with the node's certificate. spin_s: how long the node polls
    its data connections for the next frame before it blocks (transport/spin.py; 0 = never).
    settings: how this node computes (-t, --cache-type, --no-repack, -ngl, --device, --vram).
    models: the model files it may open and where it keeps received tensors (node/weights.py).

    With a pool secret in `auth`, every call but Hello and the handshake needs a session
    (transport/guard.py); with `auth.tls` the node serves TLS with its own certificate."""
    auth = auth if auth is not None else PoolAuth()
    sessions = SessionTable()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=32),
        options=NODE_SERVER_OPTIONS,
        interceptors=[Guard(auth, sessions)],
    )
    service = NodeService(
        name or f"{host}:{port}", settings, models, auth, mem_limit, idle_s, spin_s
    )
    # the generated gRPC module is unannotated (grpc's plugin writes no type hints)
    pb_grpc.add_NodeServicer_to_server(service, server)  # type: ignore[no-untyped-call]
    auth_service = AuthService(Handshakes(auth, sessions))
    pb_grpc.add_NodeAuthServicer_to_server(auth_service, server)  # type: ignore[no-untyped-call]
    if auth.tls and auth.identity is None:
        raise PotluckError("a worker with --tls needs its certificate (auth.identity)")
    try:
        if auth.tls and auth.identity is not None:
            bound = server.add_secure_port(f"{host}:{port}", server_credentials(auth.identity))
        else:
            bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpcio raises where older versions returned 0
        bound = 0
    if bound == 0:
        raise PotluckError(
            f"cannot listen on {host}:{port}: the port is taken (a worker also takes port + 1 for "
            "hidden states: give workers on one machine ports two apart, e.g. -p 50052 and -p "
            "50054) or the address is not on this machine"
        )
    server.start()
    data = None
    if data_port is not None:
        tls = server_ssl_context(auth.identity) if auth.tls and auth.identity else None
        data = DataServer(auth, service.forwarder.serve_forward, tls=tls, wait=service.wait)
        try:
            service.data_port = data.listen(host, bound + 1 if data_port == -1 else data_port)
        except OSError as exc:
            if data_port != -1:
                server.stop(0)
                raise PotluckError(
                    f"cannot listen on data port {host}:{data_port} ({exc.strerror or exc}): pick a "
                    "free one with --data-port, or leave the flag out (port + 1, else any free port)"
                ) from None
            service.data_port = data.listen(host, 0)  # port + 1 is taken: any free one
    return NodeServer(server, data, service.data_port), bound
