"""Per-token Python overhead of decode: the time of a decode step outside ggml's compute.

Each child process loads one model in one local stage (`load_model`, `Compute(threads=t)`), runs 8
warm-up steps, then `--rounds` passes of `--steps` single-token steps on a fresh sequence, timing
each pass whole and the part spent in `ggml_backend_sched_graph_compute` (the engine's graph
module is handed a wrapper of the ggml library that times that one call: bench children only).
Overhead = (wall - compute) / steps: the Python of a step (inputs, graph choice, validation,
reading the logits back, bookkeeping), the quantity issue 14 asks to drive down. The compute
part is reported too, but it moves ±10 % between processes on a shared VM: compare overheads.

With `--baseline REF` (a git ref) the children alternate between that tree (`git archive REF
src/potluck`) and the current one (a frozen copy), A B, B A, ...: before / after in one run.
Nothing here asserts a time.

    python bench/bench_overhead.py [--models smollm2,gemma3] [--threads 1,2] [--reps 3]
                                   [--baseline REF] [--out bench/out/overhead.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WARMUP = 8
N_CTX = 512


def child_main(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    from _common import ComputeClock, load_local
    from potluck.model import graph
    from potluck.model.stage import SeqChunk

    clock = ComputeClock(graph.lib)
    graph.lib = clock  # bench child only (see ComputeClock)
    m = load_local(spec["path"], N_CTX, spec["threads"])
    pipe, steps = m.pipeline, spec["steps"]
    ids = np.arange(1000, 1000 + WARMUP + steps, dtype=np.int64)

    def run(first: int, n: int) -> tuple[float, float]:
        seq = m.new_seq_id()
        c0, t0 = clock.seconds, time.perf_counter()
        for i in range(first, first + n):
            pipe.forward(ids[i : i + 1], [SeqChunk(seq, 1)])
        wall, compute = time.perf_counter() - t0, clock.seconds - c0
        pipe.drop(seq)
        return wall, compute

    run(0, WARMUP)
    passes = [run(0, steps) for _ in range(spec["rounds"])]
    return {
        "ms_per_token": [1e3 * w / steps for w, _ in passes],
        "compute_ms": [1e3 * c / steps for _, c in passes],
        "overhead_ms": [1e3 * (w - c) / steps for w, c in passes],
    }


def run_child(spec: dict[str, Any], tree: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS=str(spec["threads"]))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    tail = (done.stderr or done.stdout).strip().splitlines()[-15:]
    return {"error": f"exit {done.returncode}", "stderr_tail": tail}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=3, help="child processes per tree")
    ap.add_argument("--rounds", type=int, default=3, help="timed passes per child")
    ap.add_argument("--steps", type=int, default=128, help="decode steps per pass")
    ap.add_argument("--baseline", metavar="REF", help="also measure src/potluck at this git ref")
    ap.add_argument("--out", default="bench/out/overhead.json")
    ap.add_argument("--quick", action="store_true", help="smollm2, 1 thread, 1 child, 32 steps")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child_main(json.loads(args.child))), flush=True)
        return
    if args.quick:
        args.models, args.threads, args.reps, args.steps = "smollm2", "1", 1, 32

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import median, model_path, print_table, run_info, snapshot_src, write_json
    from bench_ubatch import baseline_tree

    out = Path(args.out)
    info = run_info()
    trees = {"current": str(snapshot_src(out.with_suffix(".src"))[0])}
    if args.baseline:
        trees = {"baseline": str(baseline_tree(args.baseline, out.with_suffix(".base"))), **trees}
        info["baseline_ref"] = args.baseline
    labels = list(trees)
    samples: list[dict[str, Any]] = []
    for name in args.models.split(","):
        path = str(model_path(name))
        for t in (int(x) for x in args.threads.split(",")):
            for rep in range(args.reps):
                for label in labels if rep % 2 == 0 else labels[::-1]:
                    spec = {"path": path, "threads": t, "steps": args.steps, "rounds": args.rounds}
                    res = run_child(spec, trees[label])
                    samples.append({"model": name, "threads": t, "tree": label, "rep": rep, **res})
                    if "error" in res:
                        print(f"  {name} t={t} {label} rep {rep}: FAILED {res['error']}")
                        print("    " + "\n    ".join(res["stderr_tail"]))
                        continue
                    print(f"  {name} t={t} {label:8s} rep {rep} overhead "
                          f"{median(res['overhead_ms']):.3f} ms/token, "
                          f"{median(res['ms_per_token']):.2f} ms/token in all", flush=True)  # fmt: skip
    info["loadavg_end"] = list(os.getloadavg())
    rows, summary = [], []
    for name in args.models.split(","):
        for t in (int(x) for x in args.threads.split(",")):
            for label in labels:
                got = [s for s in samples if (s["model"], s["threads"], s["tree"]) == (name, t, label)
                       and "error" not in s]  # fmt: skip
                over = [x for s in got for x in s["overhead_ms"]]
                total = [x for s in got for x in s["ms_per_token"]]
                if not over:
                    continue
                row = {"model": name, "threads": t, "tree": label, "overhead_ms": median(over),
                       "overhead_min_ms": min(over), "ms_per_token": median(total)}  # fmt: skip
                summary.append(row)
                rows.append([name, str(t), label, f"{row['overhead_ms']:.3f}",
                             f"{row['overhead_min_ms']:.3f}", f"{row['ms_per_token']:.2f}"])  # fmt: skip
    print_table(
        "Per-token Python overhead of decode (medians over every pass of every child)",
        ["model", "threads", "tree", "overhead ms", "min ms", "ms/token in all"],
        rows,
    )
    write_json(out, {"info": info, "summary": summary, "samples": samples})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
