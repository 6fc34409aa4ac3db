"""What the dashboard shows about the pool: the model, each node's layers, memory and speed, and
the scheduler's prefix cache.

Compute and network times come from the scheduler's recent decode steps (engine/scheduler.Stats:
per stage, ms per decode step; a local pipeline reports the whole step as this machine's compute).
A remote node's name, memory total and whether it answers come from the pipeline
(`Pipeline.node_status`: the failover heartbeat's Hellos); its used memory is what the planner's model says its layers hold (weights + the KV
cache reserved for the context), the head's is measured.
"""

from __future__ import annotations

import socket
from typing import Any

import psutil

from potluck.engine.generate import Model
from potluck.engine.scheduler import Scheduler
from potluck.model.archs import parameters


class PoolInfo:
    """Builds GET /api/pool's JSON (the contract in api/server.py) and the per-node metrics."""

    def __init__(self, model: Model, scheduler: Scheduler, model_id: str) -> None:
        self.model, self.scheduler, self.model_id = model, scheduler, model_id
        self._parameters = parameters(model.hp, model.file.tensors)  # (all, per token)
        self.hostname = socket.gethostname()
        self._footprint: Any = None  # the planner's model of the layers' bytes, made on first use

    def nodes(self) -> list[tuple[str, int, int]]:
        """(address or "local", start, stop) per stage, as the pipeline runs now (a pool that
        failed over has a new plan)."""
        assignments = self.model.pipeline.assignments
        if assignments:
            return [(a.node, a.start, a.stop) for a in assignments]
        return [("local", 0, self.model.hp.n_layer)]

    def _planned_bytes(self, a: int, b: int) -> int:
        """Weights + KV cache a remote node holds for layers [a, b), by the planner's model."""
        if self._footprint is None:
            from potluck.planner import footprint_from_gguf, held_bytes

            m = self.model
            self._footprint = footprint_from_gguf(
                m.file.tensors, m.hp, m.n_ctx, held=held_bytes, n_seq=m.n_seq
            )
        fp = self._footprint
        extra = (
            (fp.head_bytes if b == self.model.hp.n_layer else 0)
            + (fp.embd_bytes if a == 0 else 0)
            - fp.shared_bytes(a, b)
        )
        return int(fp.weights(a, b) + fp.kv(a, b) + extra)

    def _local_used(self) -> int:
        stages = self.model.pipeline.stages
        weights = sum(s.weight_bytes() for s in stages)
        kv = sum(c.nbytes() for s in stages for c in list(s.caches.values()))
        return weights + kv

    def snapshot(self) -> dict[str, Any]:
        st = self.scheduler.stats
        stage_ms, hop_ms = list(st.stage_ms), list(st.hop_ms)
        rows = st.decode_rows or 1.0
        status = self.model.pipeline.node_status
        nodes = []
        for i, (node, a, b) in enumerate(self.nodes()):
            compute = stage_ms[i] if i < len(stage_ms) else None
            hop = hop_ms[i] if i < len(hop_ms) and node != "local" else None
            if node == "local":
                name, used, total, ok = (
                    self.hostname,
                    self._local_used(),
                    psutil.virtual_memory().total,
                    True,
                )
            else:
                h = status.get(node)
                name = h.name if h else node
                used = self._planned_bytes(a, b)
                total, ok = (h.memory_total if h else 0), (h.ok if h else True)
            nodes.append(
                {
                    "name": name,
                    "address": node,
                    "device": "cpu",
                    "layers": [a, b],
                    "memory_used_bytes": int(used),
                    "memory_total_bytes": int(total),
                    "compute_ms": round(compute, 3) if compute is not None else None,
                    "hop_ms": round(hop, 3) if hop is not None else None,
                    # what this node alone could sustain: decode rows per second of its compute
                    "tokens_per_s": round(rows * 1e3 / compute, 2) if compute else None,
                    "status": "ok" if ok else "unreachable",
                }
            )
        m, hp = self.model, self.model.hp
        total, active = self._parameters
        return {
            "model": {
                "name": self.model_id,
                "arch": hp.arch,
                "quant": m.file.quant_mix(),
                "n_layer": hp.n_layer,
                "n_ctx": m.n_ctx,
                "parameters": total,
                # a mixture of experts: what a token computes with, and its experts (0: dense)
                "active_parameters": active,
                "n_expert": hp.n_expert,
                "n_expert_used": hp.n_expert_used,
            },
            "nodes": nodes,
            "tokens_per_s": round(st.tokens_per_s(), 2),
            "requests_active": self.scheduler.active,
            "requests_queued": self.scheduler.queued,
            "requests_total": st.requests_total,
            # prompt prefixes reused: requests that did and did not, their tokens not computed,
            # and what the cache holds now (finished sequences, KV bytes over every stage)
            "prefix_cache": {
                "hits": st.prefix_hits,
                "misses": st.prefix_misses,
                "cached_tokens": st.cached_tokens,
                "entries": st.prefix_entries,
                "bytes": st.prefix_bytes,
            },
        }
