"""Discovery, `potluck nodes` and `potluck doctor` with real worker processes in network
namespaces (tests/netns.py): each namespace is a host with its own network stack on one virtual
LAN segment, so mDNS multicast, TCP and the bandwidth caps behave as between machines.

What is faked, and why:
- separate machines: namespaces share this machine's CPUs, memory and disk.
- a worker of another Potluck version: a real `potluck worker` process whose PROTOCOL_VERSION is
  set to 99 before it starts (no other Potluck release can be installed here).
- a firewall that drops packets: a blackhole route on the target host (neither iptables nor tc
  actions exist on this machine), which makes it drop its replies exactly like such a firewall.
- multicast that does not cross the network: two subnets joined by a router namespace (link-local
  multicast is never routed, as between VLANs).
- thermal throttling: competing processes pinned to the worker's CPU slow it down mid-probe; the
  check sees the same drop in throughput that heat would cause.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from netns import Host, netns_lan, netns_routed, rate_bits_per_s
from potluck.discovery.doctor import OK, WARN, load_check
from potluck.discovery.mdns import DiscoveryError, announce_scope, check_pool_name
from potluck.planner.errors import fmt_bytes
from potluck.transport.codec import PROTOCOL_VERSION
from workers import Spawn
from workers import spawn_worker as spawn_worker

from ggufgen import write_tiny_model

pytestmark = pytest.mark.netns

SECRET = "pltest-discovery-" + "s" * 32
PORT = 50052
CAP = "200mbit"  # the first worker's link, so that `nodes` has a known bandwidth to measure


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "potluck.cli", *args]


def _env(config: Path, **extra: str) -> dict[str, str]:
    """Every process: mDNS on (whatever the suite sets), its own config folder (no peers or secret
    file of this machine's user leaks in), wide output so that rich tables do not wrap."""
    return {
        **os.environ,
        "POTLUCK_MDNS": "1",
        "POTLUCK_CONFIG": str(config),
        "POTLUCK_SECRET": SECRET,
        "COLUMNS": "400",
        **extra,
    }


@dataclass
class Worker:
    host: Host
    proc: subprocess.Popen
    address: str
    log: list[str] = field(default_factory=list)


def start_worker(host: Host, env: dict[str, str], *args: str, python: list[str] | None = None,
                 listen: str = "0.0.0.0", port: int = PORT) -> Worker:  # fmt: skip
    """A real `potluck worker` in `host`; returns once it listens (and has announced itself).
    (Not tests/workers.py's launcher: the namespace host runs it in a process group of its own
    and ends it before its namespace goes; mDNS is on.)"""
    argv = python or _cmd()
    proc = host.popen(
        [*argv, "worker", "-H", listen, "-p", str(port), "-t", "1", *args],
        env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    w = Worker(host, proc, f"{host.ip if listen == '0.0.0.0' else listen}:{port}")
    assert proc.stderr is not None
    deadline = time.monotonic() + 120
    for line in proc.stderr:
        w.log.append(line)
        if "listening on" in line:
            break
        if time.monotonic() > deadline:
            break
    else:
        raise AssertionError(f"worker in {host.ns} ended: {''.join(w.log)[-2000:]}")
    assert "listening on" in w.log[-1], "".join(w.log)
    # keep reading its stderr so that it never blocks on a full pipe
    threading.Thread(target=lambda: w.log.extend(proc.stderr), daemon=True).start()
    return w


def rows(table: str) -> list[list[str]]:
    """The body rows of a rich table printed at a width where nothing wraps."""
    return [
        [c.strip() for c in line.split("│")[1:-1]]
        for line in table.splitlines()
        if line.startswith("│")
    ]


def browse_in(host: Host, env: dict[str, str], pool: str | None, window: float = 1.5) -> list:
    code = (
        "import json, sys, dataclasses; from potluck.discovery.mdns import browse; "
        "print(json.dumps([dataclasses.asdict(a) for a in browse(json.loads(sys.argv[1]), "
        "float(sys.argv[2]))]))"
    )
    r = host.run([sys.executable, "-c", code, json.dumps(pool), str(window)], env=env, timeout=60)
    return json.loads(r.stdout)


PATCHED_WORKER = [  # a real worker that speaks protocol 99 (see the module docstring)
    sys.executable,
    "-c",
    "import sys; import potluck.transport.codec as c; c.PROTOCOL_VERSION = 99; "
    "from potluck.cli import main; sys.argv = ['potluck', *sys.argv[1:]]; main()",
]


@dataclass
class Lan:
    head: Host
    home: Worker  # pool "home", link capped at CAP
    other: Worker  # pool "other"
    future: Worker  # pool "home", protocol 99
    local: Worker  # pool "home", on the head's own loopback
    bystander: Host  # runs the "other" worker; browses like any machine on the LAN
    env: dict[str, str]


@pytest.fixture(scope="module")
def lan(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lan]:
    """Four hosts on one switch: three announce workers, the fourth is the head and also runs a
    worker on its own loopback."""
    env = _env(tmp_path_factory.mktemp("config"))
    with netns_lan(4, rates=[CAP, None, None, None]) as (h0, h1, h2, head):
        started: dict[str, Worker] = {}
        jobs = {
            "home": lambda: start_worker(h0, env),
            "other": lambda: start_worker(h1, env, "--pool", "other"),
            "future": lambda: start_worker(h2, env, python=PATCHED_WORKER),
            "local": lambda: start_worker(head, env, listen="127.0.0.1", port=50053),
        }
        errors: list[BaseException] = []

        def run(name: str) -> None:
            try:
                started[name] = jobs[name]()
            except BaseException as exc:  # reported below, in the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(n,)) for n in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        if errors:
            raise errors[0]
        yield Lan(head, started["home"], started["other"], started["future"], started["local"],
                  h1, env)  # fmt: skip


def test_workers_announce_themselves(lan: Lan) -> None:
    for w in (lan.home, lan.other, lan.future):
        assert any("announced on mDNS" in line and w.host.ip in line for line in w.log), w.log
    assert any("this machine only" in line for line in lan.local.log), lan.local.log


def test_browse_across_namespaces_keeps_pools_apart(lan: Lan) -> None:
    home = {a["addresses"][0] + f":{a['port']}": a for a in browse_in(lan.head, lan.env, "home")}
    # the head sees its pool's workers on the LAN and the one on its own loopback ...
    assert set(home) == {lan.home.address, lan.future.address, lan.local.address}
    a = home[lan.home.address]
    assert a["pool"] == "home" and a["protocol_version"] == PROTOCOL_VERSION
    assert a["cores"] >= 1 and a["memory_bytes"] > 0 and a["os"] == "Linux"
    assert home[lan.future.address]["protocol_version"] == 99
    # ... the other pool's worker only when it browses for that pool
    other = browse_in(lan.head, lan.env, "other")
    assert [f"{a['addresses'][0]}:{a['port']}" for a in other] == [lan.other.address]
    # another machine on the LAN never sees the head's loopback-only worker
    seen = {f"{a['addresses'][0]}:{a['port']}" for a in browse_in(lan.bystander, lan.env, None)}
    assert lan.home.address in seen and lan.other.address in seen
    assert not any(s.startswith("127.") for s in seen), seen


def test_nodes_lists_every_node_with_rtt_and_bandwidth(lan: Lan) -> None:
    r = lan.head.run(_cmd("nodes", "--timeout", "5"), env=lan.env, timeout=180, check=False)
    assert r.returncode == 0, r.stderr
    table = {row[0]: row for row in rows(r.stdout)}
    assert set(table) == {
        "this machine", lan.home.address, lan.other.address, lan.future.address,
        lan.local.address,
    }, r.stdout  # fmt: skip
    node, found, pool, version, devices, memory, cores, rtt, bandwidth, usable = table[
        lan.home.address
    ]
    assert (found, pool, usable) == ("mDNS", "home", "yes")
    assert devices.startswith("cpu ") and memory.endswith("iB")
    assert re.fullmatch(r"\d+\.\d\d ms ± \d+\.\d\d", rtt), rtt
    # the link is capped at 200 Mbit/s both ways: the measured bandwidth must say about that
    down, up = (re.fullmatch(r"([\d.]+) Mbit/s", s.strip()) for s in bandwidth.split(" / "))
    assert down and up, bandwidth
    cap = rate_bits_per_s(CAP) / 1e6
    for m in (down, up):
        assert 0.5 * cap < float(m.group(1)) < 1.1 * cap, bandwidth
    assert table[lan.local.address][1] == "mDNS" and table[lan.local.address][-1] == "yes"
    assert table[lan.other.address][-1] == (
        "no: it is in pool 'other', this head in 'home' (--pool other to use it)"
    )
    assert "no: " in table[lan.future.address][-1]
    assert "protocol version" in table[lan.future.address][-1]


def test_head_plans_with_discovered_workers(lan: Lan, smollm2_path: Path) -> None:
    """`potluck plan` without --peer: the pool's workers come from mDNS, said in the log; the one
    of another protocol is left out with the reason."""
    r = lan.head.run(
        _cmd("plan", "-m", str(smollm2_path), "-c", "256"), env=lan.env, timeout=180, check=False
    )
    assert r.returncode == 0, r.stderr
    log = " ".join(r.stderr.split())
    assert "pool 'home' (mDNS 1 s):" in log
    assert f"pool 'home' (mDNS 1 s): {lan.home.address} (mDNS:" in log
    assert f"left out {lan.future.address} (mDNS:" in log and "it speaks protocol 99" in log
    # a worker on the head's loopback cannot be reached by the LAN's workers: not in the chain
    assert f"left out {lan.local.address} (mDNS:" in log
    assert "listens on this machine's loopback only" in log
    assert lan.other.address not in log
    nodes = {row[0] for row in rows(r.stdout)}
    assert nodes <= {"this machine", lan.home.address}, r.stdout

    r = lan.head.run(
        _cmd("plan", "-m", str(smollm2_path), "-c", "256", "--pool", "other"),
        env=lan.env, timeout=180, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    log = " ".join(r.stderr.split())
    assert f"pool 'other' (mDNS 1 s): {lan.other.address} (mDNS:" in log
    assert lan.home.address not in log


def test_run_over_discovered_worker(lan: Lan, smollm2_path: Path) -> None:
    """A real generation over the workers mDNS found, with --no-mdns as the control."""
    args = ["run", "-m", str(smollm2_path), "-c", "256", "--temp", "0", "-n", "8", "Hi"]
    pooled = lan.head.run(
        _cmd(*args, "--tensor-split", "1,1"), env=lan.env, timeout=300, check=False
    )
    assert pooled.returncode == 0, pooled.stderr
    assert f"layers 15–29 → {lan.home.address} (cpu)" in pooled.stderr, pooled.stderr
    alone = lan.head.run(_cmd(*args, "--no-mdns"), env=lan.env, timeout=300, check=False)
    assert alone.returncode == 0, alone.stderr
    assert "mDNS" not in alone.stderr and "→" not in alone.stderr
    assert pooled.stdout == alone.stdout  # the pipeline invariant, across namespaces


def _doctor(host: Host, env: dict[str, str], *args: str) -> tuple[int, list[list[str]], str]:
    """Exit code, the checks as rows [check, node, status, detail, advice], all output."""
    r = host.run(_cmd("doctor", "--json", *args), env=env, timeout=300, check=False)
    try:
        checks = json.loads(r.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"doctor printed no JSON: {r.stdout}{r.stderr}") from None
    table = [[c["check"], c["node"], c["status"], c["detail"], c["advice"]] for c in checks]
    return r.returncode, table, r.stdout + r.stderr


def test_doctor_checks_a_healthy_and_an_odd_pool(lan: Lan, smollm2_path: Path) -> None:
    code, table, out = _doctor(
        lan.head, lan.env, "-m", str(smollm2_path), "-c", "2048", "--load-seconds", "2",
        "-t", str(psutil.cpu_count(logical=True) + 1),
    )  # fmt: skip
    assert code == 1, out  # the protocol-99 worker fails its check
    by = {(c[0], c[1]): c for c in table}
    home = lan.home.address
    for check in ("reach", "version", "data port", "secret"):
        assert by[(check, home)][2] == OK, by[(check, home)]
    # the capped link (200 Mbit/s) is slower than a wired gigabit LAN
    assert by[("link", home)][2] == WARN and "under 320 Mbit/s" in by[("link", home)][3]
    assert by[("version", lan.future.address)][2] == "fail"
    assert "version mismatch" in by[("version", lan.future.address)][3]
    assert "protocol 99" in by[("version", lan.future.address)][3]
    assert "install the same Potluck version" in by[("version", lan.future.address)][4]
    # -t above the logical core count on this machine
    t = by[("threads", "this machine")]
    assert t[2] == WARN and "use -t" in t[4], t
    assert by[("threads", home)][2] == OK  # the worker runs with -t 1
    model = by[("model", "pool")]
    assert model[2] == OK and "KV cache" in model[3] and "-c 2048" in model[3], model
    for node in ("this machine", home):
        load = by[("load", node)]
        assert load[2] in (OK, WARN) and "GB/s" in load[3], load
    assert lan.other.address not in out  # another pool's worker is none of this doctor's business


def test_doctor_pool_secret_mismatch(lan: Lan) -> None:
    env = {**lan.env, "POTLUCK_SECRET": "not-the-pools-secret-" + "z" * 24}
    code, table, out = _doctor(
        lan.head, env, "--no-mdns", "--peer", lan.home.address, "--load-seconds", "0"
    )
    assert code == 1, out
    by = {(c[0], c[1]): c for c in table}
    secret = by[("secret", lan.home.address)]
    assert secret[2] == "fail" and "pool secret mismatch" in secret[3], secret
    assert "same --secret" in secret[4]
    assert by[("reach", lan.home.address)][2] == OK  # the port is fine, the secret is not


def test_neighbours_worker_with_another_secret_is_left_out(lan: Lan, smollm2_path: Path) -> None:
    """Same pool name (the default), another secret: a neighbour's worker. The head leaves it out
    and says why, instead of failing the run."""
    env = {**lan.env, "POTLUCK_SECRET": "the-neighbours-secret-" + "n" * 24}
    r = lan.head.run(
        _cmd("plan", "-m", str(smollm2_path), "-c", "256"), env=env, timeout=180, check=False
    )
    assert r.returncode == 0, r.stderr
    log = " ".join(r.stderr.split())
    assert f"left out {lan.home.address} (mDNS:" in log
    assert "pool secret mismatch" in log
    assert "no workers found" in log or f"(mDNS 1 s): {lan.home.address}" not in log
    r = lan.head.run(_cmd("nodes", "--json"), env=env, timeout=180, check=False)
    assert r.returncode == 0, r.stderr
    home = next(n for n in json.loads(r.stdout) if n["name"] == lan.home.address)
    assert not home["usable"] and "pool secret mismatch" in home["why"], home


def test_doctor_tls_on_one_side_only(tmp_path: Path) -> None:
    """A worker with --tls: a doctor without --tls is told to pass it; with it, all is well."""
    env = _env(tmp_path)
    with netns_lan(2) as (w_host, head):
        w = start_worker(w_host, env, "--tls", "--no-mdns")
        args = ["--no-mdns", "--peer", w.address, "--load-seconds", "0"]
        code, table, out = _doctor(head, env, *args)
        assert code == 1, out
        shake = next(c for c in table if c[1] == w.address and c[2] == "fail")
        assert "speaks TLS" in shake[3] and "--tls" in shake[4], shake
        code, table, out = _doctor(head, env, *args, "--tls")
        assert code == 0, out
        by = {(c[0], c[1]): c for c in table}
        assert by[("secret", w.address)][2] == OK and by[("link", w.address)][2] in (OK, WARN)


def _claim_context(path: Path, n_ctx: int) -> None:
    """Rewrite the model's context_length (a GGUF uint32 key) in place."""
    data = bytearray(path.read_bytes())
    key = b"llama.context_length"
    i = data.index(key) + len(key)
    assert int.from_bytes(data[i : i + 4], "little") == 4  # GGUF value type UINT32
    data[i + 4 : i + 8] = n_ctx.to_bytes(4, "little")
    path.write_bytes(bytes(data))


def test_doctor_model_that_does_not_fit(lan: Lan, tmp_path: Path) -> None:
    """A tiny model that claims a context of 2^30 tokens: its KV cache alone is 256 GiB (f16)."""
    path = write_tiny_model(tmp_path / "huge-ctx.gguf", "llama")
    n_ctx = 1 << 30
    _claim_context(path, n_ctx)
    code, table, out = _doctor(
        lan.head, lan.env, "--no-mdns", "--peer", lan.home.address, "-m", str(path),
        "-c", str(n_ctx), "--load-seconds", "0",
    )  # fmt: skip
    assert code == 1, out
    model = next(c for c in table if c[0] == "model")
    assert model[2] == "fail", model
    kv = 2 * 2 * (16 + 16) * 2 * n_ctx  # layers x kv heads x (k + v dims) x f16 x positions
    assert f"KV cache {fmt_bytes(kv)}" in model[3], model
    m = re.search(r"use -c (\d+) \(the longest context that fits\)", model[4])
    assert m and 0 < int(m.group(1)) < n_ctx, model
    fits = int(m.group(1)) // 2
    code, table, out = _doctor(
        lan.head, lan.env, "--no-mdns", "--peer", lan.home.address, "-m", str(path),
        "-c", str(fits), "--load-seconds", "0",
    )  # fmt: skip
    model = next(c for c in table if c[0] == "model")
    # the advice holds (with a margin: the free memory moves while other programs run)
    assert model[2] == OK, model


def test_doctor_tells_closed_port_unreachable_host_and_timeout(tmp_path: Path) -> None:
    """No worker needed: a closed port on a live host, an address with no route, and a host
    whose replies are dropped (a blackhole route: what a dropping firewall does)."""
    env = _env(tmp_path)
    with netns_lan(3) as (head, live, dropping):
        dropping.run(["ip", "route", "add", "blackhole", f"{head.ip}/32"], timeout=10)
        t0 = time.monotonic()
        code, table, out = _doctor(
            head, env, "--no-mdns", "--timeout", "2", "--load-seconds", "0",
            "--peer", f"{live.ip}:50999", "--peer", "10.77.99.9:50052",
            "--peer", f"{dropping.ip}:50052",
        )  # fmt: skip
        assert time.monotonic() - t0 < 60
    assert code == 1, out
    reach = {c[1]: c for c in table if c[0] == "reach"}
    closed, unreachable, timeout = (
        reach[f"{live.ip}:50999"], reach["10.77.99.9:50052"], reach[f"{dropping.ip}:50052"]
    )  # fmt: skip
    assert closed[2] == "fail" and closed[3].startswith("port closed"), closed
    assert "potluck worker -H 0.0.0.0 -p 50999" in closed[4]
    assert unreachable[2] == "fail" and unreachable[3].startswith("host unreachable"), unreachable
    assert timeout[2] == "fail" and timeout[3].startswith("timeout: no answer"), timeout
    for c in (closed, timeout):  # OS unknown (no mDNS): the hint names every firewall
        assert "ufw allow" in c[4] and "firewall-cmd" in c[4]
        assert "Windows Defender Firewall" in c[4] and "macOS" in c[4]


def test_static_peers_when_multicast_does_not_cross(tmp_path: Path, smollm2_path: Path) -> None:
    """Head and worker on two subnets joined by a router: unicast passes, mDNS does not. The
    worker still announces, the head finds nothing on mDNS, and the peers file works."""
    config = tmp_path / "config"
    config.mkdir()
    env = _env(config)
    with netns_routed() as (head, far):
        w = start_worker(far, env)
        assert any("announced on mDNS" in line for line in w.log)
        assert browse_in(head, env, None) == []
        # on its own segment the announcement is there (multicast works, it just is not routed)
        assert [a["addresses"][0] for a in browse_in(far, env, "home")] == [far.ip]
        (config / "peers").write_text(f"# across the router\n{far.ip}   # default port\n")
        r = head.run(
            _cmd("plan", "-m", str(smollm2_path), "-c", "256"), env=env, timeout=180, check=False
        )
        assert r.returncode == 0, r.stderr
        log = " ".join(r.stderr.split())
        assert f"pool 'home' (mDNS 1 s): {far.ip}:{PORT} (peers file)" in log
        assert any(row[0] == f"{far.ip}:{PORT}" for row in rows(r.stdout)) or "alone" in r.stdout
        r = head.run(_cmd("nodes"), env=env, timeout=120, check=False)
        assert r.returncode == 0, r.stderr
        row = next(row for row in rows(r.stdout) if row[0] == f"{far.ip}:{PORT}")
        assert row[1] == "peers file" and row[-1] == "yes", row
        # a worker stopped with SIGTERM says goodbye: a browser that saw it drops it at once
        # (without the goodbye it would stay in every cache for the record's TTL, minutes)
        watcher = far.popen(
            [sys.executable, "-c", WATCH], env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert watcher.stdout is not None and watcher.stdin is not None
        assert watcher.stdout.readline().strip() == "seen"
        t0 = time.monotonic()
        far.stop(w.proc)
        watcher.stdin.write("stopped\n")
        watcher.stdin.flush()
        assert watcher.stdout.readline().strip() == "gone"
        assert time.monotonic() - t0 < 10


WATCH = """
import sys, time
from potluck.discovery.mdns import Browser
b = Browser(None)
while not b.seen():
    time.sleep(0.05)
print("seen", flush=True)
sys.stdin.readline()
end = time.monotonic() + 5
while b.seen() and time.monotonic() < end:
    time.sleep(0.05)
print("gone" if not b.seen() else f"still there: {b.seen()}", flush=True)
b.close()
"""


def test_empty_network_browse_is_short(tmp_path: Path) -> None:
    """With no worker anywhere, browsing costs its window and no more."""
    env = _env(tmp_path)
    code = (
        "import time; from potluck.discovery.mdns import browse; t = time.perf_counter(); "
        "found = browse('home', 1.0); print(len(found), time.perf_counter() - t)"
    )
    with netns_lan(1) as (alone,):
        r = alone.run([sys.executable, "-c", code], env=env, timeout=60)
    n, seconds = r.stdout.split()
    # at least its window; the bound above is loose (a shared machine's load), but a browse that
    # waited for a timeout of its own (zeroconf's are 3 s and more) would still fail it
    assert n == "0" and 0.9 <= float(seconds) < 1.0 + 2.5, r.stdout


def test_announce_scope() -> None:
    assert announce_scope("127.0.0.1") == (["127.0.0.1"], ["127.0.0.1"])
    with pytest.raises(DiscoveryError, match="IPv4"):
        announce_scope("::1")
    assert check_pool_name("home-2.lan_x") == "home-2.lan_x"
    for bad in ("", "-x", "a b", "x" * 64, "caf\u00e9"):
        with pytest.raises(DiscoveryError, match="pool name"):
            check_pool_name(bad)


def test_load_check_verdicts() -> None:
    steady = [(t + 1.0, 8e9 * (1 - 0.01 * (t % 2))) for t in range(20)]
    assert load_check("n", steady).status == OK
    falling = [(t + 1.0, 8e9 if t < 10 else 5e9) for t in range(20)]
    c = load_check("n", falling)
    assert c.status == WARN and "fell 38%" in c.detail and "--tensor-split" in c.advice
    assert load_check("n", falling[:3]).status == "skip"


def test_load_probe_sees_a_slowdown(spawn_worker: Spawn, tmp_path: Path) -> None:
    """A real worker (loopback, this namespace, mDNS off) pinned to one CPU runs the load probe;
    halfway through, two busy processes pinned to the same CPU take two thirds of it. The probe's
    throughput drops and the check warns, as it would for a CPU that throttles."""
    from potluck.discovery.measure import stress
    from potluck.transport.client import NodeClient

    cpu = min(os.sched_getaffinity(0))
    # loopback, mDNS off, no secret (none needed), its own config folder
    env = {"POTLUCK_CONFIG": str(tmp_path), "COLUMNS": "400"}
    worker = spawn_worker(env=env, prefix=("taskset", "-c", str(cpu)))
    burners: list[subprocess.Popen] = []
    try:
        client = NodeClient(worker.address)
        seconds, result = 6.0, {}
        probe = threading.Thread(
            target=lambda: result.update(out=stress(client, seconds, 0.5)), daemon=True
        )
        probe.start()
        time.sleep(seconds * 0.4)
        for _ in range(2):
            burners.append(
                subprocess.Popen(["taskset", "-c", str(cpu), sys.executable, "-c", "while 1: pass"])
            )
        probe.join(timeout=seconds + 30)
        samples, error = result["out"]
        client.close()
        assert not error and len(samples) >= 8, (error, samples)
        check = load_check("worker", samples)
        assert check.status == WARN, (check, samples)
    finally:
        worker.kill()
        for p in burners:
            p.kill()
            p.wait(timeout=10)
