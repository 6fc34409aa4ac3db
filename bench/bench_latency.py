"""Decode over links with latency: steps sent ahead of their token vs the head in the loop.

    python bench/bench_latency.py [--models smollm2,gemma3] [--delays 0,1,2] [--reps 3]
        [--tokens 64] [--quick] [--out bench/out/latency.json]

Two `potluck worker -t 1` pinned to core 0 and core 1 (standing in for two single-core machines),
all layers on them, and every link (head → first node, first → second node) through
tests/delay_proxy.py, which adds a fixed one-way delay to every byte (netem is not available
here; the proxy rounds sleeps up to whole milliseconds, so delay 0 is the proxies' own cost).
Each worker is reached at its own loopback address (127.0.0.2, 127.0.0.3) where proxies listen on
both of its ports (gRPC and data). For each delay, in an A B C rotation, medians of tok/s:

- one process pinned to core 0 (no network),
- the pool as `potluck run` drives it: each step is sent before the token it follows is back, and
  the first node starts it as soon as it relays that token (two link crossings per token),
- the pool with the head in the loop: each step waits for its token at the head (four crossings
  per token: head → node → node → node → head), as the pool ran before follow-up steps.

Never asserts a time.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import MODEL_NAMES, ROOT, median, model_path, print_table, run_info, write_json  # noqa: E402
from bench_pool import child, free_port  # noqa: E402

PROXY = ROOT / "tests" / "delay_proxy.py"
N_TOKENS = 64


def start_worker(core: int) -> tuple[subprocess.Popen, int, int]:
    """A worker pinned to `core`; (process, gRPC port, data port)."""
    port = free_port()
    cmd = ["taskset", "-c", str(core), sys.executable, "-m", "potluck.cli", "worker", "-p",
           str(port), "-t", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert proc.stderr is not None
    while "listening on" not in (line := proc.stderr.readline()):
        if proc.poll() is not None:
            raise SystemExit("worker failed to start")
    found = re.search(r"data port (\d+)", line)
    if found is None:
        raise SystemExit(f"the worker did not say its data port: {line.strip()}")
    return proc, port, int(found.group(1))


def start_proxies(host: str, ports: tuple[int, int], delay_ms: float) -> list[subprocess.Popen]:
    procs = []
    for port in ports:
        cmd = [sys.executable, str(PROXY), f"{host}:{port}", f"127.0.0.1:{port}", str(delay_ms)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        if not proc.stdout.readline().startswith("ready"):
            raise SystemExit(f"the delay proxy on {host}:{port} did not start")
        procs.append(proc)
    return procs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODEL_NAMES))
    ap.add_argument("--delays", default="0,1,2", help="one-way delay per link, ms")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=N_TOKENS, help="decoded tokens per run")
    ap.add_argument("--out", type=Path, default=Path("bench/out/latency.json"))
    ap.add_argument("--quick", action="store_true",
                    help="smollm2, delays 0 and 2 ms, 1 rep, 16 tokens: a smoke test")  # fmt: skip
    args = ap.parse_args()
    if args.quick:
        args.models, args.delays, args.reps, args.tokens = "smollm2", "0,2", 1, 16
    result: dict = {"info": run_info(), "tokens": args.tokens, "models": {}}
    rows = []
    for name in args.models.split(","):
        path = model_path(name)
        workers = [start_worker(0), start_worker(1)]
        entry: dict = {}
        try:
            for delay in [float(d) for d in args.delays.split(",")]:
                hosts = ["127.0.0.2", "127.0.0.3"]
                proxies = [
                    p
                    for host, (_, port, data) in zip(hosts, workers, strict=True)
                    for p in start_proxies(host, (port, data), delay)
                ]
                peers = [f"{h}:{port}" for h, (_, port, _) in zip(hosts, workers, strict=True)]
                samples: dict[str, list[float]] = {"single": [], "ahead": [], "loop": []}
                try:
                    for _ in range(args.reps):  # A B C A B C ...
                        samples["single"].append(
                            child(path, "single", "decode", args.tokens, [])["tok_s"]
                        )
                        for mode, env in (("ahead", {}), ("loop", {"POOL_AHEAD": "0"})):
                            got = child(path, "pool", "decode", args.tokens, peers, env)
                            samples[mode].append(got["tok_s"])
                finally:
                    for p in proxies:
                        p.terminate()
                        p.wait()
                    time.sleep(0.5)  # the proxies' ports are free again
                single, ahead, loop = (median(samples[k]) for k in ("single", "ahead", "loop"))
                entry[str(delay)] = {
                    "samples": samples, "single_tok_s": single, "ahead_tok_s": ahead,
                    "loop_tok_s": loop,
                }  # fmt: skip
                rows.append([name, f"{delay:g}", f"{single:.1f}", f"{ahead:.1f}", f"{loop:.1f}",
                             f"{ahead / single:.2f}×", f"{loop / single:.2f}×",
                             f"{ahead / loop:.2f}×"])  # fmt: skip
        finally:
            for w, _, _ in workers:
                w.terminate()
                w.wait()
        result["models"][name] = entry
    print_table(
        "decode over links with a one-way delay: 2 single-core workers vs 1 single-core process; "
        "tok/s, medians",
        [
            "model",
            "delay ms",
            "1 core",
            "steps ahead",
            "head in loop",
            "ahead / 1 core",
            "loop / 1 core",
            "ahead / loop",
        ],  # fmt: skip
        rows,
    )
    write_json(args.out, result)


if __name__ == "__main__":
    main()
