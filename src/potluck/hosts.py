"""Whether an address a user typed stays on this machine: the one loopback check.

A worker that listens only on loopback may go without a pool secret and a server without an API
key; mDNS keeps a loopback-only worker out of a pool of LAN machines. All of them ask this.
"""

from __future__ import annotations

import ipaddress
import socket


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback one: 127.0.0.0/8, ::1, an IPv4-mapped
    ::ffff:127.x, a name such as localhost that resolves only to those. Brackets ([::1]) and an
    IPv6 zone (%lo) are allowed. A name that does not resolve, or resolves to any other address
    (0.0.0.0 and :: included: every interface), is not loopback."""
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return _loopback_ip(host)
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    try:
        return bool(infos) and all(_loopback_ip(str(i[4][0])) for i in infos)
    except ValueError:
        return False


def _loopback_ip(text: str) -> bool:
    """ValueError when `text` is not an IP address."""
    ip = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback
