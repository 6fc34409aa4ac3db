"""Network namespaces as stand-in machines: separate network stacks joined by veth links, with an
optional bandwidth cap per link, torn down reliably even when a test fails.

Each host is a Linux network namespace (`ip netns`) with its own interfaces, addresses, routes and
ports, so a worker in one host and a head in another talk over a real (virtual) Ethernet link, and
mDNS multicast behaves as on a real LAN segment. What they do not stand in for: separate CPUs and
memory (every namespace shares this machine's), and latency (netem is not available here: put a
delaying TCP proxy in the path when a test needs it).

    from netns import netns_lan, netns_pair, netns_routed

    with netns_pair(rate="100mbit") as (a, b):          # a = 10.77.0.1, b = 10.77.0.2, one segment
        w = a.popen([sys.executable, "-m", "potluck.cli", "worker", "-H", a.ip, "--insecure"])
        b.run([sys.executable, "-m", "potluck.cli", "nodes", "--peer", f"{a.ip}:50052"])

    with netns_lan(3, rates=["1gbit", "100mbit", None]) as hosts:   # three hosts on one switch
        hosts[1].set_rate("10mbit")                       # change a cap mid-test
        hosts[2].cut(); ...; hosts[2].restore()           # pull the cable, plug it back

    with netns_routed() as (a, b):   # two subnets and a router between: unicast passes, mDNS does not

Topologies:
- netns_lan(n): hosts 10.77.0.1 … 10.77.0.n/24, each linked by a veth pair to one bridge that lives
  in its own "switch" namespace (so nothing is added to this machine's own network namespace).
  A rate caps the host's link in both directions (tbf on the host's end and on the switch's end).
- netns_pair(): netns_lan(2), returned as a tuple.
- netns_routed(): a = 10.77.1.2/24, b = 10.77.2.2/24, joined by a router namespace (10.77.1.1,
  10.77.2.1, IP forwarding on). Link-local multicast (mDNS, 224.0.0.251) is never routed, as between
  two VLANs or a wired LAN and a guest Wi-Fi: discovery cannot see across, static peers still work.

Every namespace name starts with `pltest-<pid>-`; leftovers of a killed test run (their pid is dead)
are removed when the next lab starts. Processes started with `Host.popen` run in their own process
group and are terminated (then killed) at teardown, before the namespaces are deleted.

Each context manager calls `require_netns()` first, which skips the test with the reason when this
is not root or `ip netns` does not work. Mark such tests `@pytest.mark.netns`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import pytest

PREFIX = "pltest"
SUBNET = "10.77.0"  # netns_lan: host i (from 0) is SUBNET.(i + 1)/24
TIMEOUT_S = 10.0  # every `ip` / `tc` command
TERM_GRACE_S = 5.0  # after SIGTERM, before SIGKILL
_counter = itertools.count()
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_UNIT = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=TIMEOUT_S, check=check
    )


def require_netns() -> None:
    """Skip the calling test, with the reason, when network namespaces cannot be made here."""
    if os.geteuid() != 0:
        pytest.skip("network namespace tests need root (ip netns add)")
    try:
        _ip("netns", "list")
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"`ip netns` is not available: {exc}")


def rate_bits_per_s(rate: str) -> float:
    """'100mbit' -> 1e8. tc's bit units only (bit, kbit, mbit, gbit), so a cap is never ambiguous."""
    m = _RATE.match(rate)
    if m is None:
        raise ValueError(f"rate {rate!r} is not like 100mbit (units: bit, kbit, mbit, gbit)")
    return float(m.group(1)) * _UNIT[m.group(2)]


def _tbf(ns: str, dev: str, rate: str | None) -> None:
    """Cap what `dev` sends to `rate` (token bucket); None removes the cap."""
    _ip("-n", ns, "link", "show", dev)  # fail loudly on a wrong name before tc's vaguer error
    subprocess.run(
        ["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"],
        capture_output=True,
        timeout=TIMEOUT_S,
        check=False,  # absent when the link had no cap
    )
    if rate is None:
        return
    byte_rate = rate_bits_per_s(rate) / 8
    burst = max(int(byte_rate / 100), 16 * 1024)  # 10 ms of traffic, at least a few full packets
    subprocess.run(
        ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
         "burst", str(burst), "latency", "100ms"],
        capture_output=True, text=True, timeout=TIMEOUT_S, check=True,
    )  # fmt: skip


