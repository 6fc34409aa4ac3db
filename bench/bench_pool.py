"""Two single-core workers vs one single-core process vs llama.cpp RPC: decode, pp512 and 4
streams, side by side.

    python bench/bench_pool.py [--models smollm2,gemma3] [--tasks decode,pp,streams] [--reps 3]
        [--llama-bin DIR | --no-llama] [--head-cpus 0,1] [--quick] [--pp N]
        [--out bench/out/pool.json]

Each worker is its own OS process pinned to one core with `taskset` (standing in for two
single-core machines on a LAN; here the "network" is loopback). The single-core baseline is a
child process pinned to core 0 running the whole model in process. llama.cpp's RPC mode (two
`ggml-rpc-server -t 1` pinned to core 0 and core 1, `llama-bench --rpc a,b -ngl 99`, as
BENCHMARKS.md's reference) runs in the same rotation when its tools are found. Alternates
A B C A B C ... and reports medians; also worker start-to-ready time, bytes on the wire per
decoded token, and the peak RSS of each worker against its share of the weights. Never asserts a
time.
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
from _common import (  # noqa: E402
    MODEL_NAMES,
    llama_bin_default,
    llama_tools,
    median,
    model_path,
    print_table,
    run_info,
    write_json,
)

CHILD = Path(__file__).resolve().parent / "_pool_child.py"
TASKS = {"decode": 64, "pp": 512, "streams": 32}  # task -> tokens (per stream)
QUICK_TASKS = {"decode": 16, "pp": 128, "streams": 8}  # --quick: a smoke test


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


HEAD_CPUS = "0,1"  # where the pool's head runs (--head-cpus)


def child(
    path: Path, mode: str, task: str, n_tok: int, peers: list[str], env: dict | None = None
) -> dict:
    # the single-core baseline computes on core 0; the pool's head only sends token ids and
    # reads replies: by default it may run on either core (there is no third machine here)
    cpus = "0" if mode == "single" else HEAD_CPUS
    cmd = [
        "taskset",
        "-c",
        cpus,
        sys.executable,
        str(CHILD),
        str(path),
        mode,
        task,
        str(n_tok),
        *peers,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise SystemExit(f"{mode} {task} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


LLAMA_UBATCH = 64  # llama.cpp RPC's best prompt micro-batch over two servers (BENCHMARKS.md)


def start_rpc_server(bin_dir: Path, core: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = ["taskset", "-c", str(core), str(bin_dir / "ggml-rpc-server"), "-t", "1", "-p", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"127.0.0.1:{port}"
        time.sleep(0.1)
    raise SystemExit("ggml-rpc-server did not start")


def llama_rpc(bin_dir: Path, path: Path, task: str, n: int) -> float | None:
    """llama.cpp's RPC mode: all layers (-ngl 99) on two rpc servers pinned to one core each,
    started for this run only (so that nothing of llama.cpp runs beside the other runs); tok/s."""
    if task == "streams":
        return None  # llama-bench has no concurrent-stream mode
    rpc = [start_rpc_server(bin_dir, c) for c in (0, 1)]
    try:
        return _llama_bench(bin_dir, path, task, n, [a for _, a in rpc])
    finally:
        for p, _ in rpc:
            p.terminate()
            p.wait()


def _llama_bench(bin_dir: Path, path: Path, task: str, n: int, servers: list[str]) -> float:
    work = (
        ["-p", "0", "-n", str(n)]
        if task == "decode"
        else ["-p", str(n), "-n", "0", "-ub", str(LLAMA_UBATCH)]
    )
    cmd = ["taskset", "-c", "0,1", str(bin_dir / "llama-bench"), "-m", str(path), "--rpc",
           ",".join(servers), "-ngl", "99", "-r", "1", "-o", "json", *work]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"llama-bench failed:\n{done.stderr[-2000:]}")
    return float(json.loads(done.stdout)[0]["avg_ts"])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    global HEAD_CPUS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODEL_NAMES))
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/out/pool.json"))
    ap.add_argument(
        "--llama-bin", "--llamacpp-bin", type=Path, default=llama_bin_default(),
        help="llama.cpp's build/bin with llama-bench and ggml-rpc-server (built with GGML_RPC=ON; "
        "default: $LLAMA_CPP_BIN, else the vendored build): adds llama.cpp RPC over two pinned "
        "servers to the same run",
    )  # fmt: skip
    ap.add_argument("--no-llama", action="store_true", help="potluck only, no llama.cpp RPC")
    ap.add_argument("--quick", action="store_true",
                    help="smollm2, 1 rep, decode 16, pp 128, 4 streams × 8: a smoke test")  # fmt: skip
    ap.add_argument(
        "--head-cpus", default=HEAD_CPUS,
        help="cores the pool's head may run on (taskset -c); 0 = beside the first worker, the "
        "machine that idles while the second computes",
    )  # fmt: skip
    ap.add_argument("--pp", type=int, help=f"prompt tokens of the pp task (default {TASKS['pp']})")
    args = ap.parse_args()
    HEAD_CPUS = args.head_cpus
    tasks = dict(TASKS)
    if args.quick:
        args.models, args.reps, tasks = "smollm2", 1, dict(QUICK_TASKS)
    if args.pp:
        tasks["pp"] = args.pp
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs two cores to pin two workers")
    llama_bin = (
        None if args.no_llama else llama_tools(args.llama_bin, "llama-bench", "ggml-rpc-server")
    )
    if llama_bin is None and not args.no_llama:
        print("Skipping llama.cpp RPC: potluck figures only.")
    result: dict = {
        "info": run_info(llama_bin),
        "head_cpus": HEAD_CPUS,
        "tasks": tasks,
        "models": {},
    }
    rows = []
    for name in args.models.split(","):
        path = model_path(name)
        (w0, a0, t0), (w1, a1, t1) = start_worker(0), start_worker(1)
        entry: dict = {"worker_ready_s": [t0, t1]}
        try:
            # memory of a worker holding one plan: fresh workers, one decode run, peak RSS
            entry["worker_idle_rss_mib"] = [rss_mib(w0.pid), rss_mib(w1.pid)]
            child(path, "pool", "decode", 16, [a0, a1])
            entry["worker_one_plan_peak_rss_mib"] = [rss_mib(w0.pid), rss_mib(w1.pid)]
            for task in args.tasks.split(","):
                n = tasks[task]
                samples: dict[str, list[float]] = {"single": [], "pool": [], "llama_rpc": []}
                last: dict = {}
                for _ in range(args.reps):  # A B C A B C ...
                    samples["single"].append(child(path, "single", task, n, [])["tok_s"])
                    last = child(path, "pool", task, n, [a0, a1])
                    samples["pool"].append(last["tok_s"])
                    if llama_bin and (r := llama_rpc(llama_bin, path, task, n)):
                        samples["llama_rpc"].append(r)
                single, pool = median(samples["single"]), median(samples["pool"])
                lrpc = median(samples["llama_rpc"]) if samples["llama_rpc"] else None
                entry[task] = {
                    "samples": samples, "single_tok_s": single, "pool_tok_s": pool,
                    "ratio": pool / single, "llama_rpc_tok_s": lrpc,
                    "vs_llama_rpc": pool / lrpc if lrpc else None,
                    "stage_ms": last.get("stage_ms"), "hop_ms": last.get("hop_ms"),
                }  # fmt: skip
                stage = "/".join(f"{x:.2f}" for x in last.get("stage_ms", []))
                hop = "/".join(f"{x:.2f}" for x in last.get("hop_ms", []))
                rows.append([name, task, f"{single:.1f}", f"{pool:.1f}", f"{pool / single:.2f}×",
                             f"{lrpc:.1f}" if lrpc else "–", f"{pool / lrpc:.2f}×" if lrpc else "–",
                             stage, hop])  # fmt: skip
            entry["worker_peak_rss_mib"] = [rss_mib(w0.pid), rss_mib(w1.pid)]
        finally:
            for w in (w0, w1):
                w.terminate()
                w.wait()
        from potluck.model.archs import hparams_from_metadata
        from potluck.modelfile.gguf_file import GGUFFile

        gguf = GGUFFile(path)
        hp = hparams_from_metadata(gguf.metadata)
        # fp32 hidden state per token on the worker-to-worker hop, + the token id each way
        entry["wire_bytes_per_token"] = hp.n_embd * 4 + 16
        entry["weights_mib"] = gguf.size_bytes / 2**20
        result["models"][name] = entry
    print_table(
        "2 single-core workers (pinned) vs 1 single-core process; tok/s, medians",
        [
            "model",
            "task",
            "1 core",
            "2 workers",
            "ratio",
            "llama.cpp RPC",
            "vs RPC",
            "stage ms",
            "hop ms",
        ],  # fmt: skip
        rows,
    )
    print_table(
        "workers",
        [
            "model",
            "ready s",
            "idle peak RSS MiB",
            "one plan: peak RSS",
            "after every run",
            "file MiB",
            "wire B/token",
        ],  # fmt: skip
        [
            [
                name,
                "/".join(f"{t:.1f}" for t in e["worker_ready_s"]),
                "/".join(f"{r:.0f}" for r in e["worker_idle_rss_mib"]),
                "/".join(f"{r:.0f}" for r in e["worker_one_plan_peak_rss_mib"]),
                "/".join(f"{r:.0f}" for r in e["worker_peak_rss_mib"]),
                f"{e['weights_mib']:.0f}",
                str(e["wire_bytes_per_token"]),
            ]  # fmt: skip
            for name, e in result["models"].items()
        ],
    )
    write_json(args.out, result)


if __name__ == "__main__":
    main()
