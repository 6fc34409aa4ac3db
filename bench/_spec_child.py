"""One model in one setting for bench_spec.py, in its own process: every variant × prompt × rep.

    python bench/_spec_child.py JOB_JSON

JOB_JSON (written by bench_spec.py): {"model": path, "setting": "local"|"pool", "threads": T,
"assignments": [[addr, first, end], ...] (pool: the head holds no layers), "draft": path|null,
"draft_threads": T, "n_ctx": N, "tokens": N, "reps": R, "prompts": [user message, ...],
"variants": [{"name", "kind", "n_max"}, ...]}.

Loads the model once (and the draft model once, on this process, for draft-simple), warms every
variant up on the first prompt, then for each rep runs the variants in turn, forward on even reps
and backward on odd ones (A B C, C B A, ...), each over every prompt. One run = a fresh
`Scheduler(model, SchedulerConfig(max_active=1, max_queue=0, spec=...), drafter, inline=True)`
(what `generate()` and `potluck run` build) and one `run_one(Request(...))`, greedy, stopping at
the model's end-of-generation ids. Decode time is taken here, from the first token's event to
the last's (the first token is the prompt's); the scheduler's `stats` give the decode steps, the
steps that carried drafts, the ids drafted and those kept. Prints one JSON line: every run.
"""

from __future__ import annotations

import json
import sys
import time

from potluck.engine.contract import Assignment
from potluck.engine.scheduler import Finished, Request, Scheduler, SchedulerConfig, TokenEvent
from potluck.engine.spec import ModelDrafter, NgramDrafter, SpecConfig, check_draft_vocab
from potluck.model.stage import Compute
from potluck.pool.build import load_model
from potluck.sampling import GREEDY

WARMUP_TOKENS = 16


def main() -> None:
    job = json.loads(sys.argv[1])
    t0 = time.perf_counter()
    if job["setting"] == "pool":
        plan = [Assignment(a, first, end) for a, first, end in job["assignments"]]
        m = load_model(job["model"], n_ctx=job["n_ctx"], assignments=plan,
                       compute=Compute(threads=job["threads"]))  # fmt: skip
    else:
        m = load_model(job["model"], n_ctx=job["n_ctx"], compute=Compute(threads=job["threads"]))
    load_s = time.perf_counter() - t0
    draft = None
    if any(v["kind"] == "draft-simple" for v in job["variants"]):
        # as the CLI's -md: loaded on this machine, the model's context, checked for its vocabulary
        draft = load_model(
            job["draft"], n_ctx=m.n_ctx, compute=Compute(threads=job["draft_threads"])
        )
        check_draft_vocab(m, draft)
    stop = frozenset(m.tokenizer.eot_ids)
    prompts = [
        m.tokenizer.encode(m.chat.render([{"role": "user", "content": p}])) for p in job["prompts"]
    ]

    def one(v: dict, ids: list[int], n: int) -> dict:
        spec = SpecConfig(v["kind"], n_max=v["n_max"])
        drafter = None
        if v["kind"] == "ngram-simple":
            drafter = NgramDrafter()
        elif v["kind"] == "draft-simple":
            assert draft is not None
            drafter = ModelDrafter(draft)
        config = SchedulerConfig(max_active=1, max_queue=0, spec=spec)  # as generate()
        sched = Scheduler(m, config, drafter, inline=True)
        out: list[int] = []
        times: list[float] = []
        reason = None
        t_start = time.perf_counter()
        try:
            for ev in sched.run_one(Request(tuple(ids), GREEDY, n, stop)):
                if isinstance(ev, TokenEvent):
                    times.append(time.perf_counter())
                    out.append(ev.token)
                elif isinstance(ev, Finished):
                    reason = ev.reason
        finally:
            sched.close()
        st = sched.stats
        decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
        return {
            "ids": out,
            "n_generated": len(out),
            "finish": reason,
            "prompt_tokens": len(ids),
            "prompt_s": times[0] - t_start if times else None,
            "decode_s": decode_s,
            "tok_s": (len(out) - 1) / decode_s if decode_s > 0 else None,
            "decode_steps": st.decode_steps,
            "draft_steps": st.draft_steps,
            "drafted": st.drafted,
            "draft_kept": st.draft_kept,
            "follow_ups": st.follow_ups,
        }

    for v in job["variants"]:  # warm-up: caches, connections, graphs of drafted widths
        one(v, prompts[0], WARMUP_TOKENS)
    runs = []
    for rep in range(job["reps"]):
        order = job["variants"] if rep % 2 == 0 else job["variants"][::-1]
        for v in order:
            for i, ids in enumerate(prompts):
                r = one(v, ids, job["tokens"])
                runs.append({"variant": v["name"], "rep": rep, "prompt": i, **r})
                print(f"  {v['name']:>14} rep {rep} prompt {i}: {r['n_generated']} tokens, "
                      f"{r['tok_s'] or 0:.1f} tok/s, kept {r['draft_kept']}/{r['drafted']}",
                      file=sys.stderr, flush=True)  # fmt: skip
    print(json.dumps({"load_s": load_s, "n_layer": m.hp.n_layer, "runs": runs}), flush=True)


if __name__ == "__main__":
    main()
    # Workaround (as _pool_child.py, cli.main): gRPC's C++ core sometimes aborts in its static
    # destructors when the interpreter finalizes with its channels' threads alive; skip it.
    from potluck.pool.failover import _close_live

    _close_live()
    sys.stderr.flush()
    import os

    os._exit(0)
