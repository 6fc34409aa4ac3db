"""The cost of one stage on one node, and of one hop between two nodes, in integer nanoseconds.

Integers make sums exact, so equal plans tie exactly and the search can break ties on purpose.

A stage [start, stop) on a node: its accelerator (when it streams faster than the CPU) takes the
trailing layers of the range, as many as fit in its memory with one set of activation buffers
(llama.cpp's -ngl puts the last layers on the GPU too); the output head joins them when every
layer of the stage is there and it still fits. A mixture of experts that does not fit there whole
may instead put every layer there and keep the routed experts of its first layers in RAM
(llama.cpp's --n-cpu-moe): attention and KV, read for every token, on the fast device, and of the
experts only the k of n a token reads come from RAM; the faster of the two is taken. The rest, the token embedding and the buffers stay
in RAM. Time per token = bytes read / bytes per second of the device that holds them, plus a
fixed cost per layer for the operations whose time does not grow with the weights (norms, RoPE,
attention over a short context, the framework's dispatch of a dozen calls).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate

from potluck.planner.footprint import ModelFootprint
from potluck.planner.nodes import Link, Links, NodeInfo, link_between

NS = 1_000_000_000
# Fixed time per layer and decoded token, beyond streaming its weights and KV (norms, RoPE, the
# graph's other small operations). The speed it adds to is timed through the model's own layer
# matrices (node/probe.py model_bytes_per_s), so the matmuls' own per-call cost is already in that
# figure. Measured with ggml on SmolLM2 at 1 thread: on a Zen 3 at short contexts ≈ 7 µs per
# layer; on a Zen 5 at 64-192 positions, with the KV reads counted, 15-18 µs (7.5-8.0 ms per
# token where its bytes at the probed speed give 7.1-7.4). On an accelerator the same calls are
# kernel launches: an estimate, not measured here (no GPU).
CPU_LAYER_NS = 15_000
GPU_LAYER_NS = 30_000
# Per decoded token and stage on a node other than the head: the Python around its
# compute — the request read and checked, the token sampled, the reply relayed — and the data
# connection's system calls. Measured over loopback and veth links (bench/bench_plan.py, Zen 5):
# a pool's token took 0.2-0.9 ms more than its stages' compute and hops, a worker alone 0.4-0.9
# ms more than its compute.
REMOTE_STAGE_NS = 300_000
DECODE, PROMPT = "decode", "prompt"  # what a plan's stages are balanced for (CostModel)


def _ns(nbytes: int, bytes_per_s: float) -> int:
    return round(nbytes * NS / bytes_per_s)


@dataclass(frozen=True)
class StageCost:
    """Layers [start, stop) on `node`; layers [gpu_start, stop) on its accelerator."""

    node: NodeInfo
    start: int
    stop: int
    gpu_start: int
    head_on_gpu: bool
    weight_bytes: int  # layers, plus the embedding on the first stage and the head on the last
    kv_bytes: int
    buffer_bytes: int  # once in RAM, and once more on the accelerator when it holds layers
    ram_bytes: int  # all of the above that sits in RAM
    gpu_bytes: int  # ... and on the accelerator (always within its memory)
    compute_ns: int  # per decoded token
    prompt_ns: int  # per prompt token, in proportion: the layers' bytes (a prompt's work is its
    # layers' matmuls; the head runs once per prompt and the fixed per-layer cost is shared by the
    # micro-batch's rows)
    balance_ns: int  # what the search evens out between stages: compute_ns or prompt_ns
    ram_experts: int = 0  # the first that many of the accelerator's layers keep experts in RAM

    @property
    def fits(self) -> bool:
        return self.ram_bytes <= self.node.memory_bytes

    @property
    def n_gpu_layers(self) -> int:
        return self.stop - self.gpu_start


class CostModel:
    """Stage and hop costs of one model on a fixed list of nodes (indexed as given)."""

    def __init__(
        self,
        model: ModelFootprint,
        nodes: list[NodeInfo],
        links: Links,
        balance: str = DECODE,
        head: str | None = None,
    ) -> None:
        """balance: which stages the search makes even where one stream's time ties — DECODE
        (many streams decoding at once: `potluck serve`) or PROMPT (prompt micro-batches through
        the stages: one conversation, where the split does not change its decode time). head:
        the name of the node that runs the generation (default: the first of `nodes`)."""
        if balance not in (DECODE, PROMPT):
            raise ValueError(f"balance must be {DECODE!r} or {PROMPT!r}, got {balance!r}")
        self.model, self.nodes, self.balance = model, nodes, balance
        names = [n.name for n in nodes]
        self.head = names.index(head) if head in names else (0 if head is None else -1)
        n = model.n_layer
        held = [w + k for w, k in zip(model.layer_weight_bytes, model.layer_kv_bytes, strict=True)]
        self._held = [0, *accumulate(held)]  # prefix sums: bytes of layers [0, i)
        self._weights = [0, *accumulate(model.layer_weight_bytes)]
        self._kv = [0, *accumulate(model.layer_kv_bytes)]
        self._read = [0, *accumulate(model.layer_read_bytes)]
        # the routed experts' bytes held and read (all 0 for a dense model)
        self._x = [0, *accumulate(model.layer_expert_bytes or (0,) * n)]
        self._xr = [0, *accumulate(model.layer_expert_read_bytes or (0,) * n)]
        # per node, per stop: the first layer its accelerator can hold with [gpu_start, stop)
        self._gpu_from = [[self._gpu_start(node, e) for e in range(n + 1)] for node in nodes]
        self.links: list[list[Link]] = [
            [link_between(links, a.name, b.name) for b in nodes] for a in nodes
        ]

    def _gpu_start(self, node: NodeInfo, stop: int) -> int:
        if not node.uses_gpu:
            return stop
        room = node.gpu_memory_bytes - self.model.buffer_bytes
        if room < 0:
            return stop
        # smallest s with held[s:stop] <= room, i.e. prefix[s] >= prefix[stop] - room; and at
        # most the node's -ngl layers
        fits = min(stop, bisect_left(self._held, self._held[stop] - room))
        return max(fits, stop - node.max_gpu_layers)

    def stage(self, i: int, start: int, stop: int) -> StageCost:
        """Layers [start, stop) on node i (0 <= start < stop <= n_layer): its accelerator takes
        the trailing whole layers that fit; or, for a mixture of experts whose stage does not fit
        there whole, every layer with the routed experts of the first ones left in RAM
        (--n-cpu-moe), whichever decodes faster."""
        s = max(start, self._gpu_from[i][stop])
        whole = self._cost(i, start, stop, s, s)
        node = self.nodes[i]
        if s == start or not node.uses_gpu or not self._x[-1] or stop - start > node.max_gpu_layers:
            return whole
        room = node.gpu_memory_bytes - self.model.buffer_bytes
        # the first c whose experts of [c, stop) fit beside every layer's other tensors and KV
        need = self._held[stop] - self._held[start] - room  # experts that must stay in RAM
        c = bisect_left(self._x, self._x[start] + need, lo=start)
        if c > stop:  # even without any expert, the layers do not fit
            return whole
        split = self._cost(i, start, stop, start, c)
        return split if split.compute_ns < whole.compute_ns else whole

    def _cost(self, i: int, start: int, stop: int, s: int, c: int) -> StageCost:
        """Layers [s, stop) on node i's accelerator, the routed experts of [s, c) of them in RAM."""
        m, node = self.model, self.nodes[i]
        first, last = start == 0, stop == m.n_layer
        on_gpu = s < stop
        experts = self._x[c] - self._x[s]  # in RAM although their layers are on the GPU
        gpu = self._held[stop] - self._held[s] - experts + (m.buffer_bytes if on_gpu else 0)
        head_on_gpu = last and on_gpu and s == start and gpu + m.head_bytes <= node.gpu_memory_bytes
        if head_on_gpu:
            gpu += m.head_bytes
        ram = self._held[s] - self._held[start] + experts + m.buffer_bytes
        ram += (m.embd_bytes if first else 0) + (m.head_bytes if last and not head_on_gpu else 0)
        ram -= 0 if head_on_gpu else m.shared_bytes(start, stop)
        expert_read = self._xr[c] - self._xr[s]
        cpu_read = self._read[s] - self._read[start] + (m.embd_read_bytes if first else 0)
        cpu_read += expert_read
        gpu_read = self._read[stop] - self._read[s] - expert_read
        if last:
            if head_on_gpu:
                gpu_read += m.head_read_bytes
            else:
                cpu_read += m.head_read_bytes
        compute = _ns(cpu_read, node.cpu_bytes_per_s) + (s - start) * CPU_LAYER_NS
        compute += REMOTE_STAGE_NS if i != self.head else 0
        if gpu_read:
            compute += _ns(gpu_read, node.gpu_bytes_per_s) + (stop - s) * GPU_LAYER_NS
        # (every weight: a mixture of experts' prompt reads nearly all of its experts)
        prompt = _ns(self._weights[s] - self._weights[start] + experts, node.cpu_bytes_per_s)
        if s < stop:
            prompt += _ns(self._weights[stop] - self._weights[s] - experts, node.gpu_bytes_per_s)
        weights = self._weights[stop] - self._weights[start]
        weights += (m.embd_bytes if first else 0) + (m.head_bytes if last else 0)
        weights -= m.shared_bytes(start, stop)
        return StageCost(
            node=node,
            start=start,
            stop=stop,
            gpu_start=s,
            head_on_gpu=head_on_gpu,
            weight_bytes=weights,
            kv_bytes=self._kv[stop] - self._kv[start],
            buffer_bytes=m.buffer_bytes * (2 if on_gpu else 1),
            ram_bytes=ram,
            gpu_bytes=gpu,
            compute_ns=compute,
            prompt_ns=prompt,
            balance_ns=compute if self.balance == DECODE else prompt,
            ram_experts=c - s,
        )

    def hop_ns(self, i: int, j: int) -> int:
        """One token's hidden state from node i's stage to node j's."""
        link = self.links[i][j]
        return round(link.seconds(self.model.wire_bytes) * NS)

    def paced_ns(self, first: int, total_ns: int) -> int:
        """One stream's time per token on a route that starts on node `first` and takes total_ns
        (its stages and hops in turn). The head keeps one decode step chained ahead of the one in
        flight (engine/scheduler.py, follow-ups): the request for token k reaches the first node
        a round trip after token k - 2 passed through it, so two tokens take at least one cycle
        plus that round trip. Measured: SmolLM2 on one worker 5 ms away, 7.4 ms of compute per
        token and a 10.9 ms round trip: 9.0-9.3 ms per token; this gives 9.15."""
        if first == self.head:
            return total_ns
        rtt = 2 * round(self.links[self.head][first].latency_s * NS) if self.head >= 0 else 0
        return max(total_ns, (total_ns + rtt) // 2)

    def return_ns(self, i: int, j: int) -> int:
        """One token id from the last stage (node i) back to the first (node j)."""
        link = self.links[i][j]
        return round(link.seconds(self.model.token_wire_bytes) * NS)

    def transfer_ns(self, i: int, j: int, nbytes: int) -> int:
        """The bandwidth part of a hop alone: what limits throughput once messages overlap."""
        return _ns(nbytes, self.links[i][j].bytes_per_s)
