"""`potluck bench`: measure the model on one machine and on the pool, side by side, and say from
the measurements (not the planner's predictions) whether pooling is worth it."""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any

from potluck.engine.generate import Model, prefill
from potluck.engine.requests import Request, SchedulerConfig, TokenEvent
from potluck.engine.scheduler import Scheduler
from potluck.engine.spec import NO_SPEC, Drafter, SpecConfig
from potluck.planner import Plan
from potluck.sampling import GREEDY, Sampler

WORTH_IT = 1.2  # pooling must beat the best single machine by 20 % (as the planner's verdict)
BENCH_TEXT = "The history of the printing press begins in the fifteenth century, when "


@dataclass(frozen=True)
class Measured:
    """One configuration's speed: decode of one stream and prompt processing, with the compute of
    each stage and the time on each link, per decoded token (medians over the steps)."""

    label: str
    decode_tokens_per_s: float
    prompt_tokens_per_s: float
    stage_ms: tuple[float, ...]  # compute per stage, in pipeline order
    hop_ms: tuple[float, ...]  # head → first node, then node → node (network + serialization)
    drafted: int = 0  # speculative decoding: ids drafted while decoding, and those kept
    kept: int = 0

    @property
    def ms_per_token(self) -> float:
        return 1e3 / self.decode_tokens_per_s


def measure(
    model: Model,
    label: str,
    n_tokens: int = 32,
    n_prompt: int = 128,
    n_batch: int = 512,
    spec: SpecConfig = NO_SPEC,
    drafter: Drafter | None = None,
) -> Measured:
    """Process an n_prompt-token prompt, then decode n_tokens greedily (with drafts as `spec`
    says); time both."""
    if n_tokens < 1 or n_prompt < 1:
        raise ValueError(f"need at least one token to time, got -n {n_tokens}, -p {n_prompt}")
    if n_prompt + n_tokens + 1 > model.n_ctx:
        raise ValueError(
            f"the bench needs {n_prompt + n_tokens + 1} positions but the context is "
            f"{model.n_ctx}; lower -p/-n or raise -c"
        )
    ids = model.tokenizer.encode(BENCH_TEXT * (n_prompt // 8 + 1))[:n_prompt]
    pipe = model.pipeline
    warm = model.new_seq_id()  # first calls pay for lazy setup on every node
    prefill(pipe, warm, ids[:4], Sampler(GREEDY))
    pipe.drop(warm)
    # as `potluck run` generates: the prompt's token first, then n_tokens tokens (no stop id)
    config = SchedulerConfig(n_batch=n_batch, max_active=1, spec=spec)
    sched = Scheduler(model, config, drafter, inline=True)
    req = Request(tuple(ids), GREEDY, n_tokens + 1, frozenset())
    t0 = time.perf_counter()
    tokens = (ev for ev in sched.run_one(req) if isinstance(ev, TokenEvent))
    try:
        next(tokens)
        prompt_s = time.perf_counter() - t0
        stages: list[list[float]] = []
        hops: list[list[float]] = []
        t0 = t1 = time.perf_counter()
        for _ in tokens:
            stage_ms = list(pipe.last_stage_ms)
            stages.append(stage_ms or [(time.perf_counter() - t1) * 1e3])
            hops.append(list(pipe.last_hop_ms))
            t1 = time.perf_counter()
        decode_s = time.perf_counter() - t0
    finally:
        tokens.close()
        sched.close()
    return Measured(
        label=label,
        decode_tokens_per_s=n_tokens / decode_s,
        prompt_tokens_per_s=len(ids) / prompt_s,
        stage_ms=tuple(statistics.median(col) for col in zip(*stages, strict=True)),
        hop_ms=tuple(statistics.median(col) for col in zip(*hops, strict=True)) if hops[0] else (),
        drafted=sched.stats.drafted,
        kept=sched.stats.draft_kept,
    )


def worth_it(single: Measured, pool: Measured) -> bool:
    """Whether the pool decodes WORTH_IT times faster than the single machine, measured."""
    return pool.decode_tokens_per_s >= WORTH_IT * single.decode_tokens_per_s


def measured_verdict(single: Measured, pool: Measured, stage_names: list[str]) -> str:
    """One line: is the pool worth it by the measurements, and if not, why."""
    ratio = pool.decode_tokens_per_s / single.decode_tokens_per_s
    head = (
        f"measured: pool {pool.decode_tokens_per_s:.1f} tok/s vs {single.label} alone "
        f"{single.decode_tokens_per_s:.1f} tok/s ({ratio:.2f}×)"
    )
    if worth_it(single, pool):
        return f"{head}: pooling is worth it"
    net, compute = sum(pool.hop_ms), sum(pool.stage_ms)
    slowest = max(range(len(pool.stage_ms)), key=lambda i: pool.stage_ms[i])
    if net > 0.25 * pool.ms_per_token:
        why = (
            f"the network: {net:.1f} of every {pool.ms_per_token:.1f} ms per token are spent "
            "on the links (a wired connection helps most)"
        )
    elif pool.stage_ms[slowest] > 0.6 * single.ms_per_token and len(pool.stage_ms) > 1:
        name = stage_names[slowest] if slowest < len(stage_names) else f"stage {slowest}"
        why = (
            f"the slowest stage: {name} needs {pool.stage_ms[slowest]:.1f} ms per token for its "
            f"share, against {single.ms_per_token:.1f} ms for the whole model on {single.label}"
        )
    else:
        why = (
            f"a pipeline runs its stages one after another for one stream ({compute:.1f} ms of "
            f"compute + {net:.1f} ms of links per token); pooling pays off for models that do not "
            "fit one machine, or for several streams at once"
        )
    return f"{head}: below the {WORTH_IT:.1f}× that makes pooling worth it; use {single.label} alone — {why}"


def bench_report(
    plan: Plan, runs: list[Measured], model: str, n_prompt: int, n_tokens: int
) -> dict[str, Any]:
    """`potluck bench --json`: the planner's prediction beside the measurements (bench/ reads
    it to compare the two)."""
    best = plan.best_single
    single = next((r for r in runs if r.label != "pool"), None)
    pool = next((r for r in runs if r.label == "pool"), None)
    measured_worth_it = None if single is None or pool is None else worth_it(single, pool)
    return {
        "model": model,
        "n_prompt": n_prompt,
        "n_predict": n_tokens,
        "predicted": {
            "pool_tokens_per_s": plan.tokens_per_s,
            "pool_ms_per_token": plan.ms_per_token,
            "stages": [
                {
                    "node": st.node,
                    "start": st.start,
                    "stop": st.stop,
                    "compute_ms": st.compute_ms,
                    "net_ms": st.net_ms,
                }
                for st in plan.stages
            ],  # fmt: skip
            "best_single": None
            if best is None
            else {"node": best.node, "tokens_per_s": best.tokens_per_s},
            "worth_it": plan.worth_it,
            "verdict": plan.verdict,
        },
        "measured": [dataclasses.asdict(r) for r in runs],
        "measured_worth_it": measured_worth_it,
    }
