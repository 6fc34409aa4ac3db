"""The contract between generation (engine/generate.py, engine/scheduler.py) and a pipeline.

A pipeline computes batches of sequence chunks through a model's layers and gives one result per
chunk: a sampled token, or for a chunk with drafted ids (speculative decoding) an `Accepted` run
of tokens (sampling.py). A chunk also says where its sequence stands (model/stage.py `SeqChunk`:
`pos` rewinds the stages, `fork` starts it from another sequence's prefix); the sequences
themselves, their tokens and samplers, belong to the head's scheduler (engine/scheduler.py). Three kinds implement `Pipeline` in full: LocalPipeline (stages in this process,
engine/local.py), RemotePipeline (a plan over nodes, pool/pipeline.py) and FailoverPipeline (a
remote one that re-plans when a node goes away, pool/failover.py). Callers use only this protocol:
what a kind has nothing for, it gives as an empty value (a local pipeline has no nodes, no clients,
no plan id) or does as a no-op (close). This module imports no network code: the transport types
below are for annotations only, and no wire message appears in the contract (`Held` is what a
node's LoadReply says, converted by pool/pipeline.py).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from potluck.model.stage import SeqChunk, Stage
from potluck.sampling import Sampler

if TYPE_CHECKING:
    from potluck.transport.auth import PoolAuth
    from potluck.transport.client import NodeClient

LOCAL = "local"  # an assignment's node when the layers run in this process
DEFAULT_TIMEOUT_S = 5.0  # a node silent this long is declared gone (the CLI's --failover-timeout)


@dataclass(frozen=True)
class Assignment:
    """Layers [start, stop) on `node` ("local" = this process, else host:port); the last
    n_gpu_layers of them on the node's GPU (Stage's -ngl: one more than the layers puts the
    output head there too), the routed experts of the first ram_experts of those in RAM."""

    node: str
    start: int
    stop: int
    n_gpu_layers: int = 0
    # peers the node asks for the tensors it lacks before this head sends them (the plan's)
    sources: tuple[str, ...] = ()
    ram_experts: int = 0

    def describe(self) -> str:
        n = self.stop - self.start
        gpu = min(self.n_gpu_layers, n)
        device = "cpu" if not gpu else f"{gpu} on its GPU" if gpu < n else "GPU"
        if self.n_gpu_layers > n:
            device += " + output head"
        if self.ram_experts:
            device += f", experts of {self.ram_experts} layers in RAM"
        where = "this machine" if self.node == LOCAL else self.node
        return f"layers {self.start}–{self.stop - 1} → {where} ({device})"


@dataclass(frozen=True)
class Held:
    """What a remote node reported holding once it loaded its stage of a plan."""

    weight_bytes: int  # the stage's weights in memory
    kv_bytes: int  # its KV cache for n_seq sequences at the full context
    rss_bytes: int  # the worker process's resident memory once loaded
    load_seconds: float
    pulled_from: str = ""  # the peer it received its tensors from ("" if none)
    pulled_bytes: int = 0  # how many bytes it received from there
    pull_seconds: float = 0.0


@dataclass(frozen=True)
class NodeStatus:
    """A remote node as its last Hello showed it (the dashboard's view)."""

    name: str  # what the node calls itself
    memory_total: int  # bytes its first device has (RAM for a CPU)
    ok: bool  # it answers


class Pipeline(Protocol):
    """What generation needs from a pipeline, local or spread over nodes."""

    # -- what it is ---------------------------------------------------------------------------
    @property
    def stages(self) -> list[Stage]:
        """The stages computed in this process."""
        ...

    @property
    def depth(self) -> int:
        """How many batches may usefully be in flight at once (the pipelined stages)."""
        ...

    @property
    def chains(self) -> bool:
        """Whether submit_next starts on the pool without a round trip through this machine."""
        ...

    @property
    def supports_logprobs(self) -> bool:
        """Whether sampled tokens carry their logprobs (sampling.Token) when a sampler asks."""
        ...

    @property
    def assignments(self) -> list[Assignment]:
        """The pool's plan, in pipeline order; [] for stages that all run in this process."""
        ...

    @property
    def nodes(self) -> list[str]:
        """The remote nodes of the plan (host:port), in pipeline order."""
        ...

    @property
    def clients(self) -> list[NodeClient]:
        """One link per remote node, in `nodes`' order."""
        ...

    @property
    def held(self) -> Mapping[str, Held]:
        """Per remote node, what it reported holding once it loaded the plan."""
        ...

    @property
    def node_status(self) -> Mapping[str, NodeStatus]:
        """Per remote node, its name, memory and whether it answers (kept up by the heartbeat
        where there is one, else as loaded)."""
        ...

    @property
    def plan_id(self) -> str:
        """The id every message of the plan carries; "" in this process alone."""
        ...

    @property
    def auth(self) -> PoolAuth | None:
        """How this head proves membership to the nodes (pool secret, TLS)."""
        ...

    @property
    def last_stage_ms(self) -> list[float]:
        """Compute time of each stage in the last step (ms); [] when not measured per stage."""
        ...

    @property
    def last_hop_ms(self) -> list[float]:
        """Transfer time into each remote stage in the last step (ms)."""
        ...

    # -- computing ----------------------------------------------------------------------------
    def step(
        self,
        tokens: np.ndarray,
        chunks: Sequence[SeqChunk],
        samplers: Mapping[int, Sampler],
        histories: Mapping[int, Sequence[int]],
    ) -> list[int]:
        """One forward of the chunks; one sampled token per chunk (from its last row; an
        `Accepted` run for a chunk with drafts), -1 for a chunk whose sequence has no sampler
        (an earlier prompt micro-batch)."""
        ...

    def submit(
        self,
        tokens: np.ndarray,
        chunks: Sequence[SeqChunk],
        samplers: Mapping[int, Sampler],
        histories: Mapping[int, Sequence[int]],
    ) -> Future[list[int]]:
        """Start a `step` and return at once. Batches for the same sequence run in submission
        order; batches of different sequences overlap across stages (up to `depth` of them usefully).
        The caller must not submit a sequence's next token before its previous one is known, and
        must not mutate `histories` entries it passed until the future is done."""
        ...

    def submit_next(
        self,
        prev: Future[list[int]],
        chunks: Sequence[SeqChunk],
        samplers: Mapping[int, Sampler],
        histories: Mapping[int, Sequence[int]],
        stop_ids: Collection[int] = frozenset(),
    ) -> Future[list[int]]:
        """The decode step after `prev` for the same sequences (one chunk of one token each),
        whose input ids are the tokens `prev` samples: it may be submitted before they are known.
        Gives [] (nothing computed) when one of them is in `stop_ids`. `histories` hold the ids
        before prev's tokens."""
        ...

    def forward(
        self,
        tokens: np.ndarray,
        chunks: Sequence[SeqChunk],
        logits_rows: np.ndarray | None = None,
        hidden: bool = False,
    ) -> np.ndarray:
        """Logits of the selected rows (default: the last row of each chunk), (rows, n_vocab);
        hidden: their final hidden states after the output norm instead, (rows, n_embd)."""
        ...

    def drop(self, seq_id: int) -> None:
        """Forget a sequence: its KV cache everywhere."""
        ...

    # -- letting go ---------------------------------------------------------------------------
    def fail_pending(self, exc: BaseException) -> None:
        """Fail every batch still in flight with `exc` (a node was declared gone)."""
        ...

    def abandon(self) -> None:
        """Hang up without a word to the nodes (a failover: the first may be the one that hangs)."""
        ...

    def close(self) -> None:
        """Let go of the pool: the nodes free the plan; no-op in this process alone."""
        ...
