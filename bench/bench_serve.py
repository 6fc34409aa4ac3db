"""Total tokens/s through `potluck serve` with 4 concurrent streams vs 1 (continuous batching).

    python bench/bench_serve.py [--setups single,pool] [--model smollm2] [--tokens 64] [--reps 3]
                                [--threads 1] [--quick] [--out bench/out/serve.json]

Each setup starts a real `potluck serve --port 0` child and drives it with the official `openai`
client over loopback: k streaming completions at once (k = 1 and 4, alternating over the reps),
each `--tokens` greedy tokens from a different counting prompt (no early end of text), and
measures the wall time from the first request to the last token, the total tokens/s
(completion tokens of all streams / wall), per-stream tokens/s and the time to first token.
"pool" is the same server with `--rpc` two `potluck worker` children and `--tensor-split 1,1,1`
(this machine and the two workers each run a third of the layers; here the "network" is loopback
and all three share this machine's cores). Prints a table, writes JSON; never asserts a time.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import model_path, print_table, run_info, write_json  # noqa: E402

STREAMS = (1, 4)
# mDNS off for every child: only the workers this script starts, none announced to others
ENV = {k: v for k, v in os.environ.items() if k != "POTLUCK_API_KEY"} | {"POTLUCK_MDNS": "0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "potluck.cli", "worker", "-p", str(port), "-t", str(threads)]
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=ENV
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + 120
    while "listening on" not in proc.stderr.readline():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("worker failed to start")
    return proc, f"127.0.0.1:{port}"


def start_server(
    path: Path, threads: int, peers: list[str], n_ctx: int
) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "potluck.cli", "serve", "-m", str(path), "-c", str(n_ctx)]
    cmd += ["-t", str(threads), "--port", "0"]
    if peers:
        cmd += ["--rpc", ",".join(peers), "--tensor-split", ",".join(["1"] * (len(peers) + 1))]
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=ENV
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            return proc, m.group(1)
    proc.kill()
    raise SystemExit(f"potluck serve failed to start: {proc.stderr.read()[-2000:]}")


def one_stream(client, model: str, prompt: str, n_tok: int) -> dict:
    t0 = time.perf_counter()
    first = None
    usage = None
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=n_tok,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for ch in stream:
        if ch.choices and ch.choices[0].text and first is None:
            first = time.perf_counter()
        if ch.usage is not None:
            usage = ch.usage
    t1 = time.perf_counter()
    assert usage is not None
    n = usage.completion_tokens
    return {
        "tokens": n,
        "ttft_s": (first or t1) - t0,
        "wall_s": t1 - t0,
        "decode_tok_s": (n - 1) / (t1 - first) if first and t1 > first and n > 1 else None,
    }


def run_round(url: str, k: int, n_tok: int, rep: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    prompts = [
        f"count: {s} {s + 1} {s + 2} {s + 3}" for s in range(10 + 50 * rep, 10 + 50 * rep + k)
    ]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(k) as pool:
        streams = list(pool.map(lambda p: one_stream(client, model, p, n_tok), prompts))
    wall = time.perf_counter() - t0
    total = sum(s["tokens"] for s in streams)
    return {
        "streams": k,
        "rep": rep,
        "wall_s": wall,
        "total_tokens": total,
        "total_tok_s": total / wall,
        "per_stream": streams,
    }


def bench_setup(name: str, path: Path, args: argparse.Namespace) -> dict:
    workers = [start_worker(args.threads) for _ in range(2)] if name == "pool" else []
    server, url = start_server(path, args.threads, [a for _, a in workers], args.ctx)
    try:
        run_round(url, 1, 8, 99)  # warm-up (graphs per step shape, caches, connections)
        rounds = []
        for rep in range(args.reps):
            order = STREAMS if rep % 2 == 0 else STREAMS[::-1]
            for k in order:
                r = run_round(url, k, args.tokens, rep)
                print(f"  {name} rep {rep} · {k} streams · {r['total_tok_s']:.1f} tok/s total")
                rounds.append(r)
    finally:
        server.terminate()
        server.wait(timeout=20)
        for p, _ in workers:
            p.terminate()
            p.wait(timeout=20)
    return {"setup": name, "rounds": rounds}


def summarize(results: list[dict]) -> list[list[str]]:
    rows = []
    for res in results:
        by_k = {k: [r for r in res["rounds"] if r["streams"] == k] for k in STREAMS}
        med = {k: statistics.median(r["total_tok_s"] for r in rs) for k, rs in by_k.items() if rs}
        for k, rs in by_k.items():
            if not rs:
                continue
            ttft = statistics.median(s["ttft_s"] for r in rs for s in r["per_stream"])
            per = [s["decode_tok_s"] for r in rs for s in r["per_stream"] if s["decode_tok_s"]]
            rows.append(
                [
                    res["setup"],
                    str(k),
                    f"{med[k]:.1f} ({min(r['total_tok_s'] for r in rs):.1f}–{max(r['total_tok_s'] for r in rs):.1f})",
                    f"{statistics.median(per):.1f}" if per else "-",
                    f"{ttft * 1e3:.0f}",
                    f"{med[k] / med[1]:.2f}×" if 1 in med else "-",
                ]
            )
        res["median_total_tok_s"] = {str(k): v for k, v in med.items()}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setups", default="single,pool")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--out", type=Path, default=Path("bench/out/serve.json"))
    ap.add_argument("--quick", action="store_true",
                    help="both setups, 1 rep, 16 tokens per stream: a smoke test")  # fmt: skip
    args = ap.parse_args()
    if args.quick:
        args.reps, args.tokens = 1, 16
    path = model_path(args.model)
    info = run_info()
    results = []
    for name in args.setups.split(","):
        print(f"{name}: starting")
        results.append(bench_setup(name, path, args))
    rows = summarize(results)
    print_table(
        f"potluck serve · {path.name} · {args.tokens} tokens per stream · -t {args.threads} · "
        f"{args.reps} reps",
        [
            "setup",
            "streams",
            "total tok/s median (min–max)",
            "per-stream decode tok/s",
            "TTFT ms",
            "vs 1 stream",
        ],  # fmt: skip
        rows,
    )
    write_json(
        args.out,
        {"info": info, "args": {k: str(v) for k, v in vars(args).items()}, "results": results},
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
