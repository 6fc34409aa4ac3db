"""Static peers: the addresses a user types (`--peer`, `--rpc`) or keeps in a peers file.

They always work, where multicast does not (across VLANs, on some Wi-Fi, in containers). The peers
file (`peers` in the config folder, by default ~/.config/potluck/peers) holds one host:port per
line; a port may be left out (50052, a worker's default); `#` starts a comment; blank lines are
ignored:

    # the desktop in the study
    192.168.1.20:50052
    mini-pc.local          # port 50052
    [fd00::7]:50060
"""

from __future__ import annotations

import ipaddress
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from potluck.errors import PotluckError

if TYPE_CHECKING:
    from potluck.discovery.mdns import WorkerAdvert

DEFAULT_PORT = 50052  # a worker's default port, as llama.cpp's rpc-server
PEERS_FILE = "peers"
# How a peer became known; `potluck nodes` shows it.
STATIC, CONFIG, MDNS = "static", "config", "mDNS"


class PeerAddressError(PotluckError):
    """A host:port that is not one: the message names the text and, in a file, its line."""


@dataclass(frozen=True)
class Peer:
    """A node the head may use: its address as gRPC dials it (host:port, IPv6 in brackets) and how
    it was found. `advert` is what the node announced on mDNS (None for a static peer)."""

    address: str
    source: str
    advert: WorkerAdvert | None = None

    @property
    def host(self) -> str:
        return split_address(self.address)[0]

    @property
    def port(self) -> int:
        return split_address(self.address)[1]


def split_address(address: str) -> tuple[str, int]:
    """'10.0.0.2:50052' -> ('10.0.0.2', 50052); '[fd00::7]:50052' -> ('fd00::7', 50052)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def parse_address(text: str, default_port: int | None = None) -> str:
    """A peer as typed -> the canonical host:port gRPC dials. Without `default_port` the port is
    required. Raises PeerAddressError with the reason."""
    s = text.strip()
    example = "e.g. 192.168.1.20:50052"
    if not s or any(c.isspace() for c in s):
        raise PeerAddressError(f"{text!r} is not host:port ({example})")
    scheme, sep, rest = s.partition("://")
    if sep:  # a URL, as browsers and `potluck serve` print them
        raise PeerAddressError(
            f"{text!r} is a URL: give HOST:PORT without {scheme}:// (e.g. {rest.rstrip('/')})"
        )
    if s.startswith("["):  # [IPv6]:port or [IPv6]
        host, sep, rest = s[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise PeerAddressError(f"{text!r} is not [IPv6 address]:port (e.g. [fd00::7]:50052)")
        port_text = rest[1:] if rest else ""
        _check_ipv6(host, text)
    elif s.count(":") > 1:  # a bare IPv6 address: no port can be told apart from it
        _check_bare_ipv6(s, text)
        host, port_text = s, ""
    else:
        host, _, port_text = s.partition(":")
        if ":" in s and not port_text:
            raise PeerAddressError(f"{text!r} has an empty port ({example})")
    if not host:
        raise PeerAddressError(f"{text!r} has no host ({example})")
    if port_text:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise PeerAddressError(f"{text!r}: port {port_text!r} is not a number in 1-65535")
        port = int(port_text)
    elif default_port is not None:
        port = default_port
    else:
        raise PeerAddressError(f"{text!r} has no port ({example})")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_ipv6(host: str, text: str) -> None:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        raise PeerAddressError(f"{text!r}: {host!r} is not an IPv6 address") from None


def _check_bare_ipv6(s: str, text: str) -> None:
    """More than one colon and no brackets: an IPv6 address, else say which mistake it is."""
    if _is_ipv6(s):
        return
    host, _, port = s.rpartition(":")
    if _is_ipv6(host):
        raise PeerAddressError(
            f"{text!r}: put an IPv6 address in brackets before its port (e.g. [{host}]:{port})"
        )
    head = s.split(":", 1)[0]
    if any(c not in string.hexdigits for c in head):  # a name or an IPv4 address, not IPv6
        raise PeerAddressError(
            f"{text!r} has {s.count(':')} colons: give HOST:PORT with one (IPv6 in brackets, "
            "e.g. [fd00::7]:50052)"
        )
    _check_ipv6(s, text)


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def peers_from_flags(peer: Sequence[str] | None, rpc: str | None) -> list[Peer]:
    """--peer A --peer B and --rpc A,B (llama.cpp's spelling), in the order typed; an address
    typed twice is an error."""
    texts = list(peer or []) + [p for p in (rpc or "").split(",") if p.strip()]
    addresses: list[str] = []
    for t in texts:
        address = parse_address(t)
        if address in addresses:  # most likely a typo for another worker: merging would hide it
            raise PeerAddressError(
                f"{address} given twice: name each worker once (workers on one machine listen "
                "on ports two apart, e.g. 50052 and 50054)"
            )
        addresses.append(address)
    return [Peer(a, STATIC) for a in addresses]


def read_peers_file(path: Path) -> list[Peer]:
    """The peers in `path`; [] when the file does not exist. Raises PeerAddressError naming the
    file and line of the first bad entry."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as exc:
        raise PeerAddressError(f"cannot read the peers file {path}: {exc}") from None
    peers = []
    for n, line in enumerate(text.splitlines(), start=1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        try:
            peers.append(Peer(parse_address(entry, DEFAULT_PORT), CONFIG))
        except PeerAddressError as exc:
            raise PeerAddressError(f"peers file {path} line {n}: {exc}") from None
    return dedupe(peers)


def dedupe(peers: Iterable[Peer]) -> list[Peer]:
    """Each address once; the first occurrence (and so its source) wins."""
    seen: dict[str, Peer] = {}
    for p in peers:
        seen.setdefault(p.address, p)
    return list(seen.values())
