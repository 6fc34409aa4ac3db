"""`potluck nodes`: every node seen, measured. One NodeReport per node: how it was found, what it
has (devices, free memory, cores, version), the link to it (round trip, bandwidth both ways) and
whether this head can use it, and if not, why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from potluck import __version__
from potluck.discovery.measure import (
    REACHED,
    LinkStats,
    describe,
    hello,
    measure_link,
    rpc_code,
    session_error,
    tcp_reach,
)
from potluck.discovery.pool import usable_reason
from potluck.discovery.static import Peer
from potluck.planner import THIS_MACHINE
from potluck.planner.errors import fmt_bytes
from potluck.transport.client import NodeClient

Dial = Callable[[str], NodeClient]  # address -> a client (the CLI builds it, with the pool secret)


@dataclass(frozen=True)
class NodeReport:
    name: str  # the address, or "this machine"
    found: str  # "mDNS", "static", "config", "" for this machine
    pool: str  # announced pool ("" when not announced)
    version: str  # potluck version ("" when unknown)
    devices: tuple[str, ...]  # "cpu 15.2 GiB"
    memory_bytes: int
    cores: int
    threads: int  # 0 when unknown
    link: LinkStats | None
    usable: bool
    why: str  # "" when usable


def local_report(memory_bytes: int, cores: int, threads: int) -> NodeReport:
    return NodeReport(
        THIS_MACHINE, "", "", __version__, (f"cpu {fmt_bytes(memory_bytes)}",), memory_bytes,
        cores, threads, None, True, "",
    )  # fmt: skip


def inspect(peer: Peer, pool: str, dial: Dial, timeout: float = 5.0) -> NodeReport:
    """Reach the node, say hello, measure the link. Never raises for a node that misbehaves."""
    a = peer.advert

    def report(usable: bool = False, why: str = "", **kw: Any) -> NodeReport:
        base: dict[str, Any] = dict(
            name=peer.address, found=peer.source, pool=a.pool if a else "",
            version=a.potluck_version if a else "", devices=(), memory_bytes=a.memory_bytes if a else 0,
            cores=a.cores if a else 0, threads=0, link=None,
        )  # fmt: skip
        return NodeReport(**{**base, **kw}, usable=usable, why=why)

    reach = tcp_reach(peer.host, peer.port, timeout)
    if reach.outcome != REACHED:
        return report(why=f"{reach.outcome}: {reach.detail}")
    client = dial(peer.address)
    try:
        h = hello(client, timeout, head_name="potluck nodes")
        if h.reply is None:
            return report(why=f"{h.detail} ({h.code})")
        r = h.reply
        devices = tuple(f"{d.kind} {fmt_bytes(d.memory_bytes)}" for d in r.devices)
        memory = sum(d.memory_bytes for d in r.devices)
        known: dict[str, Any] = dict(
            version=r.potluck_version, devices=devices, memory_bytes=memory, cores=r.physical_cores
        )
        refused, _ = session_error(client)  # every call but Hello needs the pool secret
        if refused:
            return report(why=refused, **known)
        try:
            d = describe(client, timeout)
            link = measure_link(client, pings=10, timeout=timeout)
        except grpc.RpcError as exc:
            code, detail = rpc_code(exc)
            return report(why=f"{detail} ({code})", **known)
        why = usable_reason(a, pool) if a is not None else ""
        if not why and memory == 0:
            why = "it reports no free memory"
        return report(usable=not why, why=why, threads=d.threads if d else 0, link=link, **known)
    finally:
        client.close()


def fmt_rate(bytes_per_s: float) -> str:
    """Network speed as people quote it: bits per second."""
    bits = bytes_per_s * 8
    for unit, size in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= size:
            return f"{bits / size:.3g} {unit}"
    return f"{bits:.0f} bit/s"


NODE_COLUMNS = (
    "node", "found", "pool", "version", "devices", "free memory", "cores/threads", "RTT",
    "bandwidth ↓/↑", "usable",
)  # fmt: skip


def format_row(r: NodeReport) -> tuple[str, ...]:
    link = r.link
    return (
        r.name,
        {"static": "--peer", "config": "peers file"}.get(r.found, r.found) or "-",
        r.pool or "-",
        r.version or "?",
        ", ".join(r.devices) or "-",
        fmt_bytes(r.memory_bytes) if r.memory_bytes else "-",
        f"{r.cores or '?'}/{r.threads or '?'}",
        f"{link.median_ms:.2f} ms ± {link.jitter_ms:.2f}" if link else "-",
        f"{fmt_rate(link.down_bytes_per_s)} / {fmt_rate(link.up_bytes_per_s)}" if link else "-",
        "yes" if r.usable else f"no: {r.why}",
    )


def report_json(r: NodeReport) -> dict[str, Any]:
    """A NodeReport as plain JSON values (the link with its summary figures)."""
    out = dataclasses.asdict(r)
    if r.link is not None:
        out["link"] = {
            "rtt_ms": list(r.link.rtt_ms),
            "median_ms": r.link.median_ms,
            "jitter_ms": r.link.jitter_ms,
            "down_bytes_per_s": r.link.down_bytes_per_s,
            "up_bytes_per_s": r.link.up_bytes_per_s,
        }
    return out
