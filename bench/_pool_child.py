"""One measurement for bench_pool.py, run in its own process (pinned by the caller).

    python bench/_pool_child.py MODEL_PATH MODE TASK N [PEER ...]

MODE: single (whole model in this process) | pool (all layers on the PEERs, split as the
planner does for equal nodes: even prompt work for pp, even decode time otherwise; this process
only sends token ids). TASK: decode (one stream, N tokens) | pp (a prompt of N tokens;
the pool cuts it as `potluck run` does, prompt_ubatch: ≥ 4 micro-batches of 32–128 tokens, so
that both stages work at once; $POOL_UBATCH fixes the size) | streams (4 streams,
N tokens each; over the pool two groups of two are kept in flight). Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np

from potluck.engine.contract import Assignment
from potluck.engine.generate import POOL_N_BATCH, generate, prefill, prompt_ubatch
from potluck.model.archs import hparams_from_metadata
from potluck.model.stage import Compute, SeqChunk
from potluck.modelfile.gguf_file import GGUFFile
from potluck.pool.build import load_model
from potluck.sampling import GREEDY, Sampler

N_STREAMS = 4
# a fixed micro-batch (bench_ubatch's sweep); by default the one `potluck run` picks (prompt_ubatch)
POOL_UBATCH = int(os.environ["POOL_UBATCH"]) if "POOL_UBATCH" in os.environ else None


def balanced_cuts(path: str, n_nodes: int, balance: str) -> list[int]:
    """Layer boundaries that even out equal-speed nodes by the planner's own cost model: for
    "decode", time per decoded token (bytes read at the probed speed plus a fixed cost per layer;
    the last stage also reads the output head); for "prompt", the layers' prompt work. Minimizes
    the slowest stage, as the planner does between splits of equal one-stream time."""
    from functools import cache

    from potluck.planner import footprint_from_gguf, held_bytes
    from potluck.planner.cost import CostModel
    from potluck.planner.nodes import NodeInfo

    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata)
    fp = footprint_from_gguf(f.tensors, hp, 1024, held=held_bytes)
    nodes = [NodeInfo(f"n{i}", "cpu", 1 << 40, 1, 29e9) for i in range(n_nodes)]
    costs = CostModel(fp, nodes, {}, balance)
    n_layer = hp.n_layer

    @cache
    def best(k: int, start: int) -> tuple[int, tuple[int, ...]]:
        """(slowest stage ns, cuts) for nodes k.. over layers [start, n_layer)."""
        if k == n_nodes - 1:
            return costs.stage(k, start, n_layer).balance_ns, ()
        options = []
        for stop in range(start + 1, n_layer - (n_nodes - 1 - k) + 1):
            rest, cuts = best(k + 1, stop)
            options.append((max(costs.stage(k, start, stop).balance_ns, rest), (stop, *cuts)))
        return min(options)

    return [0, *best(0, 0)[1], n_layer]


class Timings:
    """Each step's per-stage compute and per-hop ms as the pool reports them (the batch that
    finished last), for medians over the run."""

    def __init__(self, on: bool) -> None:
        self.on, self.stage, self.hop = on, [], []

    def append(self, pipe) -> None:
        if self.on:
            self.stage.append(list(pipe.last_stage_ms))
            self.hop.append(list(pipe.last_hop_ms))

    def medians(self, pipe) -> dict:
        """Medians per stage and per hop (a prompt: its last micro-batch only)."""
        stage = self.stage or [list(pipe.last_stage_ms)]
        hop = self.hop or [list(pipe.last_hop_ms)]
        return {
            "stage_ms": [statistics.median(x[i] for x in stage) for i in range(len(stage[0]))],
            "hop_ms": [statistics.median(x[i] for x in hop) for i in range(len(hop[0]))],
        }


def main() -> None:
    path, mode, task, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    peers = sys.argv[5:]
    one = Compute(threads=1)
    n_ctx = max(512, n + 64)
    if mode == "single":
        m = load_model(path, n_ctx=n_ctx, compute=one)
    else:
        if os.environ.get("POOL_SPLIT") == "layers":  # equal layer counts: balanced for prompts
            n_layer = hparams_from_metadata(GGUFFile(path).metadata).n_layer
            cut = [round(n_layer * i / len(peers)) for i in range(len(peers) + 1)]
        else:  # prompts: even prompt work (what `potluck run` plans); else even decode time
            cut = balanced_cuts(path, len(peers), "prompt" if task == "pp" else "decode")
        m = load_model(
            path,
            n_ctx=n_ctx,
            assignments=[Assignment(p, a, b) for p, a, b in zip(peers, cut, cut[1:], strict=False)],
            compute=one,
        )
    pipe = m.pipeline
    if os.environ.get("POOL_AHEAD") == "0":  # bench_latency's "head in the loop": no step is
        # sent before the token it follows is back here (as the pool did before follow-ups)
        type(pipe).chains = property(lambda self: False)
    timings = Timings(mode == "pool")
    text = "The history of the printing press begins in the fifteenth century, when " * 64
    if task == "pp":
        ids = m.tokenizer.encode(text)[:n]
        seq = m.new_seq_id()
        ubatch = n
        if mode == "pool":
            ubatch = POOL_UBATCH or prompt_ubatch(n, POOL_N_BATCH, pipe.depth)
        prefill(pipe, seq, ids[:8], Sampler(GREEDY))  # warm-up of every stage
        pipe.drop(seq)
        seq = m.new_seq_id()
        t0 = time.perf_counter()
        prefill(pipe, seq, ids, Sampler(GREEDY), n_batch=ubatch)
        dt = time.perf_counter() - t0
        pipe.drop(seq)
        out = {"tok_s": n / dt, "ubatch": ubatch}
    elif task == "decode":
        # what `potluck run` does: generate() (over a pool whose first stage is a node, each
        # step is sent before the token it follows is back here)
        ids = m.tokenizer.encode("The history of the printing press")
        for _ in generate(m, ids, 9, Sampler(GREEDY), stop_ids=frozenset()):
            pass  # warm-up (both modes): a first generation also pays for caches and connections
        tokens = generate(m, ids, n + 1, Sampler(GREEDY), stop_ids=frozenset())
        next(tokens)  # the prompt's
        t0 = time.perf_counter()
        for _ in tokens:
            timings.append(pipe)
        dt = time.perf_counter() - t0
        out = {"tok_s": n / dt}
    else:  # streams
        seqs = [m.new_seq_id() for _ in range(N_STREAMS)]
        samplers = {s: Sampler(GREEDY) for s in seqs}
        last = {}
        for i, s in enumerate(seqs):
            last[s] = prefill(
                pipe, s, m.tokenizer.encode(f"Story number {i}: once upon a time"), samplers[s]
            )
        depth = pipe.depth if mode == "pool" else 1
        groups = [seqs[i::depth] for i in range(depth)]

        def launch(g: list[int]):
            toks = np.array([last[s] for s in g], np.int64)
            return pipe.submit(toks, [SeqChunk(s, 1) for s in g], samplers, {})

        t0 = time.perf_counter()
        flying = [launch(g) for g in groups]
        for step in range(n):
            for i, g in enumerate(groups):
                for s, t in zip(g, flying[i].result(), strict=True):
                    last[s] = t
                timings.append(pipe)
                if step + 1 < n:
                    flying[i] = launch(g)
        dt = time.perf_counter() - t0
        for s in seqs:
            pipe.drop(s)
        out = {"tok_s": N_STREAMS * n / dt, "groups": depth}
    if mode == "pool":
        out |= timings.medians(pipe)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
    # Workaround (as cli.main): gRPC's C++ core sometimes aborts in its static destructors when
    # the interpreter finalizes with its channels' threads alive ("terminate called without an
    # active exception", exit 134) after the result is printed; skip finalization.
    from potluck.pool.failover import _close_live

    _close_live()  # free this head's stages on the workers (os._exit skips atexit), as cli.main
    sys.stderr.flush()
    os._exit(0)
