"""`potluck doctor`: the checks that find what users trip over, each with one line of advice.

Per node: can its port be reached (refused / unreachable / timeout tell different stories, each
with a firewall hint for the node's OS), does it speak this protocol and version, does it accept
this pool's secret, are its threads set to physical cores, does the link look like Wi-Fi or a
congested network (measured round trips and bandwidth), does its speed hold under sustained load
(thermal throttling). For the pool: do the model and its context fit the memory, KV cache counted.

Each check ends ok / warn / fail (or skip, saying why); `run_doctor` returns them all in order.

Each check is a short function; they stay in one file so that it reads in the order the report
prints (over 400 lines on purpose).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from potluck import __version__
from potluck.discovery.measure import (
    CLIENT_ERROR,
    NO_NAME,
    REACHED,
    REFUSED,
    TIMEOUT,
    UNREACHABLE,
    LinkStats,
    describe,
    hello,
    is_wireless,
    local_interface,
    measure_link,
    rpc_code,
    session_error,
    stress,
    tcp_reach,
)
from potluck.discovery.nodes import Dial, fmt_rate
from potluck.discovery.static import Peer
from potluck.errors import PotluckError
from potluck.planner import THIS_MACHINE, Link, ModelFootprint, NodeInfo, NotEnoughMemoryError
from potluck.planner.errors import fmt_bytes
from potluck.planner.nodes import Links
from potluck.transport import potluck_pb2 as pb
from potluck.transport.client import NodeClient
from potluck.transport.codec import PROTOCOL_VERSION
from potluck.transport.tls import speaks_tls

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"

# A wired home LAN: round trips of 0.1-0.5 ms (a gRPC call adds ~0.2 ms), jitter below 1 ms,
# 940 Mbit/s on gigabit. Wi-Fi: 2-10 ms, jitter of several ms, 50-400 Mbit/s.
LINK_RTT_WARN_MS = 3.0
LINK_JITTER_WARN_MS = 3.0
LINK_BANDWIDTH_WARN = 40e6  # bytes/s (320 Mbit/s): below this prompts crawl across the hop
THROTTLE_WARN = 0.15  # a drop of 15 % between the first and last fifth of the load


@dataclass(frozen=True)
class Check:
    check: str  # "reach", "handshake", "version", "data port", "secret", "threads", "link", "load", "model"
    node: str
    status: str  # OK, WARN, FAIL or SKIP
    detail: str  # what was measured or seen
    advice: str = ""  # what to do (empty when there is nothing to do)


@dataclass(frozen=True)
class DoctorConfig:
    pool: str
    threads: int | None = None  # this machine's -t (None: the default, physical cores)
    model: Path | None = None
    ctx: int | None = None
    connect_timeout_s: float = 3.0
    call_timeout_s: float = 5.0
    load_seconds: float = 60.0  # 0: skip the load check
    load_interval_s: float = 1.0


# -- advice ------------------------------------------------------------------------------------------
def firewall_hint(port: int, os_name: str = "") -> str:
    """How to open `port` on the node's firewall; every OS when the node's OS is not known."""
    hints = {
        "Linux": f"Linux: `sudo ufw allow {port}/tcp` (Ubuntu) or `sudo firewall-cmd "
        f"--permanent --add-port={port}/tcp && sudo firewall-cmd --reload` (Fedora)",
        "Windows": "Windows: allow Python through Windows Defender Firewall, or in an admin "
        f"PowerShell `New-NetFirewallRule -DisplayName Potluck -Direction Inbound -Protocol TCP "
        f"-LocalPort {port} -Action Allow`",
        "Darwin": "macOS: System Settings › Network › Firewall › Options: allow incoming "
        "connections for python",
    }
    return hints.get(os_name) or "; ".join(hints.values())


def _reach_check(peer: Peer, timeout: float) -> Check:
    r = tcp_reach(peer.host, peer.port, timeout)
    os_name = peer.advert.os if peer.advert else ""
    fw = firewall_hint(peer.port, os_name)
    if r.outcome == REACHED:
        return Check("reach", peer.address, OK, f"port {peer.port} open ({r.seconds * 1e3:.1f} ms)")
    if r.outcome == REFUSED:
        return Check(
            "reach", peer.address, FAIL,
            f"port closed: {peer.host} answered, but nothing accepts connections on port {peer.port}",
            f"start `potluck worker -H 0.0.0.0 -p {peer.port}` there (a worker on 127.0.0.1 only "
            f"serves its own machine), or open the port: {fw}",
        )  # fmt: skip
    if r.outcome == UNREACHABLE:
        return Check(
            "reach", peer.address, FAIL, f"host unreachable: {r.detail}",
            f"check the address (`potluck nodes` lists what mDNS sees), that {peer.host} is on and "
            "on this network (not a guest Wi-Fi or another VLAN), and the cable/Wi-Fi",
        )  # fmt: skip
    if r.outcome == TIMEOUT:
        return Check(
            "reach", peer.address, FAIL,
            f"timeout: no answer from {peer.host}:{peer.port} in {timeout:g} s",
            f"a firewall on {peer.host} drops the port, or the machine sleeps: {fw}",
        )  # fmt: skip
    if r.outcome == NO_NAME:
        return Check(
            "reach", peer.address, FAIL, f"cannot resolve {peer.host!r}: {r.detail}",
            "use the machine's IP address (its `potluck worker` prints it; `potluck nodes` lists "
            "workers found on mDNS) or its `name.local`",
        )  # fmt: skip
    return Check("reach", peer.address, FAIL, r.detail, "check the address and the network")


def _data_port_check(peer: Peer, port: int, timeout: float) -> Check:
    """The worker's data port (hidden states, transport/dataplane.py): without it the pool works,
    over the slower gRPC stream."""
    r = tcp_reach(peer.host, port, timeout)
    if r.outcome == REACHED:
        return Check("data port", peer.address, OK, f"data port {port} open")
    hint = firewall_hint(port, peer.advert.os if peer.advert else "")
    return Check(
        "data port", peer.address, WARN,
        f"data port {port} cannot be reached ({r.outcome}): hidden states will take the slower "
        "gRPC stream (≈ 0.2 ms more per hop)",
        f"open port {port} too: {hint}",
    )  # fmt: skip


def _handshake_checks(peer: Peer, h_code: str, h_detail: str, timeout: float) -> Check:
    """A Hello that failed although the port is open."""
    a = peer.advert
    if h_code == "FAILED_PRECONDITION" and "protocol version" in h_detail:
        theirs = (
            f" (it announces potluck {a.potluck_version}, protocol {a.protocol_version})"
            if a
            else ""
        )
        return Check(
            "version", peer.address, FAIL,
            f"version mismatch: {h_detail}{theirs}; this head: potluck {__version__}, protocol "
            f"{PROTOCOL_VERSION}",
            f"install the same Potluck version on every machine (this one has {__version__})",
        )  # fmt: skip
    if h_code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        return _secret_fail(peer, h_detail)
    if h_code == "DEADLINE_EXCEEDED":
        return Check(
            "handshake", peer.address, FAIL,
            f"the port accepts connections but no answer to Hello in {timeout:g} s",
            "the worker is hung or busy (stopped with Ctrl-Z? swapping?): restart it",
        )  # fmt: skip
    if h_code == CLIENT_ERROR:
        return Check("handshake", peer.address, FAIL, h_detail, "do what the message says")
    if h_code == "UNAVAILABLE" and speaks_tls(peer.address):
        return Check(
            "handshake", peer.address, FAIL,
            "the worker speaks TLS (it runs with --tls) and this head does not",
            "pass --tls here too (every machine of a TLS pool needs it)",
        )  # fmt: skip
    if h_code in ("UNIMPLEMENTED", "UNAVAILABLE", "INTERNAL", "UNKNOWN"):
        return Check(
            "handshake", peer.address, FAIL,
            f"something answers on port {peer.port} that is not a Potluck worker: {h_detail} ({h_code})",
            f"check the port: start the worker on a free one (`potluck worker -p {peer.port + 1}`)",
        )  # fmt: skip
    return Check("handshake", peer.address, FAIL, f"{h_detail} ({h_code})", "restart the worker")


def _secret_fail(peer: Peer, detail: str) -> Check:
    return Check(
        "secret", peer.address, FAIL, f"pool secret mismatch: {detail}",
        "set the same --secret / POTLUCK_SECRET on every machine (`potluck secret` makes one)",
    )  # fmt: skip


def threads_check(node: str, threads: int, physical: int, logical: int) -> Check:
    """Threads beyond the physical cores: hyper-threads share one core's vector units and its
    memory bandwidth, so decode gets slower, not faster."""
    detail = f"-t {threads} on {physical} physical / {logical} logical cores"
    if threads > physical:
        kind = (
            "the logical cores"
            if threads >= logical and logical > physical
            else "more than the physical cores"
        )
        return Check(
            "threads", node, WARN, f"{detail}: uses {kind}",
            f"use -t {physical} (the default): hyper-threads slow decode down",
        )  # fmt: skip
    if threads < physical:
        return Check("threads", node, OK, f"{detail} (leaves {physical - threads} cores free)")
    return Check("threads", node, OK, detail)


def link_check(node: str, link: LinkStats, wireless_iface: str | None) -> Check:
    detail = (
        f"RTT {link.median_ms:.2f} ms (jitter {link.jitter_ms:.2f} ms), "
        f"{fmt_rate(link.down_bytes_per_s)} down / {fmt_rate(link.up_bytes_per_s)} up"
    )
    why = []
    if wireless_iface:
        why.append(f"this machine reaches it over Wi-Fi ({wireless_iface})")
    if link.median_ms > LINK_RTT_WARN_MS:
        why.append(f"round trips over {LINK_RTT_WARN_MS:g} ms")
    if link.jitter_ms > LINK_JITTER_WARN_MS:
        why.append(f"jitter over {LINK_JITTER_WARN_MS:g} ms")
    slow = min(link.down_bytes_per_s, link.up_bytes_per_s)
    if slow < LINK_BANDWIDTH_WARN:
        why.append(f"under {fmt_rate(LINK_BANDWIDTH_WARN)}")
    if not why:
        return Check("link", node, OK, detail)
    return Check(
        "link", node, WARN, f"{detail}: looks like Wi-Fi or a congested network ({'; '.join(why)})",
        "use wired (gigabit) Ethernet for pool machines, or move closer to the access point; "
        "stop large downloads meanwhile",
    )  # fmt: skip


def load_check(node: str, samples: Sequence[tuple[float, float]], error: str = "") -> Check:
    """Speed under sustained load: the last fifth of the samples against the first."""
    if error:
        return Check("load", node, WARN, f"the load probe failed: {error}", "restart the worker")
    if len(samples) < 4:
        return Check(
            "load", node, SKIP, f"{len(samples)} samples are too few to tell",
            "run with --load-seconds 60 (one minute of load)",
        )  # fmt: skip
    speeds = [s for _, s in samples]
    k = max(1, len(speeds) // 5)
    first, last = statistics.median(speeds[:k]), statistics.median(speeds[-k:])
    drop = 1 - last / first
    span = samples[-1][0]
    detail = f"decode speed {first / 1e9:.2f} → {last / 1e9:.2f} GB/s over {span:.0f} s"
    if drop >= THROTTLE_WARN:
        return Check(
            "load", node, WARN, f"{detail}: fell {drop:.0%} under load (thermal throttling?)",
            "improve cooling, plug the laptop in and choose a performance power mode, close "
            "programs that compete for the CPU; the planner measures speed cold, so give this "
            "node a smaller share (--tensor-split)",
        )  # fmt: skip
    return Check("load", node, OK, f"{detail}: steady")


# -- the model -----------------------------------------------------------------------------------------
def model_checks(path: Path, ctx: int | None, nodes: Sequence[NodeInfo], links: Links) -> Check:
    """Does the model at this context fit the pool's free memory (KV cache counted)? When not,
    the longest context that would."""
    from potluck.engine.generate import DEFAULT_CTX
    from potluck.model.archs import hparams_from_metadata
    from potluck.modelfile.gguf_file import GGUFFile
    from potluck.planner import footprint_from_gguf, held_bytes, plan_pool

    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata, str(path))
    n_ctx = ctx or min(hp.n_ctx_train, DEFAULT_CTX)
    if n_ctx > hp.n_ctx_train:
        return Check(
            "model", "pool", FAIL,
            f"-c {n_ctx} is longer than {path.name} was trained for ({hp.n_ctx_train} tokens)",
            f"use -c {hp.n_ctx_train} or less",
        )  # fmt: skip

    def footprint(n: int) -> ModelFootprint:
        return footprint_from_gguf(f.tensors, hp, n, held=held_bytes)

    def fits(n: int) -> bool:
        try:
            plan_pool(footprint(n), nodes, links)
        except NotEnoughMemoryError:
            return False
        return True

    fp = footprint(n_ctx)
    weights = fp.embd_bytes + fp.weights(0, fp.n_layer) + fp.head_bytes
    kv = fp.kv(0, fp.n_layer)
    free = sum(n.memory_bytes + n.gpu_memory_bytes for n in nodes)
    detail = (
        f"{path.name} at -c {n_ctx} needs {fmt_bytes(fp.total_bytes)} on one machine (weights "
        f"{fmt_bytes(weights)} + KV cache {fmt_bytes(kv)} + buffers {fmt_bytes(fp.buffer_bytes)}); "
        f"{len(nodes)} nodes have {fmt_bytes(free)} free"
    )
    try:
        plan = plan_pool(fp, nodes, links)
    except NotEnoughMemoryError as exc:
        lo, hi = 0, n_ctx - 1  # the longest context that fits, by bisection (fits() is monotonic)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        advice = (
            f"use -c {lo} (the longest context that fits), or add a machine (`potluck worker`)"
            if lo
            else f"even one token of context does not fit: the weights alone need "
            f"{fmt_bytes(weights)}; add machines or pick a smaller quantization"
        )
        return Check("model", "pool", FAIL, f"does not fit: {detail}. {exc}", advice)
    return Check("model", "pool", OK, f"fits: {detail}. {plan.verdict}")


# -- the whole run -----------------------------------------------------------------------------------
@dataclass
class _Node:
    """A peer that answered Hello: what the later checks need."""

    peer: Peer
    reply: pb.HelloReply
    link: LinkStats | None


def run_doctor(
    peers: Sequence[Peer],
    cfg: DoctorConfig,
    dial: Dial,
    this_machine: Callable[[], NodeInfo],
    local_cores: tuple[int, int],
    local_load: Callable[[float, float], list[tuple[float, float]]],
    on_progress: Callable[[str], None] = lambda _: None,
    backends: tuple[str, str | None] = ("", None),
) -> list[Check]:
    """Every check, in order: per peer (reach, handshake/version, secret, threads, link), this
    machine's ggml (backends: its devices and CPU features) and threads, the model (with -m),
    then the load probes (all nodes at once)."""
    checks: list[Check] = []
    alive: list[_Node] = []
    for peer in peers:
        on_progress(f"checking {peer.address}")
        reach = _reach_check(peer, cfg.connect_timeout_s)
        checks.append(reach)
        if reach.status != OK:
            continue
        client = dial(peer.address)
        try:
            h = hello(client, cfg.call_timeout_s)
            if h.reply is None:
                checks.append(_handshake_checks(peer, h.code, h.detail, cfg.call_timeout_s))
                continue
            r = h.reply
            if r.potluck_version != __version__:
                checks.append(Check(
                    "version", peer.address, WARN,
                    f"potluck {r.potluck_version} there, {__version__} here (same protocol {PROTOCOL_VERSION})",
                    "install the same Potluck version on every machine",
                ))  # fmt: skip
            else:
                checks.append(
                    Check(
                        "version",
                        peer.address,
                        OK,
                        f"potluck {__version__}, protocol {PROTOCOL_VERSION}",
                    )
                )
            if r.data_port:
                checks.append(_data_port_check(peer, r.data_port, cfg.connect_timeout_s))
            checks.extend(_session_checks(peer, client, cfg, alive, r))
        finally:
            client.close()
    phys, logical = local_cores
    if backends[0]:
        found, advice = backends
        checks.append(Check("backend", THIS_MACHINE, WARN if advice else OK, found, advice or ""))
    checks.append(threads_check(THIS_MACHINE, cfg.threads or phys, phys, logical))
    if cfg.model is not None:
        on_progress(f"sizing {cfg.model.name}")
        nodes = [this_machine()] + [
            NodeInfo(
                n.peer.address,
                "cpu",
                sum(d.memory_bytes for d in n.reply.devices),
                max(1, n.reply.physical_cores),
                n.reply.decode_bytes_per_s or 1.0,
            )  # fmt: skip
            for n in alive
        ]
        links = {
            (THIS_MACHINE, n.peer.address): Link(n.link.median_ms / 2e3, n.link.down_bytes_per_s)
            for n in alive
            if n.link is not None
        }
        try:
            checks.append(model_checks(cfg.model, cfg.ctx, nodes, links))
        except PotluckError as exc:
            checks.append(Check("model", "pool", FAIL, str(exc), "check the model file"))
    else:
        checks.append(Check("model", "pool", SKIP, "no model given", "pass -m MODEL [-c CTX]"))
    checks.extend(_load_checks(alive, cfg, dial, local_load, on_progress))
    return checks


def _session_checks(
    peer: Peer, client: NodeClient, cfg: DoctorConfig, alive: list[_Node], r: pb.HelloReply
) -> list[Check]:
    """The checks that need a call beyond Hello, so the pool secret (every call but Hello needs a
    session once the node has one): secret, threads, link."""
    import grpc

    out = []
    why, mismatch = session_error(client)  # the pool secret's handshake (transport/auth.py)
    if mismatch:
        return [_secret_fail(peer, why)]
    if why:  # e.g. TLS on one side only, or a worker too old for the handshake
        return [Check("handshake", peer.address, FAIL, why, "do what the message says")]
    try:
        d = describe(client, cfg.call_timeout_s)
    except grpc.RpcError as exc:
        code, detail = rpc_code(exc)
        if code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
            return [_secret_fail(peer, detail)]
        return [Check("handshake", peer.address, FAIL, f"{detail} ({code})", "restart the worker")]
    out.append(
        Check("secret", peer.address, OK, "the pool secret matches (or neither side has one)")
    )
    if d is not None:
        out.append(threads_check(peer.address, d.threads, d.physical_cores, d.logical_cores))
    else:
        out.append(Check("threads", peer.address, SKIP, "the worker does not say (older version)"))
    try:
        measured = measure_link(client, pings=20, timeout=cfg.call_timeout_s * 4)
    except grpc.RpcError as exc:
        code, detail = rpc_code(exc)
        out.append(Check("link", peer.address, SKIP, f"cannot measure: {detail} ({code})"))
        alive.append(_Node(peer, r, None))
        return out
    iface = local_interface(peer.host, peer.port)
    out.append(link_check(peer.address, measured, iface if iface and is_wireless(iface) else None))
    alive.append(_Node(peer, r, measured))
    return out


def _load_checks(
    alive: Sequence[_Node],
    cfg: DoctorConfig,
    dial: Dial,
    local_load: Callable[[float, float], list[tuple[float, float]]],
    on_progress: Callable[[str], None],
) -> list[Check]:
    if cfg.load_seconds <= 0:
        return [Check("load", "all", SKIP, "--load-seconds 0", "run with --load-seconds 60")]
    on_progress(
        f"loading every node for {cfg.load_seconds:g} s (thermal throttling shows as a drop)"
    )
    # at least 20 samples: a short probe (tests, a quick look) still has a first and a last fifth
    interval = min(cfg.load_interval_s, max(0.1, cfg.load_seconds / 20))

    def remote(n: _Node) -> Check:
        client = dial(n.peer.address)
        try:
            samples, error = stress(client, cfg.load_seconds, interval)
        finally:
            client.close()
        return load_check(n.peer.address, samples, error)

    with ThreadPoolExecutor(max_workers=len(alive) + 1) as ex:
        futures = [ex.submit(remote, n) for n in alive]
        local = load_check(THIS_MACHINE, local_load(cfg.load_seconds, interval))
        return [local] + [f.result() for f in futures]
