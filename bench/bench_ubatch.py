"""Prompt throughput by micro-batch size: how fast one stage eats a prompt fed in pieces.

A pool pipelines a prompt through its stages in micro-batches of `n_batch` rows, so a stage's speed
at 16-256 rows matters as much as at 512. Each child process loads one model with one source tree
and thread count, warms up, then runs the same prompt (`--prompt` tokens, fixed seeded ids) through
one local stage `--rounds` times per size, in micro-batches of each size (one `pipeline.forward` per
micro-batch on one sequence, the KV cache growing as in a real prefill), the sizes in a rotated
order each round so drift hits all alike. Reported: prompt tokens/s per size (median over rounds
and children, min–max) and its ratio to the largest size's figure, per CPU second of the child (user + system: on a
shared machine a time slice lost to another process does not count) and per wall second. Only the
prompt's last token gets logits, as prefill computes them (`--head-every`: also every earlier
micro-batch's last row, to see what the output head costs per micro-batch).

With `--baseline REF` (a git ref, e.g. HEAD) the children alternate between that tree
(`git archive REF src/potluck`) and the current one (frozen copy), A B, B A, ...: before / after in
one run. REF must be on the ggml engine (0da8902 or later): the child feeds numpy arrays and sets the
thread count, which the PyTorch engine before it did not allow. Nothing here asserts a time; the
machine is shared, so the load average is recorded.

    python bench/bench_ubatch.py [--models smollm2,gemma3] [--threads 1,2] [--sizes 16,...,512]
                                 [--reps 2] [--rounds 3] [--baseline HEAD] [--pin] [--quick]
                                 [--out bench/out/ubatch.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

N_CTX = 1024
SIZES = (16, 32, 64, 128, 256, 512)
TOKEN_RANGE = (1000, 40000)  # ordinary text tokens in both vocabularies (as bench_single)
SEED = 1234


# -- child side ------------------------------------------------------------------------------------
def child_main(spec: dict) -> dict:
    import numpy as np

    if spec["pin"]:
        os.sched_setaffinity(0, set(range(spec["threads"])))
    import potluck

    try:
        from potluck.model.stage import SeqChunk
    except ImportError as e:  # a --baseline from before the ggml engine
        raise SystemExit(f"{potluck.__file__}: not the ggml engine: {e}") from e
    from _common import load_local

    m = load_local(spec["path"], N_CTX, spec["threads"])
    pipe, toks = m.pipeline, np.array(spec["tokens"], np.int64)

    none = np.empty(0, np.int64)  # no logits rows: the output head is skipped

    def prompt(size: int) -> tuple[float, float]:
        """(tokens per wall second, tokens per CPU second of this process)"""
        seq = m.new_seq_id()
        try:
            t0, c0 = time.perf_counter(), time.process_time()
            for start in range(0, len(toks), size):
                part = toks[start : start + size]
                last = start + size >= len(toks)
                # logits of the prompt's last token only, as prefill computes them
                # (--head-every: of every micro-batch's last row)
                rows = None if last or spec["head_every"] else none
                pipe.forward(part, [SeqChunk(seq, len(part))], rows)
            return len(toks) / (time.perf_counter() - t0), len(toks) / (time.process_time() - c0)
        finally:
            pipe.drop(seq)

    sizes = [str(s) for s in spec["sizes"]]
    out: dict = {"potluck_from": potluck.__file__, "tok_s": {s: [] for s in sizes},
                 "tok_cpu_s": {s: [] for s in sizes}}  # fmt: skip
    prompt(64)  # warm-up: first graphs, first-call allocations, page faults
    c0, w0 = os.times(), time.perf_counter()
    for r in range(spec["rounds"]):
        k = r % len(sizes)
        for size in sizes[k:] + sizes[:k]:
            wall, cpu = prompt(int(size))
            out["tok_s"][size].append(wall)
            out["tok_cpu_s"][size].append(cpu)
    c1, w1 = os.times(), time.perf_counter()
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    out["cpu_share"] = cpu / ((w1 - w0) * spec["threads"])
    return out


# -- parent side -----------------------------------------------------------------------------------
def run_child(spec: dict, pythonpath: str) -> dict:
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(spec["threads"]),
        PYTHONPATH=os.pathsep.join(filter(None, [pythonpath, os.environ.get("PYTHONPATH")])),
    )
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (done.stderr or done.stdout).strip().splitlines()[-15:]
    return {"error": f"exit {done.returncode}", "stderr_tail": tail}


def baseline_tree(ref: str, dest: Path) -> Path:
    """src/potluck as of git `ref`, unpacked under dest (the children's PYTHONPATH)."""
    import shutil

    from _common import ROOT

    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src/potluck"],
                             capture_output=True, check=True, timeout=60).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True, timeout=60)
    return dest / "src"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="micro-batch sizes (rows)")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    ap.add_argument("--reps", type=int, default=2, help="child processes per tree")
    ap.add_argument("--rounds", type=int, default=3, help="timed passes over the sizes per child")
    ap.add_argument("--baseline", metavar="REF", help="also measure src/potluck at this git ref")
    ap.add_argument("--pin", action="store_true", help="pin a t-thread child to CPUs 0..t-1")
    ap.add_argument("--head-every", action="store_true",
                    help="logits of every micro-batch's last row (the head's cost), not only the "
                         "prompt's last token")  # fmt: skip
    ap.add_argument("--out", default="bench/out/ubatch.json")
    ap.add_argument("--quick", action="store_true",
                    help="smollm2, 1 thread, sizes 16,128,512, 1 child, 1 round: a smoke test")  # fmt: skip
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child_main(json.loads(args.child))), flush=True)
        return
    if args.quick:
        args.models, args.threads, args.sizes, args.reps, args.rounds = (
            "smollm2",
            "1",
            "16,128,512",
            1,
            1,
        )

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import median, model_path, print_table, run_info, snapshot_src, write_json

    out = Path(args.out)
    sizes = [int(s) for s in args.sizes.split(",")]
    rng = random.Random(SEED)
    tokens = [rng.randrange(*TOKEN_RANGE) for _ in range(args.prompt)]
    info = run_info()
    trees = {"current": str(snapshot_src(out.with_suffix(".src"))[0])}
    if args.baseline:
        trees = {"baseline": str(baseline_tree(args.baseline, out.with_suffix(".base"))), **trees}
        info["baseline_ref"] = args.baseline
    labels = list(trees)
    samples: list[dict] = []
    for name in args.models.split(","):
        path = str(model_path(name))
        for t in (int(x) for x in args.threads.split(",")):
            for rep in range(args.reps):
                for label in labels if rep % 2 == 0 else labels[::-1]:
                    spec = {"path": path, "threads": t, "tokens": tokens, "sizes": sizes,
                            "rounds": args.rounds, "pin": args.pin,
                            "head_every": args.head_every}  # fmt: skip
                    load = os.getloadavg()[0]
                    t0 = time.perf_counter()
                    res = run_child(spec, trees[label])
                    sample = {"model": name, "threads": t, "tree": label, "rep": rep,
                              "loadavg_1m_before": load, "wall_s": time.perf_counter() - t0, **res}  # fmt: skip
                    samples.append(sample)
                    if "error" in res:
                        print(f"  {name} t={t} {label} rep {rep}: FAILED {res['error']}")
                        print("    " + "\n    ".join(res["stderr_tail"]))
                        continue
                    brief = " ".join(f"{s}:{median(res['tok_cpu_s'][str(s)]):.0f}" for s in sizes)
                    print(f"  {name} t={t} {label:8s} rep {rep} {brief} "
                          f"cpu={res['cpu_share']:.2f} load={load:.1f}", flush=True)  # fmt: skip

    info["loadavg_end"] = list(os.getloadavg())
    header = ["model", "threads", "tree", *(f"n_batch {s}" for s in sizes)]
    summary = []
    for key, what in (("tok_cpu_s", "tokens per CPU second of the child"),
                      ("tok_s", "tokens per wall second")):  # fmt: skip
        rows = []
        for name in args.models.split(","):
            for t in (int(x) for x in args.threads.split(",")):
                for label in labels:
                    mine = [s for s in samples if "error" not in s
                            and (s["model"], s["threads"], s["tree"]) == (name, t, label)]  # fmt: skip
                    if not mine:
                        continue
                    vals = {s: [v for x in mine for v in x[key][str(s)]] for s in sizes}
                    meds = {s: median(v) for s, v in vals.items()}
                    top = meds[max(sizes)]
                    cells = [f"{meds[s]:.0f} ({min(vals[s]):.0f}–{max(vals[s]):.0f}) "
                             f"{meds[s] / top:.2f}×" for s in sizes]  # fmt: skip
                    rows.append([name, str(t), label, *cells])
                    summary.append({"metric": key, "model": name, "threads": t, "tree": label,
                                    "median": {str(s): meds[s] for s in sizes},
                                    "vs_largest": {str(s): meds[s] / top for s in sizes}})  # fmt: skip
        print_table(f"prompt of {args.prompt} tokens, {what}: median (min–max), ratio to "
                    f"n_batch {max(sizes)}; load avg {info['loadavg_start'][0]:.1f} → "
                    f"{info['loadavg_end'][0]:.1f}", header, rows)  # fmt: skip
    write_json(out, {"info": info, "args": vars(args), "summary": summary, "samples": samples})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
