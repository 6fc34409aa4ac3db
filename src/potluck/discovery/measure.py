"""Measuring a node from the head: can its port be reached (and if not, how it fails), the gRPC
handshake, round-trip time and jitter, bandwidth both ways, what it says about itself, and its
speed under sustained load. `potluck nodes` and `potluck doctor` are built on these.

Every call has a deadline; nothing here raises on a node that misbehaves: results carry the error.
"""

from __future__ import annotations

import errno
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from potluck.errors import PotluckError
from potluck.transport import codec
from potluck.transport.client import AuthError, NodeClient

if TYPE_CHECKING:
    from potluck.transport import potluck_pb2 as pb

# How a TCP connect ended.
REACHED, REFUSED, UNREACHABLE, TIMEOUT, NO_NAME, OTHER = (
    "reached", "refused", "unreachable", "timeout", "no-name", "error",
)  # fmt: skip
_UNREACHABLE_ERRNOS = {
    getattr(errno, n) for n in ("EHOSTUNREACH", "ENETUNREACH", "EHOSTDOWN", "ENETDOWN")
    if hasattr(errno, n)
}  # fmt: skip
CLIENT_ERROR = "CLIENT"  # Hello.code when this side failed before any call
BANDWIDTH_TARGET_S = 0.25  # grow the transfer until one takes this long (or hits the cap)
BANDWIDTH_MAX_BYTES = 16 * 2**20  # the node's Echo cap (node/service.py ECHO_MAX_BYTES)
BANDWIDTH_START_BYTES = 256 * 2**10


@dataclass(frozen=True)
class Reach:
    outcome: str  # REACHED, REFUSED, UNREACHABLE, TIMEOUT, NO_NAME or OTHER
    detail: str  # the OS's words, e.g. "[Errno 113] No route to host"
    seconds: float


def tcp_reach(host: str, port: int, timeout: float) -> Reach:
    """Open (and close) a TCP connection to host:port. Refused = the host answered that nothing
    listens there (or a firewall rejects); unreachable = no route / no answer to ARP; timeout =
    no answer at all (a firewall that drops, a machine that is off)."""
    t0 = time.perf_counter()

    def done(outcome: str, detail: str) -> Reach:
        return Reach(outcome, detail, time.perf_counter() - t0)

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        return done(NO_NAME, str(exc))
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.settimeout(timeout)
        try:
            s.connect(addr)
        except ConnectionRefusedError as exc:
            return done(REFUSED, str(exc))
        except TimeoutError as exc:
            return done(TIMEOUT, str(exc) or f"no answer in {timeout:g} s")
        except OSError as exc:
            if exc.errno in _UNREACHABLE_ERRNOS:
                return done(UNREACHABLE, str(exc))
            return done(OTHER, str(exc))
    return done(REACHED, "connected")


@dataclass(frozen=True)
class Hello:
    """A Hello's outcome: the reply, or the gRPC status code name and details."""

    reply: pb.HelloReply | None
    code: str  # "OK" or a grpc.StatusCode name
    detail: str
    rtt_s: float


def rpc_code(exc: grpc.RpcError) -> tuple[str, str]:
    code = exc.code() if hasattr(exc, "code") else None
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    return (code.name if code is not None else "UNKNOWN"), detail or ""


def hello(client: NodeClient, timeout: float, head_name: str = "potluck doctor") -> Hello:
    """Hello is open to anyone (no pool secret needed): what the node is, and its version."""
    t0 = time.perf_counter()
    try:
        reply: pb.HelloReply = client.stub.Hello(codec.hello_request(head_name), timeout=timeout)
    except grpc.RpcError as exc:
        code, detail = rpc_code(exc)
        return Hello(None, code, detail, time.perf_counter() - t0)
    except PotluckError as exc:  # the client could not open the channel (with --tls: no TLS there)
        return Hello(None, CLIENT_ERROR, str(exc), time.perf_counter() - t0)
    return Hello(reply, "OK", "", time.perf_counter() - t0)


def session_error(client: NodeClient) -> tuple[str, bool]:
    """Prove pool membership (transport/auth.py): ("", False) when the node accepts this head,
    else (why, whether it is the pool secret that does not match)."""
    try:
        client.metadata()
    except AuthError as exc:
        return str(exc), True
    except PotluckError as exc:
        return str(exc), False
    return "", False


