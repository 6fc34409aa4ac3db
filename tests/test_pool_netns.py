"""The pool across separate network stacks: head and workers in their own network namespaces,
joined by veth links capped with tc tbf (1 Gbit/s, 100 Mbit/s) or delayed by a TCP proxy.

What this fakes: separate machines (namespaces share this machine's CPUs, memory and disk — the
bare worker gets an empty model cache so that its layers really cross the capped link).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from netns import netns_lan

pytestmark = pytest.mark.netns

SECRET = "pltest-" + "x" * 40
PROMPT = "Name a colour."
PROXY = Path(__file__).with_name("delay_proxy.py")


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "potluck.cli", *args]


# The workers here start through Host.popen, not tests/workers.py: the namespace host runs them in
# a process group of their own and ends them before its namespace goes.
def _wait_line(proc: subprocess.Popen, needle: str, what: str, stream: str = "stderr") -> None:
    f = getattr(proc, stream)
    lines = []
    while True:
        line = f.readline()
        if not line:
            raise AssertionError(f"{what} ended before saying {needle!r}: {''.join(lines)[-2000:]}")
        lines.append(line)
        if needle in line:
            return


def _run_args(model: Path) -> list[str]:
    return ["run", "-m", str(model), "--temp", "0", "-n", "12", "-c", "256", PROMPT]


def _no_mdns() -> list[str]:
    done = subprocess.run(_cmd("run", "--help"), capture_output=True, text=True, timeout=60)
    return ["--no-mdns"] if "--no-mdns" in done.stdout else []


def _worker_behind_proxy(host, env: dict[str, str], delay_ms: float) -> str:
    """A worker on the host's own loopback, reached through a TCP proxy on the host's address that
    delays every byte by delay_ms each way (0: plain forwarding); returns the proxy's address."""
    p = host.popen(
        _cmd("worker", "-H", "127.0.0.1", "-p", "50052", "-t", "1", "--no-mdns"),
        env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    _wait_line(p, "listening on", f"worker in {host.ip}")
    proxy = host.popen(
        [sys.executable, str(PROXY), f"{host.ip}:6000", "127.0.0.1:50052", str(delay_ms)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    _wait_line(proxy, "ready", "proxy", "stdout")
    return f"{host.ip}:6000"


@pytest.fixture(scope="module")
def alone(smollm2_path: Path) -> str:
    done = subprocess.run(
        _cmd(*_run_args(smollm2_path)), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("rates", [("1gbit", "1gbit", "1gbit"), ("100mbit", "100mbit", "100mbit")])
def test_pool_over_capped_links(
    smollm2_path: Path, alone: str, tmp_path: Path, rates: tuple[str, str, str]
) -> None:
    env = {**os.environ, "POTLUCK_SECRET": SECRET, "POTLUCK_MDNS": "0"}
    bare = {**env, "POTLUCK_CACHE": str(tmp_path / "cache"), "HOME": str(tmp_path)}
    with netns_lan(3, rates=list(rates)) as (head, w1, w2):
        workers = []
        for host, wenv in ((w1, env), (w2, bare)):
            p = host.popen(
                _cmd("worker", "-H", host.ip, "-p", "50052", "-t", "1", "--no-mdns"),
                env=wenv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
            )  # fmt: skip
            _wait_line(p, "listening on", f"worker on {host.ip}")
            workers.append(f"{host.ip}:50052")
        done = head.run(
            _cmd(*_run_args(smollm2_path), "--peer", workers[0], "--peer", workers[1],
                 "--tensor-split", "1,1,1", *_no_mdns()),
            env=env, timeout=300, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout == alone
        assert f"layers 20–29 → {workers[1]}" in done.stderr
    assert any((tmp_path / "cache" / "blobs").iterdir()), "the bare worker got no tensors"


def test_pool_through_delayed_links(smollm2_path: Path, alone: str) -> None:
    """Each worker listens on its own loopback; a proxy on its address adds 15 ms each way.
    The head measures the latency (survey) and the output still equals one process."""
    env = {**os.environ, "POTLUCK_MDNS": "0"}
    with netns_lan(3) as (head, w1, w2):
        workers = [_worker_behind_proxy(h, env, delay_ms=15) for h in (w1, w2)]
        probe = head.run(
            [sys.executable, "-c",
             "import sys; from potluck.pool.survey import survey; "
             "_, links = survey(sys.argv[1:]); "
             "print(' '.join(f'{l.latency_s * 1e3:.1f}' for l in links.values()))", *workers],
            env=env, timeout=120, check=False,
        )  # fmt: skip
        assert probe.returncode == 0, probe.stderr
        one_way_ms = [float(x) for x in probe.stdout.split()]
        # head→each worker and worker↔worker (both directions): each path crosses one proxy
        assert len(one_way_ms) == 4 and all(14 <= ms < 200 for ms in one_way_ms), one_way_ms
        done = head.run(
            _cmd(*_run_args(smollm2_path), "--peer", workers[0], "--peer", workers[1],
                 "--tensor-split", "1,1,1", *_no_mdns()),
            env=env, timeout=300, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout == alone


def test_link_cut_mid_generation(smollm2_path: Path, alone: str) -> None:
    """Pull a worker's cable while text is flowing: the head stops hearing from it, declares it
    gone after the failover timeout, re-plans on the rest, and the text is the same."""
    env = {**os.environ, "POTLUCK_MDNS": "0"}
    with netns_lan(3) as (head, w1, w2):
        workers = [_worker_behind_proxy(h, env, delay_ms=0) for h in (w1, w2)]
        run = head.popen(
            _cmd(*_run_args(smollm2_path), "--peer", workers[0], "--peer", workers[1],
                 "--tensor-split", "1,1,1", "--failover-timeout", "2", *_no_mdns()),
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        assert run.stdout is not None
        first = os.read(run.stdout.fileno(), 1)
        w2.cut()
        rest, err = run.communicate(timeout=120)
        log = err.decode()
        assert run.returncode == 0, log
        assert (first + rest).decode() == alone
        assert f"{workers[1]} went away" in log


def test_survey_measures_every_link(tmp_path: Path) -> None:
    """The planner's inputs are measured: head→worker and worker↔worker latency and bandwidth,
    here through 100 Mbit/s caps (the one worker-to-worker path crosses two capped links)."""
    env = {**os.environ, "POTLUCK_SECRET": SECRET, "POTLUCK_MDNS": "0"}
    with netns_lan(3, rates=[None, "100mbit", "100mbit"]) as (head, w1, w2):
        workers = []
        for host in (w1, w2):
            p = host.popen(
                _cmd("worker", "-H", host.ip, "-p", "50052", "-t", "1", "--no-mdns"),
                env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
            )  # fmt: skip
            _wait_line(p, "listening on", f"worker on {host.ip}")
            workers.append(f"{host.ip}:50052")
        code = (
            "import json, os, sys; from potluck.pool.survey import survey; "
            "from potluck.transport.auth import PoolAuth; "
            "_, links = survey(sys.argv[1:], auth=PoolAuth.from_secret(os.environ['POTLUCK_SECRET'])); "
            "print(json.dumps([[a, b, l.latency_s, l.bytes_per_s] for (a, b), l in links.items()]))"
        )
        done = head.run([sys.executable, "-c", code, *workers], env=env, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
    import json

    links = {(a, b): (lat, bw) for a, b, lat, bw in json.loads(done.stdout)}
    assert set(links) == {
        ("this machine", workers[0]), ("this machine", workers[1]),
        (workers[0], workers[1]), (workers[1], workers[0]),
    }  # fmt: skip
    cap = 100e6 / 8
    for (a, b), (lat, bw) in links.items():
        assert 0 < lat < 0.05, (a, b, lat)
        assert 0.3 * cap < bw < 2.0 * cap, (a, b, bw / cap)