@dataclass
class Host:
    """One namespace: `ip` is its address on the lab network, `dev` its interface there."""

    ns: str
    ip: str
    dev: str = "eth0"
    peer_ns: str = ""  # the namespace at the other end of its link (switch or router)
    peer_dev: str = ""
    procs: list[subprocess.Popen] = field(default_factory=list)

    def _argv(self, cmd: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *cmd]

    def run(
        self, cmd: Sequence[str], timeout: float = 60.0, check: bool = True, **kw
    ) -> subprocess.CompletedProcess[str]:
        """Run `cmd` inside this namespace to completion; text output captured unless kw says
        otherwise. Raises subprocess.TimeoutExpired after `timeout` s (the child is killed)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self._argv(cmd), timeout=timeout, check=check, **kw)

    def popen(self, cmd: Sequence[str], **kw) -> subprocess.Popen:
        """Start `cmd` inside this namespace in its own process group; it is stopped at teardown
        (or earlier with `stop`)."""
        proc = subprocess.Popen(self._argv(cmd), start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen) -> int:
        """SIGTERM the process group, SIGKILL after TERM_GRACE_S; returns the exit code."""
        return _stop(proc)

    def set_rate(self, rate: str | None) -> None:
        """Cap this host's link at `rate` in both directions (None: uncapped)."""
        _tbf(self.ns, self.dev, rate)
        _tbf(self.peer_ns, self.peer_dev, rate)

    def cut(self) -> None:
        """Pull the cable: the link goes down at the switch/router end (packets are lost, the
        host's own interface and addresses stay as they are)."""
        _ip("-n", self.peer_ns, "link", "set", self.peer_dev, "down")

    def restore(self) -> None:
        _ip("-n", self.peer_ns, "link", "set", self.peer_dev, "up")


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=TERM_GRACE_S)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
    return proc.returncode


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale() -> None:
    """Delete namespaces of earlier lab runs whose process is gone (a test run killed mid-way)."""
    out = _ip("netns", "list", check=False).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.match(rf"^{PREFIX}-(\d+)-", name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            _ip("netns", "del", name, check=False)


class _Lab:
    """The namespaces of one topology; `close` removes all of them whatever state they are in."""

    def __init__(self) -> None:
        require_netns()
        _remove_stale()
        self.tag = f"{PREFIX}-{os.getpid()}-{next(_counter)}"
        self.namespaces: list[str] = []
        self.hosts: list[Host] = []

    def netns(self, role: str) -> str:
        name = f"{self.tag}-{role}"
        _ip("netns", "add", name)
        self.namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        return name

    def veth(self, ns_a: str, dev_a: str, ns_b: str, dev_b: str) -> None:
        """A veth pair created directly in both namespaces (names never touch this machine's own
        namespace, so concurrent labs cannot collide)."""
        _ip("link", "add", dev_a, "netns", ns_a, "type", "veth", "peer", "name", dev_b,
            "netns", ns_b)  # fmt: skip
        _ip("-n", ns_a, "link", "set", dev_a, "up")
        _ip("-n", ns_b, "link", "set", dev_b, "up")

    def close(self) -> None:
        for h in self.hosts:
            for p in h.procs:
                with contextlib.suppress(Exception):  # teardown goes on whatever one process does
                    _stop(p)
        for name in reversed(self.namespaces):
            _ip("netns", "del", name, check=False)


@contextlib.contextmanager
def netns_lan(
    n: int = 2, rate: str | None = None, rates: Sequence[str | None] | None = None
) -> Iterator[list[Host]]:
    """n hosts (10.77.0.1 … 10.77.0.n) on one switch; `rate` caps every link, `rates` each one."""
    if not 1 <= n <= 250:
        raise ValueError(f"a lab has 1 to 250 hosts, got {n}")
    if rates is not None and len(rates) != n:
        raise ValueError(f"{len(rates)} rates for {n} hosts")
    lab = _Lab()
    try:
        sw = lab.netns("sw")
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for i in range(n):
            ns = lab.netns(f"h{i}")
            port = f"p{i}"
            lab.veth(ns, "eth0", sw, port)
            _ip("-n", sw, "link", "set", port, "master", "br0")
            ip = f"{SUBNET}.{i + 1}"
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            host = Host(ns, ip, "eth0", sw, port)
            lab.hosts.append(host)
            cap = rates[i] if rates is not None else rate
            if cap is not None:
                host.set_rate(cap)
        yield lab.hosts
    finally:
        lab.close()


@contextlib.contextmanager
def netns_pair(rate: str | None = None) -> Iterator[tuple[Host, Host]]:
    """Two hosts on one segment: a = 10.77.0.1, b = 10.77.0.2."""
    with netns_lan(2, rate=rate) as (a, b):
        yield a, b


@contextlib.contextmanager
def netns_routed(rate: str | None = None) -> Iterator[tuple[Host, Host]]:
    """a = 10.77.1.2 and b = 10.77.2.2 on two subnets joined by a router namespace."""
    lab = _Lab()
    try:
        router = lab.netns("rt")
        subprocess.run(
            ["ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1"],
            capture_output=True, text=True, timeout=TIMEOUT_S, check=True,
        )  # fmt: skip
        for i, role in ((1, "a"), (2, "b")):
            ns = lab.netns(role)
            lab.veth(ns, "eth0", router, f"r{i}")
            _ip("-n", router, "addr", "add", f"10.77.{i}.1/24", "dev", f"r{i}")
            _ip("-n", ns, "addr", "add", f"10.77.{i}.2/24", "dev", "eth0")
            _ip("-n", ns, "route", "add", "default", "via", f"10.77.{i}.1")
            host = Host(ns, f"10.77.{i}.2", "eth0", router, f"r{i}")
            lab.hosts.append(host)
            if rate is not None:
                host.set_rate(rate)
        yield lab.hosts[0], lab.hosts[1]
    finally:
        lab.close()
