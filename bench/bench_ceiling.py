"""What two single-core stages can reach on this machine at all: one process vs a pool that sends
nothing vs the real pool, side by side.

    python bench/bench_ceiling.py [--models smollm2,gemma3] [--tasks decode,pp,streams] [--reps 3]
        [--quick] [--out bench/out/ceiling.json]

"zero-transport pool": two processes pinned to core 0 and core 1, each holding its stage (the
engine's own `Stage`, split as bench_pool.py splits), scheduled exactly as bench_pool.py's pool
(one decode step at a time; two groups of two streams in flight; 128-token prompt micro-batches
all submitted at once), but where the pool would send hidden states or token ids each side writes
one byte on a pipe (bench/_ceiling_child.py; each polls its pipe before blocking, as a worker
polls its data connections; `SPIN_MS=0` blocks at once). So its tok/s is the pool's ceiling
here: compute of two alternating stages, no serialization, sockets, threads or head. The ratio to one process shows
how much of a target is left for the transport to spend. The real pool (two `potluck worker -t 1`
pinned, as bench_pool.py) runs in the same rotation: single, zero-transport, real, single, …
Medians. Never asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import MODEL_NAMES, median, model_path, print_table, run_info, write_json  # noqa: E402
from _pool_child import balanced_cuts  # noqa: E402
from bench_pool import QUICK_TASKS, TASKS, child, start_worker  # noqa: E402

CEILING_CHILD = Path(__file__).resolve().parent / "_ceiling_child.py"


def ceiling_run(path: Path, task: str, n: int, cut: int, n_layer: int) -> dict:
    """The zero-transport pool: first stage on core 0, last on core 1, pipes in between."""
    a_r, b_w = os.pipe()  # last -> first
    b_r, a_w = os.pipe()  # first -> last

    def start(core: int, role: str, lo: int, hi: int, rfd: int, wfd: int) -> subprocess.Popen:
        cmd = ["taskset", "-c", str(core), sys.executable, str(CEILING_CHILD), str(path), role,
               task, str(lo), str(hi), str(n), str(rfd), str(wfd)]  # fmt: skip
        return subprocess.Popen(
            cmd, pass_fds=(rfd, wfd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    first = start(0, "first", 0, cut, a_r, a_w)
    last = start(1, "last", cut, n_layer, b_r, b_w)
    for fd in (a_r, a_w, b_r, b_w):
        os.close(fd)
    out, err = first.communicate()
    last_out, last_err = last.communicate()
    if first.returncode != 0 or last.returncode != 0:
        raise SystemExit(f"zero-transport pool failed:\n{err[-1500:]}\n{last_err[-1500:]}")
    res = json.loads(out.strip().splitlines()[-1])
    res["batch_ms"] = [res["batch_ms"], json.loads(last_out.strip().splitlines()[-1])["batch_ms"]]
    return res


def single_run(path: Path, task: str, n: int, n_layer: int) -> dict:
    cmd = ["taskset", "-c", "0", sys.executable, str(CEILING_CHILD), str(path), "single", task,
           "0", str(n_layer), str(n)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"single {task} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODEL_NAMES))
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/out/ceiling.json"))
    ap.add_argument("--quick", action="store_true",
                    help="smollm2, 1 rep, bench_pool.py's quick task sizes: a smoke test")  # fmt: skip
    args = ap.parse_args()
    tasks = dict(TASKS)
    if args.quick:
        args.models, args.reps, tasks = "smollm2", 1, dict(QUICK_TASKS)
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs two cores")
    from potluck.model.archs import hparams_from_metadata
    from potluck.modelfile.gguf_file import GGUFFile

    result: dict = {"info": run_info(), "tasks": tasks, "models": {}}
    rows = []
    for name in args.models.split(","):
        path = model_path(name)
        n_layer = hparams_from_metadata(GGUFFile(path).metadata).n_layer
        (w0, a0, _), (w1, a1, _) = start_worker(0), start_worker(1)
        entry: dict = {}
        try:
            for task in args.tasks.split(","):
                n = tasks[task]
                cut = balanced_cuts(str(path), 2, "prompt" if task == "pp" else "decode")[1]
                samples: dict[str, list[float]] = {"single": [], "zero": [], "pool": []}
                batch_ms: dict[str, list] = {"single": [], "zero": []}
                for _ in range(args.reps):  # A B C A B C ...
                    one = single_run(path, task, n, n_layer)
                    zero = ceiling_run(path, task, n, cut, n_layer)
                    samples["single"].append(one["tok_s"])
                    samples["zero"].append(zero["tok_s"])
                    batch_ms["single"].append(one["batch_ms"])
                    batch_ms["zero"].append(zero["batch_ms"])
                    samples["pool"].append(child(path, "pool", task, n, [a0, a1])["tok_s"])
                single, zero, pool = (median(samples[k]) for k in ("single", "zero", "pool"))
                entry[task] = {
                    "cut": cut, "samples": samples, "batch_ms": batch_ms, "single_tok_s": single,
                    "zero_transport_tok_s": zero, "pool_tok_s": pool,
                    "ceiling_ratio": zero / single, "pool_ratio": pool / single,
                }  # fmt: skip
                one_ms = median(batch_ms["single"])
                stage_ms = [median([b[i] for b in batch_ms["zero"]]) for i in range(2)]
                rows.append([name, task, f"{cut}|{n_layer - cut}", f"{single:.1f}",
                             f"{one_ms:.2f}", "/".join(f"{x:.2f}" for x in stage_ms),
                             f"{zero:.1f}", f"{zero / single:.2f}×", f"{pool:.1f}",
                             f"{pool / single:.2f}×", f"{pool / zero:.2f}×"])  # fmt: skip
        finally:
            for w in (w0, w1):
                w.terminate()
                w.wait()
        result["models"][name] = entry
    print_table(
        "1 single-core process vs 2 pinned stages that send nothing vs the real pool; tok/s, medians",
        [
            "model",
            "task",
            "layers",
            "1 core",
            "batch ms",
            "stage ms",
            "zero-transport",
            "ceiling",
            "pool",
            "pool ratio",
            "pool / zero",
        ],  # fmt: skip
        rows,
    )
    write_json(args.out, result)


if __name__ == "__main__":
    main()
