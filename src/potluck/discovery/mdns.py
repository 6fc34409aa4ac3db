"""mDNS / DNS-SD (zeroconf): a worker announces itself, a head finds the workers of its pool.

A worker registers one service of type `_potluck._tcp.local.` whose TXT record carries what a head
needs before it dials: the pool name, the wire protocol version, the Potluck version, the port, the
physical cores and the usable memory (bytes, after OS headroom, when the worker started). A head
browses for a short window (DEFAULT_BROWSE_S) and keeps the workers whose pool name is its own:
the pool name is what keeps two households on one network apart (it is a label, not a secret).

Where a worker announces, by the address it listens on:
  127.x (the default)  -> only on the loopback interface, with that address: a head on the same
                          machine finds it, nothing leaves the machine.
  0.0.0.0              -> on every interface, with every non-loopback IPv4 address of the machine.
  one address          -> on that interface only, with that address.
IPv4 only: mDNS over IPv6 adds nothing a home LAN lacks, and link-local v6 addresses need scopes.

Multicast does not cross routers (VLANs, a guest Wi-Fi) and some Wi-Fi access points drop it:
static peers (static.py) cover those networks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import platform
import re
import secrets
import socket
import threading
import time
from dataclasses import dataclass

import ifaddr
from zeroconf import (
    BadTypeInNameException,
    InterfaceChoice,
    IPVersion,
    NonUniqueNameException,
    ServiceBrowser,
    ServiceInfo,
    ServiceStateChange,
    Zeroconf,
)

from potluck.errors import PotluckError

SERVICE_TYPE = "_potluck._tcp.local."
DEFAULT_POOL = "home"
DEFAULT_BROWSE_S = 1.0  # a worker on the same LAN answers a query within ~0.1 s
RESOLVE_TIMEOUT_MS = 500  # per service, when the browse answer lacked its records
_POOL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class DiscoveryError(PotluckError):
    """mDNS cannot run here (no multicast-capable interface, the port taken) or a bad pool name."""


def check_pool_name(name: str) -> str:
    """A pool name: 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit."""
    if not _POOL_NAME.match(name):
        raise DiscoveryError(
            f"pool name {name!r} must be 1-63 letters, digits, '.', '_' or '-' "
            "(starting with a letter or digit), e.g. --pool home"
        )
    return name


@dataclass(frozen=True)
class WorkerAdvert:
    """What a worker announces. memory_bytes was measured when it started (a Hello gives it now)."""

    instance: str  # the mDNS instance name, unique on the network, e.g. "desk-50052-3fa9"
    node_name: str  # the machine's host name
    pool: str
    protocol_version: int  # 0: the worker did not say (not a Potluck worker we understand)
    potluck_version: str
    addresses: tuple[str, ...]  # IPv4, those on one of this machine's subnets first
    port: int
    cores: int  # physical
    memory_bytes: int
    os: str  # platform.system() of the worker: "Linux", "Windows", "Darwin"

    @property
    def address(self) -> str:
        """host:port to dial (the first address)."""
        return f"{self.addresses[0]}:{self.port}"

    def txt(self) -> dict[str, str]:
        return {
            "pool": self.pool,
            "proto": str(self.protocol_version),
            "version": self.potluck_version,
            "port": str(self.port),
            "cores": str(self.cores),
            "mem": str(self.memory_bytes),
            "os": self.os,
            "node": self.node_name,
        }


def _int(props: dict[str, str | None], key: str) -> int:
    value = props.get(key) or ""
    return int(value) if value.isdigit() else 0


def advert_from_info(info: ServiceInfo) -> WorkerAdvert | None:
    """A resolved service -> WorkerAdvert; None when it has no IPv4 address or port. Missing or
    malformed TXT values become 0 / "" (a worker of another version may announce other keys)."""
    props = {
        k.decode("utf-8", "replace"): v.decode("utf-8", "replace") if v is not None else None
        for k, v in info.properties.items()
        if isinstance(k, bytes) and isinstance(v, bytes | None)
    }
    addresses = tuple(info.parsed_addresses(IPVersion.V4Only))
    if not addresses or not info.port:
        return None
    instance = info.name.removesuffix("." + SERVICE_TYPE)
    return WorkerAdvert(
        instance=instance,
        node_name=props.get("node") or instance,
        pool=props.get("pool") or "",
        protocol_version=_int(props, "proto"),
        potluck_version=props.get("version") or "",
        addresses=_local_first(addresses),
        port=info.port,
        cores=_int(props, "cores"),
        memory_bytes=_int(props, "mem"),
        os=props.get("os") or "",
    )


# -- this machine's addresses ------------------------------------------------------------------------
def _local_networks() -> list[ipaddress.IPv4Network]:
    nets = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if ip.is_IPv4 and isinstance(ip.ip, str):
                nets.append(ipaddress.IPv4Network(f"{ip.ip}/{ip.network_prefix}", strict=False))
    return nets


def _local_first(addresses: tuple[str, ...]) -> tuple[str, ...]:
    """Addresses on one of this machine's subnets first (a multi-homed worker may announce a
    Docker bridge or a VPN address the head cannot reach); the order is otherwise kept."""
    nets = _local_networks()

    def on_link(a: str) -> bool:
        ip = ipaddress.IPv4Address(a)
        return any(ip in n for n in nets if n.prefixlen < 32)

    return tuple(sorted(addresses, key=lambda a: not on_link(a)))


def lan_addresses() -> list[str]:
    """This machine's non-loopback, non-link-local IPv4 addresses."""
    out = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if ip.is_IPv4 and isinstance(ip.ip, str):
                a = ipaddress.IPv4Address(ip.ip)
                if not (a.is_loopback or a.is_link_local):
                    out.append(ip.ip)
    return list(dict.fromkeys(out))


