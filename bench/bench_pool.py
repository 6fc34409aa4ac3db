"""Two single-core workers vs one single-core process, decode, side by side in one run.

    python bench/bench_pool.py [--models smollm2,gemma3] [--reps 3] [--tokens 64] [--out bench/out/pool.json]

Each worker is its own OS process pinned to one core with `taskset` (standing in for two
single-core machines on a LAN; here the "network" is loopback). The single-core baseline is a
child process pinned to core 0 running the whole model in process. Alternates A B A B ... and
reports medians; also worker start-to-ready time, bytes on the wire per decoded token, and the
peak RSS of each worker against its share of the weights. Never asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import MODEL_NAMES, median, model_path, print_table, run_info, write_json  # noqa: E402

CHILD = r"""
import json, sys, time, resource, torch
from potluck.engine.generate import load_model
from potluck.engine.pipeline import Assignment
from potluck.model.stage import SeqChunk
torch.set_num_threads(1)
path, mode, n_tok = sys.argv[1], sys.argv[2], int(sys.argv[3])
peers = sys.argv[4:]
if mode == "single":
    m = load_model(path, n_ctx=512)
else:
    from potluck.modelfile.gguf_file import GGUFFile
    from potluck.modelfile.hparams import hparams_from_metadata
    n = hparams_from_metadata(GGUFFile(path).metadata).n_layer
    m = load_model(path, n_ctx=512, assignments=[Assignment(peers[0], 0, n // 2), Assignment(peers[1], n // 2, n)])
from potluck.engine.sampling import GREEDY, Sampler
ids = m.tokenizer.encode("The history of the printing press")
s, seq = Sampler(GREEDY), m.new_seq_id()
tok = m.pipeline.step(torch.tensor(ids), [SeqChunk(seq, len(ids))], {seq: s}, {})[0]
t0 = time.perf_counter()
for _ in range(n_tok):
    tok = m.pipeline.step(torch.tensor([tok]), [SeqChunk(seq, 1)], {seq: s}, {})[0]
dt = time.perf_counter() - t0
m.pipeline.drop(seq)
extra = {}
if mode == "pool":
    extra = {"stage_ms": list(m.pipeline.last_stage_ms), "hop_ms": list(m.pipeline.last_hop_ms)}
print(json.dumps({"tok_s": n_tok / dt, **extra}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(core: int) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    t0 = time.perf_counter()
    cmd = [
        "taskset",
        "-c",
        str(core),
        sys.executable,
        "-m",
        "potluck.cli",
        "worker",
        "-p",
        str(port),
        "-t",
        "1",
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert proc.stderr is not None
    while "listening on" not in proc.stderr.readline():
        if proc.poll() is not None:
            raise SystemExit("worker failed to start")
    return proc, f"127.0.0.1:{port}", time.perf_counter() - t0


def child(path: Path, mode: str, n_tok: int, peers: list[str]) -> dict:
    cmd = ["taskset", "-c", "0", sys.executable, "-c", CHILD, str(path), mode, str(n_tok), *peers]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODEL_NAMES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("bench/out/pool.json"))
    args = ap.parse_args()
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs two cores to pin two workers")
    result = {"info": run_info(), "models": {}}
    rows = []
    for name in args.models.split(","):
        path = model_path(name)
        (w0, a0, t0), (w1, a1, t1) = start_worker(0), start_worker(1)
        try:
            samples: dict[str, list] = {"single": [], "pool": []}
            extra = {}
            for _ in range(args.reps):
                samples["single"].append(child(path, "single", args.tokens, [])["tok_s"])
                r = child(path, "pool", args.tokens, [a0, a1])
                samples["pool"].append(r["tok_s"])
                extra = r
            rss = [rss_mib(w0.pid), rss_mib(w1.pid)]
        finally:
            for w in (w0, w1):
                w.terminate()
                w.wait()
        from potluck.modelfile.gguf_file import GGUFFile
        from potluck.modelfile.hparams import hparams_from_metadata

        hp = hparams_from_metadata(GGUFFile(path).metadata)
        single, pool = median(samples["single"]), median(samples["pool"])
        wire = (
            hp.n_embd * 4 + 8
        )  # fp32 hidden state per token on the one worker-to-worker hop, + token id back
        result["models"][name] = {
            "samples": samples, "single_tok_s": single, "pool_tok_s": pool, "ratio": pool / single,
            "worker_ready_s": [t0, t1], "worker_peak_rss_mib": rss, "wire_bytes_per_token": wire,
            "last_stage_ms": extra.get("stage_ms"), "last_hop_ms": extra.get("hop_ms"),
        }  # fmt: skip
        rows.append([name, f"{single:.1f}", f"{pool:.1f}", f"{pool / single:.2f}×", f"{max(t0, t1):.1f}",
                     f"{rss[0]:.0f} / {rss[1]:.0f}", str(wire)])  # fmt: skip
    print_table(
        "decode, 2 single-core workers vs 1 single-core process",
        [
            "model",
            "1 core tok/s",
            "2 workers tok/s",
            "ratio",
            "worker ready s",
            "worker peak RSS MiB",
            "wire B/token",
        ],
        rows,
    )
    write_json(args.out, result)


if __name__ == "__main__":
    main()
