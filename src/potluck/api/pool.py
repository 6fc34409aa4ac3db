"""What the dashboard shows about the pool: the model, each node's layers, memory and speed.

Compute and network times come from the scheduler's recent decode steps (engine/scheduler.Stats:
per stage, ms per decode step; a local pipeline reports the whole step as this machine's compute).
A remote node's memory total comes from its Hello (asked at most every `HELLO_EVERY_S`, off the
event loop); its used memory is what the planner's model says its layers hold (weights + the KV
cache reserved for the context), the head's is measured.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import psutil

from potluck.engine.generate import Model
from potluck.engine.scheduler import Scheduler

HELLO_EVERY_S = 15.0


@dataclass
class _Hello:
    name: str
    memory_total: int
    ok: bool
    at: float


class PoolInfo:
    """Builds GET /api/pool's JSON (the contract in api/server.py) and the per-node metrics."""

    def __init__(self, model: Model, scheduler: Scheduler, model_id: str) -> None:
        self.model, self.scheduler, self.model_id = model, scheduler, model_id
        self.hostname = socket.gethostname()
        hp = model.hp
        assignments = getattr(model.pipeline, "assignments", None)
        self.nodes: list[tuple[str, int, int]] = (
            [(a.node, a.start, a.stop) for a in assignments]
            if assignments
            else [("local", 0, hp.n_layer)]
        )
        self._planned = self._planned_bytes()
        self._hello: dict[str, _Hello] = {}
        self._hello_lock = threading.Lock()

    def _planned_bytes(self) -> dict[str, int]:
        """Weights + KV cache each remote node holds for its layers, by the planner's model."""
        remotes = [n for n in self.nodes if n[0] != "local"]
        if not remotes:
            return {}
        from potluck.kernels.qlinear import held_bytes
        from potluck.planner import footprint_from_gguf

        fp = footprint_from_gguf(
            self.model.file.tensors, self.model.hp, self.model.n_ctx, held=held_bytes
        )
        out = {}
        for node, a, b in remotes:
            extra = fp.head_bytes if b == self.model.hp.n_layer else 0
            extra += fp.embd_bytes if a == 0 else 0
            out[node] = fp.weights(a, b) + fp.kv(a, b) + extra
        return out

    def refresh_hellos(self) -> None:
        """Ask each remote node for its name and memory (blocking: run it in a worker thread)."""
        from potluck.transport import potluck_pb2 as pb
        from potluck.transport.client import NodeClient
        from potluck.transport.codec import PROTOCOL_VERSION

        for node, _, _ in self.nodes:
            if node == "local":
                continue
            with self._hello_lock:
                old = self._hello.get(node)
            if old is not None and time.monotonic() - old.at < HELLO_EVERY_S:
                continue
            client = NodeClient(node)
            try:
                reply = client.hello(
                    pb.HelloRequest(protocol_version=PROTOCOL_VERSION, head_name="dashboard"),
                    timeout=2.0,
                )
                mem = reply.devices[0].memory_bytes if reply.devices else 0
                new = _Hello(reply.node_name or node, int(mem), True, time.monotonic())
            except Exception:  # unreachable or misbehaving: the dashboard shows it as such
                new = _Hello(
                    old.name if old else node,
                    old.memory_total if old else 0,
                    False,
                    time.monotonic(),
                )
            finally:
                client.close()
            with self._hello_lock:
                self._hello[node] = new

    def _local_used(self) -> int:
        stages = self.model.pipeline.stages
        weights = sum(s.weight_bytes() for s in stages)
        kv = sum(c.nbytes() for s in stages for c in list(s.caches.values()))
        return weights + kv

    def snapshot(self) -> dict[str, Any]:
        st = self.scheduler.stats
        stage_ms, hop_ms = list(st.stage_ms), list(st.hop_ms)
        rows = st.decode_rows or 1.0
        nodes = []
        for i, (node, a, b) in enumerate(self.nodes):
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
                with self._hello_lock:
                    h = self._hello.get(node)
                name = h.name if h else node
                used, total, ok = (
                    self._planned.get(node, 0),
                    (h.memory_total if h else 0),
                    (h.ok if h else True),
                )
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
        return {
            "model": {
                "name": self.model_id,
                "arch": hp.arch,
                "quant": m.file.quant_mix(),
                "n_layer": hp.n_layer,
                "n_ctx": m.n_ctx,
            },
            "nodes": nodes,
            "tokens_per_s": round(st.tokens_per_s(), 2),
            "requests_active": self.scheduler.active,
            "requests_queued": self.scheduler.queued,
            "requests_total": st.requests_total,
        }
