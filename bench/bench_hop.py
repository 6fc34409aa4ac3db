"""What the pool itself costs per token: a near-zero-compute model over two pinned workers, with
hidden states on the workers' data ports (transport/dataplane.py) vs on gRPC streams only
(`potluck worker --no-data-port`), side by side.

    python bench/bench_hop.py [--reps 3] [--tokens 300] [--quick] [--out bench/out/hop.json]

The model is a random 2-layer llama with SmolLM2's width (576), written with gguf.GGUFWriter (the
tests' generator), one layer per worker, so per-token time is almost all transport: the head's
send, two hops, the relay back, the head's bookkeeping. Workers are pinned to core 0 and core 1,
the head runs on both (as bench_pool.py). Alternates A B A B …, medians. Never asserts a time.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import print_table, run_info, write_json  # noqa: E402

CHILD = r"""
import json, sys, time
import numpy as np
from potluck.engine.generate import prefill
from potluck.pool.build import load_model
from potluck.engine.contract import Assignment
from potluck.sampling import GREEDY, Sampler
from potluck.model.stage import Compute, SeqChunk
path, a, b, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
m = load_model(path, n_ctx=512, assignments=[Assignment(a, 0, 1), Assignment(b, 1, 2)], compute=Compute(threads=1))
pipe = m.pipeline
links = [type(c.link).__name__ for c in pipe.inner.clients]
seq, s = m.new_seq_id(), Sampler(GREEDY)
tok = prefill(pipe, seq, [1, 2, 3], s)
walls, hops = [], []
for _ in range(n):
    t = time.perf_counter()
    tok = pipe.step(np.array([tok], np.int64), [SeqChunk(seq, 1)], {seq: s}, {})[0]
    walls.append((time.perf_counter() - t) * 1e3)
    hops.append(sum(pipe.last_hop_ms))
walls.sort(); hops.sort()
print(json.dumps({"ms": walls[n // 2], "hop_ms": hops[n // 2], "links": links}), flush=True)
import os
os._exit(0)  # workaround, as in cli.main: gRPC's core may abort in its destructors at exit
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(core: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = ["taskset", "-c", str(core), sys.executable, "-m", "potluck.cli", "worker",
           "-p", str(port), "-t", "1", *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert proc.stderr is not None
    while "listening on" not in proc.stderr.readline():
        if proc.poll() is not None:
            raise SystemExit("worker failed to start")
    return proc, f"127.0.0.1:{port}"


def one(path: Path, extra: list[str], tokens: int) -> dict:
    workers = [start_worker(0, extra), start_worker(1, extra)]
    try:
        done = subprocess.run(
            ["taskset", "-c", "0,1", sys.executable, "-c", CHILD, str(path),
             workers[0][1], workers[1][1], str(tokens)],
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"child failed:\n{done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        for p, _ in workers:
            p.kill()
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--out", type=Path, default=Path("bench/out/hop.json"))
    ap.add_argument("--quick", action="store_true", help="1 rep, 50 tokens: a smoke test")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.tokens = 1, 50
    from ggufgen import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_model(
            Path(tmp) / "tiny.gguf", "llama", n_layer=2, n_embd=576, n_head=9, n_head_kv=3
        )
        lanes = {"data port": [], "gRPC stream": ["--no-data-port"]}
        samples: dict[str, list[dict]] = {k: [] for k in lanes}
        for _ in range(args.reps):
            for name, extra in lanes.items():
                samples[name].append(one(path, extra, args.tokens))
    rows, out = [], {}
    for name, runs in samples.items():
        ms = statistics.median(r["ms"] for r in runs)
        hop = statistics.median(r["hop_ms"] for r in runs)
        out[name] = {"ms_per_token": ms, "hop_ms": hop, "links": runs[0]["links"], "runs": runs}
        rows.append([name, "/".join(runs[0]["links"]), f"{ms:.3f}", f"{hop:.3f}"])
    print_table(
        "pool overhead per token, 2 pinned workers, near-zero compute (medians)",
        ["hidden states on", "links", "ms per token", "hops ms (both)"],
        rows,
    )
    write_json(args.out, {"run": run_info(), "results": out})


if __name__ == "__main__":
    main()
