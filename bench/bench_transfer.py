"""Weights over the wire: how fast a worker without the model file receives its layers.

    python bench/bench_transfer.py [--model qwen7b] [--rate 1gbit] [--from head|peer]
        [--head-rate 100mbit] [--out bench/out/transfer.json]

Network namespaces on one switch, each host's link capped with tc tbf (needs root).
--from head: a worker with an empty cache, the head running `potluck run -n 1 --mem 0` (every
layer on the worker, so it receives every tensor of the model from the head over `--rate`).
--from peer: the head on a slower link (`--head-rate`, a laptop on Wi-Fi), a worker that has the
file and a worker with an empty cache (both on `--rate`), the model split between the two
(`--tensor-split 0,1,1`): the bare worker receives its half from its peer, not from the head.
Reported: the bytes the bare worker says it received, from whom, its seconds and MB/s, against
its link's rate (issue 15's target: ≥ 80 % of the link). The worker's cache is a temporary
folder, removed at the end. Never asserts a time.
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
    ap.add_argument("--from", dest="source", default="head", choices=("head", "peer"))
    ap.add_argument("--head-rate", default="100mbit", help="--from peer: the head's link")
    args = ap.parse_args()
    from netns import netns_lan

    path = model_path(args.model)
    info = run_info()
    env = {**os.environ, "POTLUCK_SECRET": SECRET, "POTLUCK_MDNS": "0"}
    peer = args.source == "peer"
    with tempfile.TemporaryDirectory(prefix="potluck-transfer-") as tmp:
        bare = {**env, "POTLUCK_CACHE": tmp, "HOME": tmp}
        log = Path(tmp) / "worker.log"
        rates = [args.head_rate, args.rate, args.rate] if peer else [args.rate, args.rate]
        with netns_lan(len(rates), rates=rates) as hosts:
            head, workers = hosts[0], hosts[1:]
            if peer:  # the worker that has the file
                _worker(workers[0], env, Path(tmp) / "source.log", "--model-dir", str(path.parent))
            _worker(workers[-1], bare, log)
            split = ["--tensor-split", "0,1,1"] if peer else []
            peers = [a for w in workers for a in ("--peer", f"{w.ip}:50052")]
            t0 = time.perf_counter()
            done = head.run(
                [sys.executable, "-m", "potluck.cli", "run", "-m", str(path), "--no-mdns",
                 "--mem", "0", *peers, *split, "-n", "1", "--temp", "0", "-c", "256", "hi"],
                env=env, timeout=3600, check=False,
            )  # fmt: skip
            wall = time.perf_counter() - t0
        said = log.read_text()
    if done.returncode != 0:
        raise SystemExit(f"potluck run failed: {done.stderr.strip().splitlines()[-1:]}")
    found = re.search(
        r"from (the head|peer \S+): received (\d+) tensors, ([\d.]+) MiB in ([\d.]+) s, (\d+) MB/s",
        said,
    )
    if found is None:
        raise SystemExit(f"no transfer in the worker's log:\n{said}")
    whence, n, mib, secs = found[1], int(found[2]), float(found[3]), float(found[4])
    mbs = float(found[5])
    from netns import rate_bits_per_s

    link = rate_bits_per_s(args.rate) / 8
    result = {
        "model": path.name,
        "from": whence,
        "head_rate": args.head_rate if peer else args.rate,
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
        ["model", "from", "tensors", "MiB", "s", "MB/s", "link MB/s", "of the link"],
        [[path.name, whence, str(n), f"{mib:.0f}", f"{secs:.1f}", f"{result['mb_per_s']:.0f}",
          f"{link / 1e6:.0f}", f"{result['share_of_link']:.0%}"]],
    )  # fmt: skip
    print(f"(worker's own figure: {mbs:.0f} MB/s; whole `potluck run`: {wall:.0f} s)")
    write_json(args.out, {"info": info, **result})


def _worker(host, env: dict[str, str], log: Path, *args: str) -> None:
    """A `potluck worker` in `host`'s namespace (port 50052), once it listens."""
    with open(log, "w") as out:
        host.popen(
            [sys.executable, "-m", "potluck.cli", "worker", "-H", host.ip, "-t", "1",
             "--no-mdns", *args],
            env=env, stdout=subprocess.DEVNULL, stderr=out,
        )  # fmt: skip
    deadline = time.monotonic() + 60
    while "listening on" not in log.read_text():
        if time.monotonic() > deadline:
            raise SystemExit(f"worker did not start: {log.read_text()}")
        time.sleep(0.2)


if __name__ == "__main__":
    main()