def announce_scope(host: str) -> tuple[list[str], list[str]]:
    """For a worker listening on `host`: (addresses to announce, interfaces to announce on, as
    their IPv4 addresses). Raises DiscoveryError when there is nothing to announce."""
    if host in ("", "0.0.0.0"):
        addresses = lan_addresses()
        if not addresses:
            raise DiscoveryError("this machine has no LAN IPv4 address to announce (only loopback)")
        return addresses, [*addresses, "127.0.0.1"]  # loopback too: a head on this machine
    try:
        ip = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError) as exc:
        raise DiscoveryError(f"cannot resolve {host!r} to an IPv4 address: {exc}") from None
    if ip.is_unspecified or ip.version != 4:
        raise DiscoveryError(f"mDNS announces IPv4 addresses; {host} is not one")
    return [str(ip)], [str(ip)]


# -- worker side -------------------------------------------------------------------------------------
class Advertiser:
    """Announces one worker until `close()` (which sends goodbye packets, so heads drop it at
    once). `start()` blocks while zeroconf probes the name (≈ 1-2 s)."""

    def __init__(self, advert: WorkerAdvert, interfaces: list[str]) -> None:
        self.advert = advert
        self.interfaces = interfaces
        self.zc: Zeroconf | None = None
        self.info: ServiceInfo | None = None

    def start(self) -> WorkerAdvert:
        """Register; returns the advert under the name it got (renamed "-2" … on a clash)."""
        a = self.advert
        self.info = ServiceInfo(
            SERVICE_TYPE,
            f"{a.instance}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(x) for x in a.addresses],
            port=a.port,
            properties=a.txt(),
            # our own host record: machines that share a host name (or namespaces) must not clash
            server=f"potluck-{a.port}-{secrets.token_hex(3)}.local.",
        )
        try:
            self.zc = Zeroconf(interfaces=self.interfaces, ip_version=IPVersion.V4Only)
            self.zc.register_service(self.info, allow_name_change=True)
        except (OSError, NonUniqueNameException, BadTypeInNameException) as exc:
            self.close()
            raise DiscoveryError(f"cannot announce on mDNS: {exc}") from None
        name = self.info.name.removesuffix("." + SERVICE_TYPE)
        self.advert = dataclasses.replace(a, instance=name)
        return self.advert

    def close(self) -> None:
        if self.zc is not None:
            with contextlib.suppress(Exception):  # shutting down: nothing to report to anyone
                self.zc.close()  # unregisters every service: goodbye packets
            self.zc = None


