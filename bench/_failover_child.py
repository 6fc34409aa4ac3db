"""The head for bench_failover.py: generate greedily over the given peers, print each token's time
as it comes ("tok I T"), then one JSON line with the failover events.

    python bench/_failover_child.py MODEL N_TOKENS TIMEOUT_S PEER [PEER ...]
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict

from potluck.engine.generate import generate
from potluck.pool.build import load_model
from potluck.sampling import GREEDY, Sampler


def main() -> None:
    path, n, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    peers = sys.argv[4:]
    m = load_model(path, n_ctx=1024, peers=peers, tensor_split=[1.0] * (len(peers) + 1),
                   failover_s=timeout)  # fmt: skip
    ids = m.tokenizer.encode(m.chat.render([{"role": "user", "content": "Tell me a long story."}]))
    print("ready", flush=True)
    toks = []
    for i, tok in enumerate(generate(m, ids, n, Sampler(GREEDY), stop_ids=frozenset())):
        toks.append(tok)
        print(f"tok {i} {time.monotonic():.6f}", flush=True)
    events = [asdict(e) for e in m.pipeline.events]
    print(json.dumps({"tokens": toks, "events": events}), flush=True)


if __name__ == "__main__":
    main()
