"""The head's view of its pool: static peers first, then the workers of its pool found on mDNS,
each with how it was found, and the ones seen but left out with the reason.

    found = gather(static_peers, browser.results(), pool="home")
    found.peers    # to plan with
    found.skipped  # [(peer, "speaks protocol 1, this head 2: ...")]
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from potluck.discovery.mdns import WorkerAdvert
from potluck.discovery.measure import REACHED, session_error, tcp_reach
from potluck.discovery.static import CONFIG, MDNS, Peer, dedupe
from potluck.hosts import is_loopback
from potluck.transport.client import NodeClient
from potluck.transport.codec import PROTOCOL_VERSION

REACH_TIMEOUT_S = 1.0  # a worker announced on this LAN answers a TCP connect in well under 1 s


@dataclass(frozen=True)
class Found:
    peers: tuple[Peer, ...]  # to use: static ones in the order given, then mDNS ones
    skipped: tuple[tuple[Peer, str], ...]  # seen but left out, with the reason


def _ips(host: str) -> set[str]:
    """The IPv4 addresses a static host names, to tell it is the same worker mDNS announces."""
    try:
        ipaddress.ip_address(host)
        return {host}
    except ValueError:
        pass
    try:
        return {str(a[4][0]) for a in socket.getaddrinfo(host, None, socket.AF_INET)}
    except (OSError, UnicodeError):
        return set()


def usable_reason(advert: WorkerAdvert, pool: str) -> str:
    """Why a head of `pool` cannot use this announced worker ("" if it can)."""
    if advert.pool != pool:
        return (
            f"it is in pool {advert.pool!r}, this head in {pool!r} (--pool {advert.pool} to use it)"
        )
    if advert.protocol_version != PROTOCOL_VERSION:
        return (
            f"it speaks protocol {advert.protocol_version or '?'} (potluck "
            f"{advert.potluck_version or '?'}), this head {PROTOCOL_VERSION}: install the same "
            "Potluck version on every machine"
        )
    return ""


Vet = Callable[[Peer], str]  # why a peer cannot be used ("" if it can)


def reachable(peer: Peer) -> str:
    """An announcement can outlive its worker by a few seconds: does it accept a connection?"""
    r = tcp_reach(peer.host, peer.port, REACH_TIMEOUT_S)
    if r.outcome == REACHED:
        return ""
    where = {MDNS: "it is announced on mDNS but", CONFIG: "it is in the peers file but"}
    return f"{where.get(peer.source, 'it')} does not accept connections ({r.outcome}: {r.detail})"


def member(dial: Callable[[str], NodeClient]) -> Vet:
    """reachable() and then the pool secret's handshake: a neighbour's worker that announces the
    same pool name (say the default, "home") but holds another secret is left out, not fatal."""

    def vet(peer: Peer) -> str:
        if why := reachable(peer):
            return why
        client = dial(peer.address)
        try:
            return session_error(client)[0]
        finally:
            client.close()

    return vet


def gather(
    static: Sequence[Peer],
    adverts: Sequence[WorkerAdvert],
    pool: str,
    vet: Vet = reachable,
    vet_typed: bool = False,
) -> Found:
    """Peers typed on the command line as given (a bad one fails loudly later, when the head dials
    it: the user named it just now), or with `vet_typed` when they pass `vet` (a long-running head
    starts on the peers that answer and asks the others again); those of the peers file, a
    standing list (a laptop on it may be closed), and each announced worker of `pool` that speaks
    this protocol, when they pass `vet`."""
    peers: list[Peer] = []
    skipped: list[tuple[Peer, str]] = []
    for p in dedupe(static):
        why = vet(p) if vet_typed or p.source == CONFIG else ""
        if why:
            skipped.append((p, why))
        else:
            peers.append(p)
    known = {(ip, p.port) for p in peers for ip in _ips(p.host)}
    known |= {(p.host, p.port) for p in peers}
    for a in adverts:
        peer = Peer(a.address, MDNS, a)
        if any((ip, a.port) in known for ip in a.addresses):
            continue  # the same worker, already a static peer
        why = usable_reason(a, pool) or vet(peer)
        if why:
            skipped.append((peer, why))
            continue
        peers.append(peer)
        known |= {(ip, a.port) for ip in a.addresses}
    # Workers send hidden states straight to the next one: a worker that listens on this
    # machine's loopback cannot be reached by the others, so it only joins a pool of loopbacks.
    if any(not is_loopback(p.host) for p in peers):
        for p in [p for p in peers if p.source == MDNS and is_loopback(p.host)]:
            peers.remove(p)
            skipped.append((p, LOOPBACK_ONLY))
    return Found(tuple(peers), tuple(skipped))


LOOPBACK_ONLY = (
    "it listens on this machine's loopback only, which the other workers cannot reach "
    "(start it with -H 0.0.0.0)"
)


def describe_peer(peer: Peer) -> str:
    """'10.0.0.2:50052 (mDNS: desk, 15.2 GiB free)' / '10.0.0.3:50052 (--peer)'."""
    if peer.advert is not None:
        a = peer.advert
        return f"{peer.address} (mDNS: {a.node_name}, {a.cores} cores, {a.memory_bytes / 2**30:.1f} GiB free)"
    how = {"static": "--peer", "config": "peers file"}.get(peer.source, peer.source)
    return f"{peer.address} ({how})"


class PeerFinder:
    """Static peers plus, with `browse_s`, an mDNS browse that starts at construction (so it
    overlaps the head's start-up) and ends when `find()` is called and the window has passed.
    vet_typed: find() vets the peers typed on the command line too (gather()'s `vet_typed`).

    error: why mDNS could not run ("" if it ran or was not asked for)."""

    def __init__(
        self, static: Sequence[Peer], pool: str, browse_s: float | None, vet_typed: bool = False
    ) -> None:
        from potluck.discovery.mdns import Browser, DiscoveryError, check_pool_name

        self.static, self.pool, self.browse_s = list(static), check_pool_name(pool), browse_s
        self.vet_typed = vet_typed
        self.error = ""
        self.browser: Browser | None = None
        if browse_s:
            try:
                self.browser = Browser(pool, browse_s)
            except DiscoveryError as exc:
                self.error = str(exc)

    @property
    def browsing(self) -> bool:
        return self.browser is not None

    def find(self, vet: Vet = reachable) -> Found:
        """End the browse (after its window) and merge; `vet` as in gather()."""
        adverts = self.browser.results() if self.browser is not None else []
        self.browser = None
        return gather(self.static, adverts, self.pool, vet, self.vet_typed)

    def again(self, vet: Vet = reachable) -> Found:
        """Look once more, after find(): the static peers and a fresh browse of `browse_s` (when
        mDNS is on), every one vetted, those typed too: one that does not answer yet is no
        newcomer, and is asked again next time (blocking; a running server calls it on a thread
        to find workers started after it)."""
        from potluck.discovery.mdns import Browser, DiscoveryError

        adverts = []
        if self.browse_s and not self.error:
            try:
                adverts = Browser(self.pool, self.browse_s).results()
            except DiscoveryError as exc:
                self.error = str(exc)
        return gather(self.static, adverts, self.pool, vet, vet_typed=True)

    def close(self) -> None:
        if self.browser is not None:
            self.browser.close()
            self.browser = None