def worker_advert(
    port: int, pool: str, addresses: list[str], protocol_version: int, potluck_version: str,
    cores: int, memory_bytes: int,
) -> WorkerAdvert:  # fmt: skip
    node = socket.gethostname().split(".")[0] or "potluck"
    # host name + port + a random tag: machines that share a host name (cloned images, network
    # namespaces) and start at the same moment must not probe for the same name (zeroconf does
    # not settle simultaneous probes reliably)
    instance = re.sub(r"[^A-Za-z0-9-]", "-", node)[:40] + f"-{port}-{secrets.token_hex(2)}"
    return WorkerAdvert(
        instance=instance,
        node_name=node,
        pool=check_pool_name(pool),
        protocol_version=protocol_version,
        potluck_version=potluck_version,
        addresses=tuple(addresses),
        port=port,
        cores=cores,
        memory_bytes=memory_bytes,
        os=platform.system(),
    )


# -- head side ---------------------------------------------------------------------------------------
class Browser:
    """Browses from construction on (in zeroconf's threads), so the window overlaps whatever the
    head does meanwhile; `results()` waits for what is left of it and returns the workers seen.

    pool: keep only workers of this pool (None: every pool, for `potluck nodes`)."""

    def __init__(self, pool: str | None, window_s: float = DEFAULT_BROWSE_S) -> None:
        self.pool = check_pool_name(pool) if pool is not None else None
        self.window_s = window_s
        self.started = time.monotonic()
        self._names: set[str] = set()
        self._lock = threading.Lock()
        try:
            self.zc: Zeroconf | None = Zeroconf(
                interfaces=InterfaceChoice.All, ip_version=IPVersion.V4Only
            )
            self.browser: ServiceBrowser | None = ServiceBrowser(
                self.zc, SERVICE_TYPE, handlers=[self._on_change]
            )
        except (OSError, RuntimeError) as exc:  # RuntimeError: zeroconf found no interface
            self.zc, self.browser = None, None
            raise DiscoveryError(f"cannot browse mDNS: {exc}") from None

    def _on_change(
        self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        with self._lock:
            if state_change is ServiceStateChange.Removed:
                self._names.discard(name)
            else:
                self._names.add(name)

    def seen(self) -> set[str]:
        """Service names seen so far and not said goodbye (unresolved, any pool)."""
        with self._lock:
            return set(self._names)

    def results(self) -> list[WorkerAdvert]:
        """Wait out the window, resolve what was seen, close. Sorted by instance name."""
        if self.zc is None:
            return []
        try:
            time.sleep(max(0.0, self.started + self.window_s - time.monotonic()))
            with self._lock:
                names = sorted(self._names)
            found = []
            for name in names:
                info = ServiceInfo(SERVICE_TYPE, name)
                if not info.load_from_cache(self.zc) and not info.request(
                    self.zc, RESOLVE_TIMEOUT_MS
                ):
                    continue  # it went away between the answer and now
                advert = advert_from_info(info)
                if advert is not None and (self.pool is None or advert.pool == self.pool):
                    found.append(advert)
            return found
        finally:
            self.close()

    def close(self) -> None:
        if self.browser is not None:
            self.browser.cancel()
            self.browser = None
        if self.zc is not None:
            self.zc.close()
            self.zc = None


def browse(pool: str | None, window_s: float = DEFAULT_BROWSE_S) -> list[WorkerAdvert]:
    """The workers of `pool` (None: of every pool) that answer within `window_s` seconds."""
    return Browser(pool, window_s).results()
