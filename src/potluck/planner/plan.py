"""The plan: which nodes run which layers, what that costs, and whether pooling is worth it.

plan_pool(model, nodes, links) is a pure function (numbers in, plan out). The plan id is a hash
of every input the plan depends on, so two heads that plan the same pool agree on it and a stage
can refuse messages of another plan.

The Plan and the search that makes it, with its verdict and messages; over 400 lines on purpose
(the numbers and the words about them stay together).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from potluck.planner.cost import DECODE, NS, CostModel, StageCost
from potluck.planner.errors import NotEnoughMemoryError, PlanError, fmt_bytes
from potluck.planner.footprint import ModelFootprint
from potluck.planner.nodes import Links, NodeInfo, link_between, weight_sources
from potluck.planner.search import MAX_EXACT_NODES, Route, route_cost, search

PLANNER_VERSION = 2  # bump when the cost model changes: old plan ids must not match new plans
WORTH_IT = 1.2  # pooling must beat the best single machine by 20 % to be worth its trouble
MAX_RTT_S = 0.080  # a node farther than this round trip from the head is left out (see _too_far)
WEAK = 1.25  # a machine this many times slower than the best one alone is called too weak


@dataclass(frozen=True)
class PlannedStage:
    """Layers [start, stop) on `node`; [gpu_start, stop) of them on its accelerator."""

    node: str
    device: str
    start: int
    stop: int
    gpu_start: int  # == stop: no layer on the accelerator
    head_on_gpu: bool
    weight_bytes: int  # layers + token embedding (first stage) + output head (last stage)
    kv_bytes: int
    buffer_bytes: int
    ram_bytes: int  # of the above, what sits in RAM ...
    gpu_bytes: int  # ... and on the accelerator
    memory_bytes: int  # RAM the node has free
    gpu_memory_bytes: int  # accelerator memory the node has free
    compute_ms: float  # per decoded token
    net_ms: float  # the hop out of this stage per token (the last: the token id back to the first)
    # peers of the pool this node asks for the tensors it lacks before the head (nodes.weight_sources)
    weight_sources: tuple[str, ...] = ()
    weights_from: str = ""  # "": the node has the model file; else whom it will receive them from
    fetch_s: float = 0.0  # the longest receiving them takes (tensors kept from before: less)
    ram_experts: int = 0  # the first that many of its GPU layers keep their experts in RAM

    @property
    def n_gpu_layers(self) -> int:
        return self.stop - self.gpu_start


@dataclass(frozen=True)
class SingleMachine:
    node: str
    device: str
    ms_per_token: float
    tokens_per_s: float


@dataclass(frozen=True)
class Plan:
    plan_id: str
    n_layer: int
    n_ctx: int
    stages: tuple[PlannedStage, ...]
    left_out: tuple[str, ...]  # nodes that take no part
    ms_per_token: float  # one stream: every stage and hop in turn
    tokens_per_s: float  # one stream
    tokens_per_s_streams: float  # many concurrent streams: each stage busy with another one
    best_single: SingleMachine | None  # None: no single machine can hold the model
    worth_it: bool
    verdict: str  # one line
    manual: bool  # ranges from --tensor-split
    why_left_out: tuple[tuple[str, str], ...] = ()  # (node, reason) where a rule left it out


def layers_label(start: int, stop: int) -> str:
    """Half-open [start, stop) as people read it: '0–15' (inclusive)."""
    return f"{start}–{stop - 1}"


def plan_pool(
    model: ModelFootprint,
    nodes: Sequence[NodeInfo],
    links: Links | None = None,
    tensor_split: Sequence[float] | None = None,
    balance: str = DECODE,
) -> Plan:
    """The fastest plan for one stream (ties: the most even stages) over any subset and order of
    `nodes`; with `tensor_split` (--tensor-split 6,4: shares per node, in the order given; 0 leaves
    a node out) the ranges are fixed by hand and only checked. `balance` (DECODE or PROMPT, see
    CostModel) breaks ties between splits of equal one-stream time. Raises NotEnoughMemoryError
    when nothing fits, PlanError for inputs that make no sense."""
    links = links or {}
    if not nodes:
        raise PlanError("no nodes to plan for: start `potluck worker` on a machine or add --peer")
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise PlanError(f"node names must be unique, got {names}")
    far = _too_far(nodes, links) if tensor_split is None else {}
    if far:  # plan without them, unless only they make the model fit
        try:
            near = plan_pool(model, [n for n in nodes if n.name not in far], links, None, balance)
        except NotEnoughMemoryError:
            pass
        else:
            return replace(
                near,
                left_out=near.left_out + tuple(far),
                why_left_out=near.why_left_out + tuple(far.items()),
            )
    if tensor_split is None:
        # canonical order, so that the same pool gives the same plan however it was discovered
        candidates = sorted(nodes, key=lambda n: n.name)
        if len(candidates) > MAX_EXACT_NODES:  # keep the fastest; the exact search is exponential
            candidates = sorted(candidates, key=_speed_rank)[:MAX_EXACT_NODES]
            candidates.sort(key=lambda n: n.name)
    else:
        candidates = list(nodes)
    head = nodes[0].name
    costs = CostModel(model, candidates, links, balance, head)
    plan_id = _plan_id(model, costs, tensor_split)
    everyone = (
        costs
        if len(candidates) == len(nodes)
        else CostModel(model, list(nodes), links, balance, head)
    )
    # each machine alone, as one stream pays for it (a worker: with the head's round trip)
    singles = [
        (everyone.paced_ns(i, st.compute_ns), st)
        for i, st in enumerate(everyone.stage(i, 0, model.n_layer) for i in range(len(nodes)))
        if st.fits
    ]
    single_ns, single = min(singles, key=lambda e: e[0], default=(0, None))
    route: Route | None
    if tensor_split is not None:
        route, multi = _manual_route(costs, tensor_split), None
    else:
        route, multi = search(costs)
    if route is None:
        raise _not_enough_memory(model, list(nodes))
    stages = _with_sources(_stages(costs, route), nodes, links or {})
    compute = [costs.stage(i, a, b).compute_ns for i, a, b in route.stages]
    transfers = [
        costs.transfer_ns(i, j, model.wire_bytes)
        for (i, _, _), (j, _, _) in zip(route.stages, route.stages[1:], strict=False)
    ]
    worth_it, verdict = _verdict(costs, route, multi, single, single_ns, len(nodes), tensor_split)
    used = {s.node for s in stages}
    return Plan(
        plan_id=plan_id,
        n_layer=model.n_layer,
        n_ctx=model.n_ctx,
        stages=stages,
        left_out=tuple(n.name for n in nodes if n.name not in used),
        ms_per_token=route.total_ns / 1e6,
        tokens_per_s=NS / route.total_ns,
        tokens_per_s_streams=NS / max(compute + transfers),
        best_single=None if single is None else _single(single, single_ns),
        worth_it=worth_it,
        verdict=verdict,
        manual=tensor_split is not None,
    )


def _too_far(nodes: Sequence[NodeInfo], links: Links) -> dict[str, str]:
    """Nodes whose round trip from the first node (the head) exceeds MAX_RTT_S, with the reason:
    every token crosses each link of the pipeline, so such a node costs more than any share of
    the model it could take (Mesh-LLM draws the same line at 80 ms)."""
    head = nodes[0].name
    out = {}
    for n in nodes[1:]:
        rtt = 2 * link_between(links, head, n.name).latency_s
        if rtt > MAX_RTT_S:
            out[n.name] = (
                f"round trip {rtt * 1e3:.0f} ms, over the {MAX_RTT_S * 1e3:.0f} ms a pipeline "
                "tolerates per token"
            )
    return out


def _speed_rank(node: NodeInfo) -> tuple[float, int, str]:
    best = max(node.cpu_bytes_per_s, node.gpu_bytes_per_s if node.uses_gpu else 0.0)
    return -best, -(node.memory_bytes + node.gpu_memory_bytes), node.name


def _plan_id(model: ModelFootprint, costs: CostModel, split: Sequence[float] | None) -> str:
    nodes = costs.nodes
    links = [
        [a.name, b.name, costs.links[i][j].latency_s, costs.links[i][j].bytes_per_s]
        for i, a in enumerate(nodes)
        for j, b in enumerate(nodes)
        if i != j
    ]
    inputs = {
        "planner": PLANNER_VERSION,
        "model": asdict(model),
        "nodes": [asdict(n) for n in nodes],
        "links": links,
        "tensor_split": None if split is None else [float(p) for p in split],
        "balance": costs.balance,
        "head": costs.nodes[costs.head].name if costs.head >= 0 else "",
    }
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _manual_route(costs: CostModel, split: Sequence[float]) -> Route:
    """Ranges in proportion to `split` (llama.cpp's --tensor-split), checked against memory."""
    nodes, n = costs.nodes, costs.model.n_layer
    shown = ",".join(f"{p:g}" for p in split)
    if len(split) != len(nodes):
        raise PlanError(
            f"--tensor-split {shown} has {len(split)} shares but there are {len(nodes)} nodes"
        )
    if any(not (math.isfinite(p) and p >= 0) for p in split) or sum(split) <= 0:
        raise PlanError(f"--tensor-split {shown}: shares must be ≥ 0 and not all 0")
    total, cum, prev, stages = sum(split), 0.0, 0, []
    for i, p in enumerate(split):
        cum += p
        stop = math.floor(n * cum / total + 0.5)
        if p > 0:
            if stop <= prev:
                raise PlanError(
                    f"--tensor-split {shown}: {nodes[i].name} gets no layer of {n}; "
                    "raise its share or give it 0"
                )
            stages.append((i, prev, stop))
        prev = stop
    for i, a, b in stages:
        st = costs.stage(i, a, b)
        if not st.fits:
            gpu = f" after {fmt_bytes(st.gpu_bytes)} on its GPU" if st.gpu_bytes else ""
            raise NotEnoughMemoryError(
                f"--tensor-split {shown}: {st.node.name} gets layers {layers_label(a, b)}, which "
                f"need {fmt_bytes(st.ram_bytes)} of RAM{gpu} (weights {fmt_bytes(st.weight_bytes)}"
                f" + KV {fmt_bytes(st.kv_bytes)} at {costs.model.ctx_label} + buffers "
                f"{fmt_bytes(st.buffer_bytes)}), but it has {fmt_bytes(st.node.memory_bytes)} free "
                f"({fmt_bytes(st.ram_bytes - st.node.memory_bytes)} short); give it a smaller "
                f"share, lower {costs.model.ctx_fix}, or use a smaller quantization",
                st.ram_bytes,
                st.node.memory_bytes,
                st.node.name,
            )
    route = route_cost(costs, tuple(stages))
    assert route is not None  # every stage was checked above
    return route


def _not_enough_memory(model: ModelFootprint, nodes: list[NodeInfo]) -> NotEnoughMemoryError:
    need = model.total_bytes
    free = sum(n.memory_bytes + n.gpu_memory_bytes for n in nodes)
    if len(nodes) > 1:
        each = ", ".join(
            f"{n.name}: {fmt_bytes(n.memory_bytes + n.gpu_memory_bytes)}" for n in nodes
        )
        who = f"the {len(nodes)} nodes have {fmt_bytes(free)} free together ({each})"
    else:
        who = f"{nodes[0].name} has {fmt_bytes(free)} free"
    weights, kv = model.weights(0, model.n_layer), model.kv(0, model.n_layer)
    other = model.embd_bytes + model.head_bytes + model.buffer_bytes
    fix = f"lower {model.ctx_fix}, use a smaller quantization, or add a node"
    if need > free:
        msg = (
            f"the model needs {fmt_bytes(need)}: {fmt_bytes(weights)} for {model.n_layer} layers "
            f"+ {fmt_bytes(kv)} KV at {model.ctx_label} + {fmt_bytes(other)} embeddings, head and "
            f"buffers, but {who}; "
            f"{fmt_bytes(need - free)} short: {fix}"
        )
    else:
        largest = max(
            w + k for w, k in zip(model.layer_weight_bytes, model.layer_kv_bytes, strict=True)
        )
        msg = (
            f"no split fits: {who} for the "
            f"{fmt_bytes(need)} the model needs at {model.ctx_label}, but layers "
            f"({fmt_bytes(largest)} each with KV) cannot be cut, every stage needs "
            f"{fmt_bytes(model.buffer_bytes)} of buffers, the first holds the token embedding "
            f"({fmt_bytes(model.embd_bytes)}) and the last the output head "
            f"({fmt_bytes(model.head_bytes)}); {fix}"
        )
    return NotEnoughMemoryError(msg, need, free)


def _stages(costs: CostModel, route: Route) -> tuple[PlannedStage, ...]:
    out = []
    k = len(route.stages)
    for pos, (i, a, b) in enumerate(route.stages):
        st = costs.stage(i, a, b)
        if k == 1:
            net = 0
        elif pos + 1 < k:
            net = costs.hop_ns(i, route.stages[pos + 1][0])
        else:
            net = costs.return_ns(i, route.stages[0][0])
        out.append(_planned(st, net))
    return tuple(out)


def _with_sources(
    stages: tuple[PlannedStage, ...], nodes: Sequence[NodeInfo], links: Links
) -> tuple[PlannedStage, ...]:
    """Where each stage's weights come from. The head (nodes[0]) and a node whose Hello names the
    file map it in place; any other node receives them: weights_from is the first peer it asks
    that has the file, else the head, and fetch_s the stage's bytes over that link. Every node
    but the head gets the peers to ask before the head (any node of the pool, in the plan or
    left out), in case its file or a peer's turns out not to be there."""
    head, names = nodes[0].name, [n.name for n in nodes]
    holders = {n.name for n in nodes if n.has_model}
    out = []
    for st in stages:
        if st.node == head:
            out.append(st)
            continue
        sources = tuple(weight_sources(st.node, names, links, head, holders))
        if st.node in holders:
            out.append(replace(st, weight_sources=sources))
            continue
        src = next((p for p in sources if p in holders), head)
        fetch_s = link_between(links, src, st.node).seconds(st.weight_bytes)
        out.append(replace(st, weight_sources=sources, weights_from=src, fetch_s=fetch_s))
    return tuple(out)


def _planned(st: StageCost, net_ns: int) -> PlannedStage:
    return PlannedStage(
        node=st.node.name,
        device=st.node.device,
        start=st.start,
        stop=st.stop,
        gpu_start=st.gpu_start,
        head_on_gpu=st.head_on_gpu,
        weight_bytes=st.weight_bytes,
        kv_bytes=st.kv_bytes,
        buffer_bytes=st.buffer_bytes,
        ram_bytes=st.ram_bytes,
        gpu_bytes=st.gpu_bytes,
        memory_bytes=st.node.memory_bytes,
        gpu_memory_bytes=st.node.gpu_memory_bytes,
        compute_ms=st.compute_ns / 1e6,
        net_ms=net_ns / 1e6,
        ram_experts=st.ram_experts,
    )


def _single(st: StageCost, ns: int) -> SingleMachine:
    return SingleMachine(st.node.name, st.node.device, ns / 1e6, NS / ns)


def _verdict(
    costs: CostModel,
    route: Route,
    multi: Route | None,
    single: StageCost | None,
    single_ns: int,
    n_nodes: int,
    split: Sequence[float] | None,
) -> tuple[bool, str]:
    """Whether pooling beats the best single machine by WORTH_IT, and why, in one line."""
    model = costs.model
    pool_tps = NS / route.total_ns
    if single is None:
        i, big = max(
            enumerate(costs.nodes), key=lambda e: e[1].memory_bytes + e[1].gpu_memory_bytes
        )
        return True, (
            f"pooling is needed: no single machine can hold the model "
            f"({fmt_bytes(model.total_bytes)} at {model.ctx_label}; the most on one is "
            f"{fmt_bytes(big.memory_bytes + big.gpu_memory_bytes)} on {big.name}); the pool gives "
            f"{pool_tps:.1f} tok/s"
        )
    name, single_tps = single.node.name, NS / single_ns
    alone = f"use {name} alone ({single_tps:.1f} tok/s)"
    if len(route.stages) >= 2:
        gain = pool_tps / single_tps
        if gain >= WORTH_IT:
            return True, (
                f"pooling is worth it: {pool_tps:.1f} tok/s vs {single_tps:.1f} tok/s on "
                f"{name} alone (+{gain - 1:.0%})"
            )
        return False, (
            f"{alone}: the pool gives {pool_tps:.1f} tok/s ({gain - 1:+.0%}, needs "
            f"+{WORTH_IT - 1:.0%}); {_bottleneck(costs, route)}"
        )
    # the fastest plan is one machine on its own
    if n_nodes == 1:
        return False, f"{alone}: it is the only node"
    if split is not None:
        node = _route_node(costs, route)
        by_hand = f"--tensor-split gives every layer to {node} ({pool_tps:.1f} tok/s)"
        if node == name:
            return False, by_hand
        return False, f"{by_hand}; {name} alone would be faster ({single_tps:.1f} tok/s)"
    if multi is None:
        return False, f"{alone}: no other node can hold even a part of the model next to it"
    multi_tps = NS / multi.total_ns
    k = len(multi.stages)
    compute = sum(costs.stage(i, a, b).compute_ns for i, a, b in multi.stages)
    net = multi.total_ns - compute
    others = [st for st in multi.stages if costs.nodes[st[0]].name != name]
    if compute < single.compute_ns or not others:
        why = (
            f"the network: its {k} hops add {net / 1e6:.2f} ms per token, more than the "
            f"{(single.compute_ns - compute) / 1e6:.2f} ms a split saves"
        )
    else:
        # each other machine as if it ran the whole model: the same work, so a fair comparison
        i = max((st[0] for st in others), key=lambda j: costs.stage(j, 0, model.n_layer).compute_ns)
        t_alone = costs.stage(i, 0, model.n_layer).compute_ns
        if t_alone > WEAK * single.compute_ns:
            why = (
                f"{costs.nodes[i].name} is too weak: the whole model would take it "
                f"{t_alone / 1e6:.2f} ms per token vs {single.compute_ns / 1e6:.2f} ms on {name}"
            )
        else:  # machines of about the same speed: one token still visits every stage in turn
            why = (
                f"one token goes through every stage in turn, so a split over machines no faster "
                f"than {name} saves no time, and its {k} hops add {net / 1e6:.2f} ms per token "
                f"(a pool pays off for a model too big for one machine, a faster machine, or "
                f"several streams: potluck serve)"
            )
    return False, f"{alone}: the best split over {k} nodes gives {multi_tps:.1f} tok/s; {why}"


def _route_node(costs: CostModel, route: Route) -> str:
    return costs.nodes[route.stages[0][0]].name


def _bottleneck(costs: CostModel, route: Route) -> str:
    per_stage = [(costs.stage(i, a, b), i, a, b) for i, a, b in route.stages]
    slow, i, a, b = max(per_stage, key=lambda e: e[0].compute_ns)
    net = route.total_ns - sum(st.compute_ns for st, *_ in per_stage)
    total = route.total_ns / 1e6
    if net >= slow.compute_ns:
        return f"the network adds {net / 1e6:.2f} ms of the {total:.2f} ms per token"
    return (
        f"the slowest stage ({costs.nodes[i].name}, layers {layers_label(a, b)}) takes "
        f"{slow.compute_ns / 1e6:.2f} ms of the {total:.2f} ms per token"
    )
