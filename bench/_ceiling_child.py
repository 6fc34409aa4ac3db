"""One side of bench_ceiling.py, run in its own process (pinned by the caller).

    python bench/_ceiling_child.py MODEL ROLE TASK START STOP N [READ_FD WRITE_FD]

ROLE: single (layers [START, STOP) = the whole model, no partner) | first | last (the two stages of
a pool that sends nothing: each side signals the other with one byte on a pipe where the pool
would send hidden states or token ids, and polls the pipe before it blocks as a worker polls its
data connections: `SPIN_MS`, default 20 as `--spin-ms`, 0 = block at once). TASK: decode | streams | pp, scheduled as bench_pool.py's
pool does them. The first stage (and `single`) times the run and prints one JSON line.

Each stage is the engine's own `Stage` (the same object a worker computes with); the last one
samples (greedy) as a worker does. Stages do not see each other's outputs: the first stage embeds a
fixed token id and the last takes fixed hidden states, which costs the same as real ones.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np

from potluck.model.archs import hparams_from_metadata
from potluck.model.stage import Compute, SeqChunk, Stage
from potluck.modelfile.gguf_file import GGUFFile
from potluck.sampling import GREEDY, Sampler
from potluck.transport.spin import spin_readable

N_STREAMS = 4
PROMPT_WARMUP = 8  # tokens per sequence before timing (as bench_pool's prefill)
SPIN_S = float(os.environ.get("SPIN_MS", "20")) / 1000  # a worker's default --spin-ms


class Side:
    """A stage plus what a worker does after it (sampling on the last stage)."""

    def __init__(self, path: str, start: int, stop: int, n_ctx: int) -> None:
        f = GGUFFile(path)
        self.hp = hparams_from_metadata(f.metadata)
        self.stage = Stage(self.hp, f, start, stop, n_ctx, compute=Compute(threads=1))
        self.sampler = Sampler(GREEDY)
        self.rng = np.random.default_rng(0)

    def input(self, rows: int) -> np.ndarray:
        """Token ids [rows] (int64) for the first stage, else hidden states [rows, n_embd] (f32)."""
        if self.stage.is_first:
            return np.full(rows, 42, np.int64)
        return self.rng.standard_normal((rows, self.hp.n_embd), dtype=np.float32)

    def run(self, chunks: list[SeqChunk], sample: bool) -> None:
        x = self.input(sum(c.n for c in chunks))
        if not self.stage.is_last:
            self.stage(x, chunks)
            return
        if not sample:  # an early prompt micro-batch: the output head is skipped
            self.stage(x, chunks, np.empty(0, np.int64))
            return
        for row in self.stage(x, chunks):
            self.sampler.sample(row, [])


def main() -> None:
    path, role, task = sys.argv[1], sys.argv[2], sys.argv[3]
    start, stop, n = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    rfd, wfd = (int(sys.argv[7]), int(sys.argv[8])) if role != "single" else (-1, -1)
    n_seqs = N_STREAMS if task == "streams" else 1
    side = Side(path, start, stop, max(1024, n + 2 * PROMPT_WARMUP + 64))
    seqs = list(range(1, n_seqs + 1))
    for s in seqs:
        side.run([SeqChunk(s, PROMPT_WARMUP)], True)
    ubatch = int(os.environ.get("POOL_UBATCH", "128"))

    def signal() -> None:
        os.write(wfd, b"x")

    def wait() -> None:
        spin_readable(rfd, SPIN_S)  # as a worker polls its data connections (transport/spin.py)
        if os.read(rfd, 1) != b"x":
            raise SystemExit("the other stage went away")

    # the schedule: a list of (chunks, sample) batches, and for the pool how many are kept in
    # flight (the first stage waits for batch i - depth to come back before starting batch i)
    if task == "decode":
        batches, depth = [([SeqChunk(1, 1)], True)] * n, 1
    elif task == "streams":
        groups = [seqs] if role == "single" else [seqs[0::2], seqs[1::2]]
        batches = [([SeqChunk(s, 1) for s in g], True) for _ in range(n) for g in groups]
        depth = len(groups)
    elif task == "pp":
        step = n if role == "single" else ubatch
        sizes = [min(step, n - i) for i in range(0, n, step)]
        batches = [([SeqChunk(1, k)], i == len(sizes) - 1) for i, k in enumerate(sizes)]
        depth = len(batches)  # every micro-batch is submitted at once
    else:
        raise SystemExit(f"unknown task {task!r}")

    busy: list[float] = []  # compute ms of each batch on this side

    def compute(chunks: list[SeqChunk], sample: bool) -> None:
        t = time.perf_counter()
        side.run(chunks, sample)
        busy.append((time.perf_counter() - t) * 1e3)

    if role == "last":
        signal()  # loaded and warm
        for chunks, sample in batches:
            wait()
            compute(chunks, sample)
            signal()
        print(json.dumps({"batch_ms": statistics.median(busy)}), flush=True)
        return
    if role == "first":
        wait()  # the last stage is loaded and warm
    t0 = time.perf_counter()
    back = 0  # batches whose reply came back
    for i, (chunks, sample) in enumerate(batches):
        if role == "first":
            while i - back >= depth:
                wait()
                back += 1
        compute(chunks, sample)
        if role == "first":
            signal()
    if role == "first":
        while back < len(batches):
            wait()
            back += 1
    dt = time.perf_counter() - t0
    rows = sum(sum(c.n for c in chunks) for chunks, _ in batches)
    print(json.dumps({"tok_s": rows / dt, "batch_ms": statistics.median(busy)}), flush=True)


if __name__ == "__main__":
    main()