def describe(client: NodeClient, timeout: float) -> pb.DescribeReply | None:
    """What the node says about its threads, cores and OS; None if it cannot (an older worker).
    Raises grpc.RpcError when the node refuses (no session)."""
    try:
        reply: pb.DescribeReply = client.stub.Describe(
            codec.describe_request(), timeout=timeout, metadata=client.metadata()
        )
    except grpc.RpcError as exc:
        if rpc_code(exc)[0] == "UNIMPLEMENTED":
            return None
        raise
    return reply


@dataclass(frozen=True)
class LinkStats:
    rtt_ms: tuple[float, ...]  # every ping, in order
    down_bytes_per_s: float  # node -> head
    up_bytes_per_s: float  # head -> node

    @property
    def median_ms(self) -> float:
        return statistics.median(self.rtt_ms)

    @property
    def jitter_ms(self) -> float:
        """Spread of the round trips: 90th minus 10th percentile (ms)."""
        if len(self.rtt_ms) < 3:
            return 0.0
        q = statistics.quantiles(self.rtt_ms, n=10)
        return q[-1] - q[0]


def _timed(call: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def ping_ms(client: NodeClient, pings: int, timeout: float) -> list[float]:
    """Round trips of an empty Echo, after one warm-up (which opens the connection)."""
    echo, md = codec.echo_request(), client.metadata()
    client.stub.Echo(echo, timeout=timeout, metadata=md)
    return [
        _timed(lambda: client.stub.Echo(echo, timeout=timeout, metadata=md)) * 1e3
        for _ in range(pings)
    ]


def bandwidth(client: NodeClient, up: bool, rtt_s: float, timeout: float) -> float:
    """Bytes per second one way: transfers grow ×4 from 256 KiB until one takes
    BANDWIDTH_TARGET_S or reaches BANDWIDTH_MAX_BYTES; the best of two at that size, less one
    round trip."""
    n, md = BANDWIDTH_START_BYTES, client.metadata()

    def once(n: int) -> float:
        req = codec.echo_request(payload_bytes=n) if up else codec.echo_request(reply_bytes=n)
        return _timed(lambda: client.stub.Echo(req, timeout=timeout, metadata=md))

    t = once(n)
    while t < BANDWIDTH_TARGET_S and n < BANDWIDTH_MAX_BYTES:
        n = min(n * 4, BANDWIDTH_MAX_BYTES)
        t = once(n)
    t = min(t, once(n))
    return n / max(t - rtt_s, t / 10)


def measure_link(client: NodeClient, pings: int = 20, timeout: float = 10.0) -> LinkStats:
    """RTT samples and bandwidth both ways. Raises grpc.RpcError if the node stops answering."""
    rtt = ping_ms(client, pings, timeout)
    rtt_s = statistics.median(rtt) / 1e3
    down = bandwidth(client, False, rtt_s, timeout)
    up = bandwidth(client, True, rtt_s, timeout)
    return LinkStats(tuple(rtt), down, up)


def stress(
    client: NodeClient, seconds: float, interval: float
) -> tuple[list[tuple[float, float]], str]:
    """The node's decode speed under `seconds` of load: ([(t, bytes/s)], error or "")."""
    samples: list[tuple[float, float]] = []
    try:
        for s in client.stub.Stress(
            codec.stress_request(seconds, interval),
            timeout=seconds + 30,
            metadata=client.metadata(),
        ):
            samples.append((s.t, s.bytes_per_s))
    except grpc.RpcError as exc:
        code, detail = rpc_code(exc)
        return samples, f"{detail} ({code})"
    except PotluckError as exc:  # the handshake failed
        return samples, str(exc)
    return samples, ""


def local_interface(host: str, port: int) -> str | None:
    """The name of this machine's interface that traffic to host:port leaves through (no packet
    is sent: a UDP connect only picks the route). None if it cannot be told."""
    import psutil

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            local_ip = s.getsockname()[0]
    except OSError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == local_ip for a in addrs):
            return name
    return None


def is_wireless(interface: str) -> bool:
    """Linux: the kernel marks Wi-Fi interfaces in sysfs; elsewhere, the usual names."""
    import os

    if os.path.exists(f"/sys/class/net/{interface}/wireless") or os.path.exists(
        f"/sys/class/net/{interface}/phy80211"
    ):
        return True
    low = interface.lower()
    return low.startswith("wl") or "wi-fi" in low or "wifi" in low or "wireless" in low
