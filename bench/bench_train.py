"""LoRA training: tokens/s with two single-core workers vs one single-core process, and each
worker's peak memory against the model file.

    python bench/bench_train.py [--model smollm2] [--data tests/data/town_train.jsonl]
        [--batch 8] [--epochs 1] [--reps 2] [--out bench/out/train.json]

One: `potluck finetune -t 1` pinned to core 0. Two: two `potluck worker -t 1`, pinned to core 0
and core 1, sharing every batch of one `potluck finetune --mem 0` (the head computes no share: it
sums the gradients and takes the optimizer step, sharing the workers' cores). The same data,
settings and seed, alternating one / two; the time is what `potluck finetune` reports for its steps
(after loading). Tokens are the padded batches' (what the steps compute). Issue 18's target:
≥ 1.7×. Never asserts a time.
"""

from __future__ import annotations

import argparse
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
LINE = re.compile(r"(\d+) steps, (\d+) tokens in ([\d.]+) s")


def _job(cmd: list[str]) -> tuple[float, int, int]:
    """(seconds of the steps, tokens, peak RSS bytes of the process) of one `potluck finetune`."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=ENV)  # fmt: skip
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read() if proc.stderr else ""
    found = LINE.search(err)
    if status != 0 or found is None:
        raise SystemExit(f"potluck finetune failed: {err[-2000:]}")
    return float(found[3]), int(found[2]), usage.ru_maxrss * 1024


def _peak_rss(pid: int) -> int:
    """VmHWM of a running process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=MODEL_NAMES)
    ap.add_argument("--data", type=Path, default=Path("tests/data/town_train.jsonl"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/out/train.json"))
    args = ap.parse_args()
    path = model_path(args.model)
    info = run_info()
    workers = [
        pinned_worker(0, "--model-dir", str(path.parent)),
        pinned_worker(1, "--model-dir", str(path.parent)),
    ]
    one: list[tuple[float, int, int]] = []
    two: list[tuple[float, int, int]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="potluck-train-") as tmp:
            common = ["finetune", "-m", str(path), "--data", str(args.data), "--no-mdns",
                      "--batch", str(args.batch), "--epochs", str(args.epochs), "--seed", "0"]  # fmt: skip
            for rep in range(args.reps):  # one two one two ...
                out = Path(tmp) / f"one-{rep}.gguf"
                one.append(_job(["taskset", "-c", "0", sys.executable, "-m", "potluck.cli",
                                 *common, "-o", str(out), "-t", "1"]))  # fmt: skip
                out = Path(tmp) / f"two-{rep}.gguf"
                peers = [a for _, addr in workers for a in ("--peer", addr)]
                two.append(_job([sys.executable, "-m", "potluck.cli", *common, "-o", str(out),
                                 "--mem", "0", *peers]))  # fmt: skip
        worker_rss = [_peak_rss(p.pid) for p, _ in workers]
    finally:
        for proc, _ in workers:
            proc.kill()
            proc.wait()
    rate_one = median([t / s for s, t, _ in one])
    rate_two = median([t / s for s, t, _ in two])
    assert rate_one is not None and rate_two is not None
    mib = 2**20
    size = path.stat().st_size
    result = {
        "info": info, "model": path.name, "model_bytes": size, "batch": args.batch,
        "epochs": args.epochs, "one": one, "two": two, "tok_s_one": rate_one,
        "tok_s_two": rate_two, "ratio": rate_two / rate_one,
        "peak_rss_one": max(r for _, _, r in one), "peak_rss_workers": worker_rss,
    }  # fmt: skip
    print_table(
        f"training: {path.name}, batch {args.batch} · {info['cpu_model']}",
        ["1 single-core process", "2 single-core workers", "ratio", "peak RSS: one",
         "peak RSS: each worker", "model file"],
        [[f"{rate_one:.0f} tok/s", f"{rate_two:.0f} tok/s", f"{result['ratio']:.2f}×",
          f"{result['peak_rss_one'] / mib:.0f} MiB",
          " / ".join(f"{r / mib:.0f}" for r in worker_rss) + " MiB", f"{size / mib:.0f} MiB"]],
    )  # fmt: skip
    write_json(args.out, result)


if __name__ == "__main__":
    main()
