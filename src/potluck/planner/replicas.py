"""Replicas for batch jobs (data parallel): which machines each run the whole model on their own,
and which are grouped into one pipeline. Pure: numbers in, replicas out.

A batch job's items are independent, so a machine that can hold the whole model (weights + the KV
of the job's sequences at once) is worth most as a replica of its own: no hop, no waiting on
another stage, and the job's throughput is the sum of the replicas'. The machines that cannot
hold it alone are pooled into one pipeline replica when together they can (plan_pool's plan).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from potluck.planner.cost import NS, CostModel
from potluck.planner.errors import NotEnoughMemoryError, fmt_bytes
from potluck.planner.footprint import ModelFootprint
from potluck.planner.nodes import Links, NodeInfo
from potluck.planner.plan import Plan, plan_pool


@dataclass(frozen=True)
class Replica:
    """One copy of the model: a single node, or a pipeline (`plan`) over several."""

    nodes: tuple[str, ...]
    tokens_per_s: float  # one stream, predicted
    plan: Plan | None = None  # a pipeline replica's plan; None: the whole model on nodes[0]

    @property
    def label(self) -> str:
        return " + ".join(self.nodes)


@dataclass(frozen=True)
class Replicas:
    replicas: tuple[Replica, ...]
    left_out: tuple[tuple[str, str], ...]  # (node, why)

    @property
    def tokens_per_s(self) -> float:
        """The job's predicted throughput for one stream per replica: their sum."""
        return sum(r.tokens_per_s for r in self.replicas)


def plan_replicas(
    model: ModelFootprint, nodes: Sequence[NodeInfo], links: Links | None = None
) -> Replicas:
    """Every node that holds the whole model alone is a replica; the others form one pipeline
    replica if together they can hold it, else they are left out with the reason. Raises
    NotEnoughMemoryError (with the numbers) when no replica at all can be made."""
    costs = CostModel(model, list(nodes), links or {})
    alone, rest = [], []
    for i, node in enumerate(nodes):
        st = costs.stage(i, 0, model.n_layer)
        if st.fits:
            alone.append(Replica((node.name,), NS / st.compute_ns))
        else:
            rest.append(node)
    alone.sort(key=lambda r: -r.tokens_per_s)
    left_out: list[tuple[str, str]] = []
    pooled: list[Replica] = []
    offering = [n for n in rest if n.memory_bytes + n.gpu_memory_bytes > 0]
    left_out += [(n.name, "offers no memory (--mem 0)") for n in rest if n not in offering]
    rest = offering
    if len(rest) == 1:
        need = model.total_bytes
        left_out.append(
            (rest[0].name, f"cannot hold the model alone ({fmt_bytes(need)} at {model.ctx_label})")
        )
    elif rest:
        try:
            plan = plan_pool(model, rest, links)
        except NotEnoughMemoryError as exc:
            left_out += [(n.name, f"too little memory, even together: {exc}") for n in rest]
        else:
            used = tuple(s.node for s in plan.stages)
            pooled.append(Replica(used, plan.tokens_per_s, plan))
            left_out += [(n, "not needed in the pipeline replica") for n in plan.left_out]
    if not alone and not pooled:  # then the nodes together cannot hold it either:
        plan_pool(model, list(nodes), links)  # NotEnoughMemoryError, with the numbers
        raise AssertionError("nodes that hold the model together make a pipeline replica")
    return Replicas(tuple(alone + pooled), tuple(left_out))


REPLICA_COLUMNS = ("replica", "runs", "tok/s (one stream)", "items/hour")


def format_replicas(reps: Replicas, item_tokens: int) -> tuple[list[tuple[str, ...]], list[str]]:
    """`potluck plan --batch`: a row per replica, and the summary lines (the pool's items/hour
    against the best single machine's) for items of `item_tokens` generated tokens."""

    def per_hour(tps: float) -> float:
        return tps * 3600 / item_tokens

    rows: list[tuple[str, ...]] = [
        (r.label, "a pipeline" if r.plan is not None else "the whole model",
         f"{r.tokens_per_s:.1f}", f"{per_hour(r.tokens_per_s):.0f}")
        for r in reps.replicas
    ]  # fmt: skip
    total = per_hour(reps.tokens_per_s)
    lines = [f"the pool: {total:.0f} items/hour of {item_tokens} tokens ({len(reps.replicas)} "
             f"replica{'s' * (len(reps.replicas) > 1)}, one stream each)"]  # fmt: skip
    singles = [r for r in reps.replicas if r.plan is None]
    if singles:
        best = max(singles, key=lambda r: r.tokens_per_s)
        alone = per_hour(best.tokens_per_s)
        lines.append(
            f"best single machine: {best.label}, {alone:.0f} items/hour; the pool "
            f"{total / alone:.2f}× that"
        )
    else:
        lines.append("best single machine: none can hold the model")
    lines += [f"left out: {node} ({why})" for node, why in reps.left_out]
    return rows, lines
