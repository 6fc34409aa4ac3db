"""A quick measurement of one link with the node's Echo RPC: what the planner needs per link
(one-way latency and bandwidth), in well under a second on a home network.

`potluck nodes` / `doctor` measure more thoroughly (discovery/measure.py); a head measures every
link of a pool at each start, so this stays short: a few empty round trips, then one 1 MiB
transfer (a prompt micro-batch of hidden states is about that size)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from potluck.transport import potluck_pb2 as pb
from potluck.transport.client import NodeClient
from potluck.transport.codec import echo_request

PINGS = 5
PAYLOAD_BYTES = 1 << 20


@dataclass(frozen=True)
class LinkMeasure:
    latency_s: float  # one way: half the median round trip
    bytes_per_s: float  # one 1 MiB transfer, less a round trip


def quick_link(client: NodeClient, timeout: float = 10.0) -> LinkMeasure:
    """Raises NodeError (via the client) when the node does not answer."""
    md = client.metadata()
    empty = echo_request()

    def timed(req: pb.EchoRequest) -> float:
        t0 = time.perf_counter()
        client.stub.Echo(req, timeout=timeout, metadata=md)
        return time.perf_counter() - t0

    timed(empty)  # opens the connection
    rtt = statistics.median(timed(empty) for _ in range(PINGS))
    t = timed(echo_request(payload_bytes=PAYLOAD_BYTES))
    return LinkMeasure(rtt / 2, PAYLOAD_BYTES / max(t - rtt, t / 10, 1e-6))
