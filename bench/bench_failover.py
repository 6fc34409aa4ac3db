"""What a machine going away costs: detection time, recovery time and tokens/s before and after,
for each fault (SIGKILL, SIGSTOP, and a cut network link between namespaces when root).

    python bench/bench_failover.py [--model smollm2] [--tokens 96] [--at 24] [--timeout 5]
        [--no-netns] [--quick] [--out bench/out/failover.json]

A head (this machine's first third of the layers) and two workers on loopback (for the cut: each in
its own network namespace behind a pass-through proxy, the head in a third). At token --at the
second worker is killed / stopped / cut off. The greedy tokens are compared with a run without
the fault. Never asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from _common import model_path, print_table, run_info, write_json  # noqa: E402

CHILD = HERE / "_failover_child.py"
PROXY = HERE.parent / "tests" / "delay_proxy.py"
ENV = {**os.environ, "POTLUCK_MDNS": "0"}


def _wait(proc: subprocess.Popen, needle: str, stream: str = "stderr") -> None:
    f = getattr(proc, stream)
    while needle not in (line := f.readline()):
        if not line:
            raise SystemExit(f"process ended before {needle!r}")


def _worker(host=None) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1] if host is None else 50052
    cmd = [sys.executable, "-m", "potluck.cli", "worker", "-p", str(port), "-t", "1", "--no-mdns"]
    kw = {"env": ENV, "stderr": subprocess.PIPE, "stdout": subprocess.DEVNULL, "text": True}
    p = host.popen(cmd, **kw) if host is not None else subprocess.Popen(cmd, **kw)
    _wait(p, "listening on")
    if host is None:
        return p, f"127.0.0.1:{port}"
    proxy = host.popen([sys.executable, str(PROXY), f"{host.ip}:6000", "127.0.0.1:50052", "0"],
                       stdout=subprocess.PIPE, text=True)  # fmt: skip
    _wait(proxy, "ready", "stdout")
    return p, f"{host.ip}:6000"


def _head(path: Path, n: int, timeout: float, peers: list[str], host=None) -> subprocess.Popen:
    cmd = [sys.executable, str(CHILD), str(path), str(n), str(timeout), *peers]
    kw = {"env": ENV, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    return host.popen(cmd, **kw) if host is not None else subprocess.Popen(cmd, **kw)


def _drive(head: subprocess.Popen, at: int, fault) -> dict:
    assert head.stdout is not None
    _wait(head, "ready", "stdout")
    times = []
    while True:
        line = head.stdout.readline()
        if not line:
            raise SystemExit(f"head failed: {head.stderr.read()[-2000:] if head.stderr else ''}")
        if line.startswith("tok "):
            times.append(float(line.split()[2]))
            if len(times) == at + 1 and fault is not None:
                fault()
        elif line.startswith("{"):
            out = json.loads(line)
            out["times"] = times
            head.wait(timeout=60)
            return out


def _summary(run: dict, at: int) -> dict:
    t = run["times"]
    before = (at) / (t[at] - t[0])
    after = (len(t) - at - 2) / (t[-1] - t[at + 1])
    return {"tok_s_before": before, "tok_s_after": after, "pause_s": t[at + 1] - t[at]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--at", type=int, default=24)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--out", type=Path, default=Path("bench/out/failover.json"))
    ap.add_argument(
        "--no-netns", action="store_true", help="skip the link cut (network namespaces)"
    )
    ap.add_argument("--quick", action="store_true",
                    help="32 tokens, fault at token 8, timeout 2 s: a smoke test")  # fmt: skip
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.at, args.timeout = 32, 8, 2.0
    path = model_path(args.model)
    result: dict = {"info": run_info(), "args": vars(args) | {"out": str(args.out)}, "faults": {}}
    procs: list[subprocess.Popen] = []
    try:
        workers = [_worker(), _worker()]
        procs += [p for p, _ in workers]
        clean = _drive(
            _head(path, args.tokens, args.timeout, [a for _, a in workers]), args.at, None
        )
        result["clean"] = _summary(clean, args.at)
        for fault in ("sigkill", "sigstop"):
            workers = [_worker(), _worker()]
            procs += [p for p, _ in workers]
            victim = workers[1][0]
            sig = signal.SIGKILL if fault == "sigkill" else signal.SIGSTOP
            run = _drive(
                _head(path, args.tokens, args.timeout, [a for _, a in workers]),
                args.at, lambda v=victim, s=sig: os.kill(v.pid, s),
            )  # fmt: skip
            result["faults"][fault] = run
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
    if os.geteuid() == 0 and not args.no_netns:
        from netns import netns_lan

        with netns_lan(3) as (h, w1, w2):
            workers = [_worker(w1), _worker(w2)]
            run = _drive(
                _head(path, args.tokens, args.timeout, [a for _, a in workers], h), args.at, w2.cut
            )
            result["faults"]["link cut"] = run
    rows = []
    for fault, run in result["faults"].items():
        s = _summary(run, args.at)
        ev = run["events"][0] if run["events"] else {}
        same = run["tokens"] == clean["tokens"]
        result["faults"][fault] = {**s, "events": run["events"], "same_tokens": same}
        rows.append([fault, f"{ev.get('detect_s', float('nan')):.2f}", f"{ev.get('recover_s', float('nan')):.2f}",
                     f"{s['pause_s']:.2f}", f"{s['tok_s_before']:.1f}", f"{s['tok_s_after']:.1f}",
                     "yes" if same else "NO"])  # fmt: skip
    c = result["clean"]
    rows.append(
        [
            "none",
            "–",
            "–",
            f"{c['pause_s']:.2f}",
            f"{c['tok_s_before']:.1f}",
            f"{c['tok_s_after']:.1f}",
            "–",
        ]
    )
    print_table(
        f"failover, head + 2 workers, {args.model}, timeout {args.timeout} s, fault at token {args.at}",
        ["fault", "detect s", "recover s", "pause s", "tok/s before", "tok/s after", "same tokens"],
        rows,
    )
    write_json(args.out, result)


if __name__ == "__main__":
    main()
