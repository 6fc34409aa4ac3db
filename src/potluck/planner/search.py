"""The exact search: which nodes, in which order, with which contiguous layer ranges.

Objective, compared as a pair: (time per token of one stream, slowest stage's balance cost). One
stream's token passes every stage in turn, so its time is the sum of the stages' compute, the hops
between them and the token id's way back from the last stage to the first. The second key
spreads the layers evenly among equals: by decode time (throughput with many streams) or by prompt
work (prompt micro-batches overlap in the stages), as the CostModel's `balance` says.

Dynamic programming over (set of nodes used, last node, layers covered so far), once per choice
of first node (the way back ends there): a partial plan that reaches the same state more cheaply
wins whatever follows, so the result is the optimum over every subset, order and split. For each
state and next node, the step over "where the next stage stops" is one numpy min over a
(layers x layers) table. Work: nodes * 2^(nodes-1) * nodes * layers^2, ≈ 0.5 s for 8 nodes and
80 layers; pools of more nodes keep the MAX_EXACT_NODES fastest (see plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from potluck.planner.cost import CostModel

INF = 1 << 60  # "does not fit"; sums of two stay inside int64
MAX_EXACT_NODES = 8


@dataclass(frozen=True)
class Route:
    """An ordered plan: (node index, start, stop) per stage, and its objective."""

    stages: tuple[tuple[int, int, int], ...]
    total_ns: int
    slowest_ns: int

    @property
    def key(self) -> tuple[int, int]:
        return self.total_ns, self.slowest_ns


def route_cost(costs: CostModel, stages: tuple[tuple[int, int, int], ...]) -> Route | None:
    """Evaluate any ordered plan with the same costs the search uses; None if a stage overflows."""
    total = slowest = 0
    for k, (i, a, b) in enumerate(stages):
        st = costs.stage(i, a, b)
        if not st.fits:
            return None
        total += st.compute_ns
        slowest = max(slowest, st.balance_ns)
        if k + 1 < len(stages):
            total += costs.hop_ns(i, stages[k + 1][0])
    if len(stages) > 1:
        total += costs.return_ns(stages[-1][0], stages[0][0])
    return Route(stages, costs.paced_ns(stages[0][0], total), slowest)


def stage_table(costs: CostModel, i: int) -> tuple[np.ndarray, np.ndarray]:
    """(L+1, L+1) int64 each: compute ns and balance ns (StageCost) of layers [a, b) on node i,
    INF where a >= b or it overflows."""
    n = costs.model.n_layer
    table = np.full((n + 1, n + 1), INF, dtype=np.int64)
    balance = np.full((n + 1, n + 1), INF, dtype=np.int64)
    for a in range(n):
        for b in range(a + 1, n + 1):
            st = costs.stage(i, a, b)
            if not st.fits:  # a longer range keeps at least these layers in RAM
                break
            table[a, b] = st.compute_ns
            balance[a, b] = st.balance_ns
    return table, balance


def _better(s1: np.ndarray, m1: np.ndarray, s2: np.ndarray, m2: np.ndarray) -> np.ndarray:
    """Where (s1, m1) < (s2, m2) lexicographically."""
    return np.asarray((s1 < s2) | ((s1 == s2) & (m1 < m2)))


def _unwind(
    prev_b: np.ndarray, prev_u: np.ndarray, mask: int, u: int, e: int
) -> tuple[tuple[int, int, int], ...]:
    """Follow the back-pointers of state (mask, u, e) to the first stage."""
    out = []
    while True:
        b, p = int(prev_b[mask, u, e]), int(prev_u[mask, u, e])
        out.append((u, b, e))
        if p < 0:
            return tuple(reversed(out))
        mask, u, e = mask ^ (1 << u), p, b


def _keep(best: Route | None, stages: Route) -> Route:
    return stages if best is None or stages.key < best.key else best


def search(costs: CostModel) -> tuple[Route | None, Route | None]:
    """The best route over all nodes, and the best that uses at least two (None: nothing fits)."""
    n_nodes = len(costs.nodes)
    if n_nodes > MAX_EXACT_NODES:
        raise ValueError(f"the exact search takes at most {MAX_EXACT_NODES} nodes, got {n_nodes}")
    tables = [stage_table(costs, i) for i in range(n_nodes)]
    hop = [[costs.hop_ns(u, v) for v in range(n_nodes)] for u in range(n_nodes)]
    best: Route | None = None
    best_multi: Route | None = None
    for first in range(n_nodes):
        for route in _routes_from(costs, tables, hop, first):
            best = _keep(best, route)
            if len(route.stages) > 1:
                best_multi = _keep(best_multi, route)
    return best, best_multi


def _routes_from(
    costs: CostModel,
    tables: list[tuple[np.ndarray, np.ndarray]],
    hop: list[list[int]],
    first: int,
) -> list[Route]:
    """For each set of nodes and last node, the best complete route that starts on `first`."""
    n_nodes, n = len(costs.nodes), costs.model.n_layer
    cols = np.arange(n + 1)
    size = 1 << n_nodes
    # per state (set of nodes used, last node, layers covered [0, e)): the objective pair so far
    # and where it came from (boundary b where the last stage starts, the node before it)
    tot = np.full((size, n_nodes, n + 1), INF, dtype=np.int64)
    mx = np.full((size, n_nodes, n + 1), INF, dtype=np.int64)
    prev_b = np.zeros((size, n_nodes, n + 1), dtype=np.int32)
    prev_u = np.full((size, n_nodes, n + 1), -1, dtype=np.int32)
    start = 1 << first
    tot[start, first] = tables[first][0][0]
    mx[start, first] = tables[first][1][0]
    routes = []
    for mask in range(start, size):  # every step goes to a larger mask: states here are final
        if not mask & start:
            continue
        members = [u for u in range(n_nodes) if mask >> u & 1]
        for u in members:  # complete routes end at boundary n
            if tot[mask, u, n] < INF:
                back = costs.return_ns(u, first) if mask != start else 0
                total = costs.paced_ns(first, int(tot[mask, u, n]) + back)
                stages = _unwind(prev_b, prev_u, mask, u, n)
                routes.append(Route(stages, total, int(mx[mask, u, n])))
        for v in range(n_nodes):
            if mask >> v & 1:
                continue
            # arrive at boundary b (< n) from the best last node u, then hop u -> v
            g_tot = np.full(n, INF, dtype=np.int64)
            g_mx = np.full(n, INF, dtype=np.int64)
            g_u = np.full(n, -1, dtype=np.int32)
            for u in members:
                cand, cand_mx = tot[mask, u, :n] + hop[u][v], mx[mask, u, :n]
                take = _better(cand, cand_mx, g_tot, g_mx) & (tot[mask, u, :n] < INF)
                g_tot = np.where(take, cand, g_tot)
                g_mx = np.where(take, cand_mx, g_mx)
                g_u = np.where(take, u, g_u)
            if g_tot.min() >= INF:
                continue
            # v's stage [b, e): rows b, columns e; per e the best b, ties to the smaller slowest
            step, step_mx = tables[v][0][:n], tables[v][1][:n]
            t = g_tot[:, None] + step
            m = np.maximum(g_mx[:, None], step_mx)
            t_min = t.min(axis=0)
            b_sel = np.where(t == t_min, m, INF).argmin(axis=0)
            new_tot, new_mx = t_min, m[b_sel, cols]
            nm = mask | (1 << v)
            upd = _better(new_tot, new_mx, tot[nm, v], mx[nm, v]) & (new_tot < INF)
            tot[nm, v] = np.where(upd, new_tot, tot[nm, v])
            mx[nm, v] = np.where(upd, new_mx, mx[nm, v])
            prev_b[nm, v] = np.where(upd, b_sel, prev_b[nm, v])
            prev_u[nm, v] = np.where(upd, g_u[b_sel], prev_u[nm, v])
    return routes
