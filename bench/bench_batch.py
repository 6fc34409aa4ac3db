"""Batch jobs: items per hour with two single-core replicas vs one single-core process.

    python bench/bench_batch.py [--model smollm2] [--items 48] [--tokens 32] [-np 2] [--reps 2]
        [--out bench/out/batch.json]

One: `potluck batch -t 1` pinned to core 0 (the whole model in its process). Two: two `potluck
worker -t 1`, pinned to core 0 and core 1, as replicas of one `potluck batch --mem 0` (the head
holds no layers; it tokenizes and runs the API handlers, sharing the workers' cores). The same
input, greedy, alternating one / two; the job's time is what `potluck batch` reports for its
requests (after loading). Issue 16's target: ≥ 1.8×. Never asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    MODEL_NAMES,
    median,
    model_path,
    pinned_worker,
    print_table,
    run_info,
    write_json,
)

ENV = {**os.environ, "POTLUCK_MDNS": "0"}


def _input(path: Path, model_id: str, items: int, tokens: int) -> None:
    with open(path, "w") as f:
        for i in range(items):
            body = {
                "model": model_id, "max_tokens": tokens, "temperature": 0,
                "messages": [{"role": "user", "content": f"Write a short note about the number {i}."}],
            }  # fmt: skip
            line = {"custom_id": f"item-{i}", "method": "POST", "url": "/v1/chat/completions"}
            f.write(json.dumps({**line, "body": body}) + "\n")


def _job(cmd: list[str]) -> tuple[float, int]:
    """(seconds of the job's requests, tokens) from `potluck batch`'s last line."""
    done = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=3600)
    found = re.search(r"(\d+) requests done, (\d+) failed, (\d+) tokens in ([\d.]+) s", done.stderr)
    if done.returncode != 0 or found is None or found[2] != "0":
        raise SystemExit(f"potluck batch failed: {done.stderr[-2000:]}")
    return float(found[4]), int(found[3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=MODEL_NAMES)
    ap.add_argument("--items", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("-np", dest="parallel", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/out/batch.json"))
    args = ap.parse_args()
    path = model_path(args.model)
    info = run_info()
    model_id = path.name.removesuffix(".gguf")
    workers = [pinned_worker(0), pinned_worker(1)]
    one_s: list[float] = []
    two_s: list[float] = []
    try:
        with tempfile.TemporaryDirectory(prefix="potluck-batch-") as tmp:
            inp = Path(tmp) / "in.jsonl"
            _input(inp, model_id, args.items, args.tokens)
            common = ["batch", str(inp), "-m", str(path), "--no-mdns", "-np", str(args.parallel)]
            for rep in range(args.reps):  # one two one two ...
                out = Path(tmp) / f"one-{rep}.jsonl"
                one_s.append(_job(["taskset", "-c", "0", sys.executable, "-m", "potluck.cli",
                                   *common, "-o", str(out), "-t", "1"])[0])  # fmt: skip
                out = Path(tmp) / f"two-{rep}.jsonl"
                peers = [a for _, addr in workers for a in ("--peer", addr)]
                two_s.append(_job([sys.executable, "-m", "potluck.cli", *common, "-o", str(out),
                                   "--mem", "0", *peers])[0])  # fmt: skip
    finally:
        for proc, _ in workers:
            proc.kill()
            proc.wait()
    one, two = median(one_s), median(two_s)
    per_hour = [args.items / one * 3600, args.items / two * 3600]
    result = {
        "info": info, "model": path.name, "items": args.items, "tokens": args.tokens,
        "parallel": args.parallel, "one_s": one_s, "two_s": two_s,
        "items_per_hour_one": per_hour[0], "items_per_hour_two": per_hour[1],
        "ratio": per_hour[1] / per_hour[0],
    }  # fmt: skip
    print_table(
        f"batch: {args.items} items × {args.tokens} tokens, -np {args.parallel} · {info['cpu_model']}",
        ["model", "1 single-core process", "2 single-core replicas", "ratio"],
        [[path.name, f"{per_hour[0]:.0f} items/h ({one:.0f} s)",
          f"{per_hour[1]:.0f} items/h ({two:.0f} s)", f"{result['ratio']:.2f}×"]],
    )  # fmt: skip
    write_json(args.out, result)


if __name__ == "__main__":
    main()
