"""Weights over the wire: how fast a worker without the model file receives its layers.

    python bench/bench_transfer.py [--model qwen7b] [--rate 1gbit] [--out bench/out/transfer.json]

Two network namespaces on one link capped with tc tbf at `--rate` (needs root): a worker with an
empty cache in one, the head in the other running `potluck run -n 1 --mem 0` (every layer on the
worker, so it receives every tensor of the model). Reported: the bytes the worker says it
received, its seconds and MB/s, against the link's rate (issue 15's target: ≥ 80 % of the link).
The worker's cache is a temporary folder, removed at the end. Never asserts a time.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _common import MODEL_NAMES, model_path, print_table, run_info, write_json  # noqa: E402

SECRET = "bench-transfer-pool-secret-0123456789"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen7b", choices=MODEL_NAMES)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--out", type=Path, default=Path("bench/out/transfer.json"))
    args = ap.parse_args()
    from netns import netns_lan, rate_bits_per_s

    path = model_path(args.model)
    info = run_info()
    env = {**os.environ, "POTLUCK_SECRET": SECRET, "POTLUCK_MDNS": "0"}
    with tempfile.TemporaryDirectory(prefix="potluck-transfer-") as tmp:
        bare = {**env, "POTLUCK_CACHE": tmp, "HOME": tmp}
        log = Path(tmp) / "worker.log"
        with netns_lan(2, rate=args.rate) as (head, host):
            with open(log, "w") as out:
                host.popen(
                    [sys.executable, "-m", "potluck.cli", "worker", "-H", host.ip, "-t", "1",
                     "--no-mdns"],
                    env=bare, stdout=subprocess.DEVNULL, stderr=out,
                )  # fmt: skip
            deadline = time.monotonic() + 60
            while "listening on" not in log.read_text():
                if time.monotonic() > deadline:
                    raise SystemExit(f"worker did not start: {log.read_text()}")
                time.sleep(0.2)
            t0 = time.perf_counter()
            done = head.run(
                [sys.executable, "-m", "potluck.cli", "run", "-m", str(path), "--no-mdns",
                 "--mem", "0", "--peer", f"{host.ip}:50052", "-n", "1", "--temp", "0", "-c",
                 "256", "hi"],
                env=env, timeout=3600, check=False,
            )  # fmt: skip
            wall = time.perf_counter() - t0
        said = log.read_text()
    if done.returncode != 0:
        raise SystemExit(f"potluck run failed: {done.stderr.strip().splitlines()[-1:]}")
    found = re.search(
        r"received (\d+) tensors, ([\d.]+) MiB in ([\d.]+) s, (\d+) MB/s \(checked, cached\)", said
    )
    if found is None:
        raise SystemExit(f"no transfer in the worker's log:\n{said}")
    n, mib, secs, mbs = int(found[1]), float(found[2]), float(found[3]), float(found[4])
    link = rate_bits_per_s(args.rate) / 8
    result = {
        "model": path.name,
        "rate": args.rate,
        "tensors": n,
        "mib": mib,
        "seconds": secs,
        "mb_per_s": mib * 2**20 / secs / 1e6,
        "link_mb_per_s": link / 1e6,
        "share_of_link": mib * 2**20 / secs / link,
        "run_wall_s": wall,
    }
    print_table(
        f"weights to a bare worker over a {args.rate} link · {info['cpu_model']}",
        ["model", "tensors", "MiB", "s", "MB/s", "link MB/s", "of the link"],
        [[path.name, str(n), f"{mib:.0f}", f"{secs:.1f}", f"{result['mb_per_s']:.0f}",
          f"{link / 1e6:.0f}", f"{result['share_of_link']:.0%}"]],
    )  # fmt: skip
    print(f"(worker's own figure: {mbs:.0f} MB/s; whole `potluck run`: {wall:.0f} s)")
    write_json(args.out, {"info": info, **result})


if __name__ == "__main__":
    main()
