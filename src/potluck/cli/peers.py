"""How this process finds and joins its pool: the config folder, the pool secret and the
credentials made from it, the static peers (--peer, --rpc, the peers file), the mDNS browse
(a head) and announcement (a worker)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from potluck import __version__
from potluck.cli.console import err
from potluck.cli.options import DEFAULT_POOL

if TYPE_CHECKING:
    from potluck.discovery.mdns import Advertiser
    from potluck.discovery.pool import PeerFinder
    from potluck.discovery.static import Peer
    from potluck.transport.auth import PoolAuth
    from potluck.transport.client import NodeClient


def _config_dir() -> Path:
    """POTLUCK_CONFIG, else $XDG_CONFIG_HOME/potluck, else ~/.config/potluck (the peers file)."""
    if env := os.environ.get("POTLUCK_CONFIG"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "potluck"


def _mdns_on(no_mdns: bool) -> bool:
    return not no_mdns and os.environ.get("POTLUCK_MDNS", "1").lower() not in ("0", "off", "no")


def _static_peers(peer: list[str] | None, rpc: str | None) -> list[Peer]:
    """--peer / --rpc as typed, then the peers file in the config folder."""
    from potluck.discovery.static import (
        PEERS_FILE,
        PeerAddressError,
        dedupe,
        peers_from_flags,
        read_peers_file,
    )

    try:
        flags = peers_from_flags(peer, rpc)
    except PeerAddressError as exc:
        raise typer.BadParameter(f"peer {exc}") from None
    return dedupe(flags + read_peers_file(_config_dir() / PEERS_FILE))


def _peers(
    peer: list[str] | None,
    rpc: str | None,
    pool: str = DEFAULT_POOL,
    no_mdns: bool = True,
    keep_asking: bool = False,
) -> PeerFinder:
    """The static peers and, unless no_mdns, an mDNS browse for workers of `pool` that starts now
    (it overlaps loading the model); `_found` ends it. keep_asking: a long-running command (serve,
    batch) leaves out a --peer that does not answer, as any other, and asks it again while it
    runs; the others fail when they dial it."""
    from potluck.discovery.mdns import DEFAULT_BROWSE_S
    from potluck.discovery.pool import PeerFinder

    browse_s = DEFAULT_BROWSE_S if _mdns_on(no_mdns) else None
    return PeerFinder(_static_peers(peer, rpc), pool, browse_s, vet_typed=keep_asking)


def _found(finder: PeerFinder, auth_of: Callable[[], PoolAuth] | None = None) -> list[str]:
    """End the browse; say which nodes were found and how, and which were left out and why.
    auth_of() gives the pool credentials: announced workers that refuse them are left out."""
    from potluck.discovery.pool import describe_peer, member, reachable
    from potluck.transport.client import NodeClient

    browsing = finder.browsing
    vet = member(lambda a: NodeClient(a, auth_of())) if auth_of is not None else reachable
    found = finder.find(vet)
    if finder.error:
        err.print(f"[yellow]mDNS unavailable:[/] {finder.error}; using static peers only")
    how = f"mDNS {finder.browse_s:g} s" if browsing else "mDNS off"
    if found.peers:
        used = ", ".join(describe_peer(p) for p in found.peers)
        err.print(f"[dim]pool {finder.pool!r} ({how}): {used}[/]")
    elif browsing:
        err.print(f"[dim]pool {finder.pool!r} ({how}): no workers found, this machine alone[/]")
    for p, why in found.skipped:  # one of your peers file's machines is worth a yellow line
        if p.source == "mDNS":
            err.print(f"[dim]  left out {describe_peer(p)}: {why}[/]")
        else:  # with keep_asking, the Recruiter (pool/replicas.py) asks it again
            again = "; asked again while a batch job runs" if finder.vet_typed else ""
            err.print(f"[yellow]  left out {describe_peer(p)}: {why}{again}[/]")
    return [p.address for p in found.peers]


def _secret(secret: str | None) -> tuple[str | None, str]:
    """The pool secret and where it came from: --secret, else POTLUCK_SECRET, else the file."""
    from potluck.transport.secret import SECRET_FILE, check_secret, read_secret_file

    if secret is not None:
        return check_secret(secret, "--secret"), "--secret"
    if env := os.environ.get("POTLUCK_SECRET"):
        return check_secret(env, "POTLUCK_SECRET"), "POTLUCK_SECRET"
    path = _config_dir() / SECRET_FILE
    found = read_secret_file(path)
    return found, (str(path) if found else "none")


def _auth(secret: str | None, tls: bool, worker: bool = False) -> PoolAuth:
    """How this process proves pool membership (transport/auth.py); a worker with --tls also gets
    its certificate, made once in the config folder."""
    from potluck.transport.auth import PoolAuth
    from potluck.transport.tls import load_or_create_identity

    auth = PoolAuth.from_secret(_secret(secret)[0], tls)
    if worker and tls:
        auth = PoolAuth(auth.key, True, load_or_create_identity(_config_dir()))
    return auth


def _dialer(secret: str | None, tls: bool) -> Callable[[str], NodeClient]:
    """address -> a client with the pool's credentials, for `potluck nodes` / `doctor`."""
    from potluck.transport.client import NodeClient

    auth = _auth(secret, tls)
    return lambda address: NodeClient(address, auth)


def _announce(host: str, port: int, pool: str, no_mdns: bool) -> Advertiser | None:
    """Announce the worker on mDNS (see discovery/mdns.py for where); None when off or it cannot
    (said on stderr: heads can still use --peer). SIGTERM (systemd, docker stop) then ends the
    worker like Ctrl-C, so it says goodbye."""
    import signal

    from potluck.discovery.mdns import Advertiser, DiscoveryError, announce_scope, worker_advert
    from potluck.node.probe import physical_cores, usable_memory_bytes
    from potluck.transport.codec import PROTOCOL_VERSION

    if not _mdns_on(no_mdns):
        return None

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        addresses, interfaces = announce_scope(host)
        advert = worker_advert(
            port, pool, addresses, PROTOCOL_VERSION, __version__, physical_cores(),
            usable_memory_bytes(),
        )  # fmt: skip
        advertiser = Advertiser(advert, interfaces)
        a = advertiser.start()
    except DiscoveryError as exc:
        err.print(f"[yellow]not announced on mDNS:[/] {exc}; heads can still use --peer")
        return None
    where = "this machine only" if host.startswith("127.") else ", ".join(a.addresses)
    err.print(f"announced on mDNS as {a.instance!r} in pool {pool!r} ({where})")
    return advertiser
