"""A pipeline whose stages all run in this process (one machine, or in-process splits)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np

from potluck.engine.chain import submit_after
from potluck.engine.contract import Assignment, Held, NodeStatus
from potluck.model.stage import SeqChunk, Stage, sample_rows
from potluck.sampling import Accepted, Sampler

if TYPE_CHECKING:
    from potluck.transport.auth import PoolAuth
    from potluck.transport.client import NodeClient


class LocalPipeline:
    """Stages chained in this process: the first takes token ids, the last returns logits."""

    depth = 1  # one process computes one batch at a time: nothing gains from a second in flight
    chains = False  # submit_next waits for the token here
    supports_logprobs = True
    plan_id = ""  # no pool: nothing below carries a plan
    auth: PoolAuth | None = None

    def __init__(self, stages: Sequence[Stage]) -> None:
        self.stages = list(stages)

    # nothing remote: no plan, no nodes, no per-stage timings (the step is this machine's compute)
    @property
    def assignments(self) -> list[Assignment]:
        return []

    @property
    def nodes(self) -> list[str]:
        return []

    @property
    def clients(self) -> list[NodeClient]:
        return []

    @property
    def held(self) -> dict[str, Held]:
        return {}

    @property
    def node_status(self) -> dict[str, NodeStatus]:
        return {}

    @property
    def last_stage_ms(self) -> list[float]:
        return []

    @property
    def last_hop_ms(self) -> list[float]:
        return []

    def forward(
        self,
        tokens: np.ndarray,
        chunks: Sequence[SeqChunk],
        logits_rows: np.ndarray | None = None,
        hidden: bool = False,
    ) -> np.ndarray:
        x = tokens
        for stage in self.stages[:-1]:
            x = stage(x, chunks)
        return self.stages[-1](x, chunks, logits_rows, hidden=hidden)

    def step(
        self,
        tokens: np.ndarray,
        chunks: Sequence[SeqChunk],
        samplers: Mapping[int, Sampler],
        histories: Mapping[int, Sequence[int]],
    ) -> list[int]:
        """One forward of the chunks; one sampled token per chunk (from its last row), -1 for a
        chunk whose sequence has no sampler here (an earlier prompt micro-batch)."""
        if not any(c.seq_id in samplers for c in chunks):  # an early prompt micro-batch
            self.forward(tokens, chunks, np.empty(0, np.int64))  # no output head
            return [-1] * len(chunks)
        last = self.stages[-1]
        if not any(c.draft for c in chunks):
            logits = self.forward(tokens, chunks)
            return [
                samplers[c.seq_id].sample(row, histories.get(c.seq_id, ()), last.position(c.seq_id))
                if c.seq_id in samplers
                else -1
                for row, c in zip(logits, chunks, strict=True)
            ]
        logits = self.forward(tokens, chunks, sample_rows(chunks))
        out: list[int] = []
        at = 0
        for c in chunks:
            rows = logits[at : at + len(c.draft) + 1]
            at += len(rows)
            if c.seq_id not in samplers:
                out.append(-1)
                continue
            s, hist = samplers[c.seq_id], histories.get(c.seq_id, ())
            end = last.position(c.seq_id)  # the position after the chunk
            if c.draft:
                out.append(Accepted(s.verify(rows, c.draft, hist, end - len(c.draft))))
            else:
                out.append(s.sample(rows[0], hist, end))
        return out

    def submit(
        self,
        tokens: np.ndarray,
        chunks: Sequence[SeqChunk],
        samplers: Mapping[int, Sampler],
        histories: Mapping[int, Sequence[int]],
    ) -> Future[list[int]]:
        """`step` as a future; here it runs now, in the caller's thread."""
        fut: Future[list[int]] = Future()
        try:
            fut.set_result(self.step(tokens, chunks, samplers, histories))
        except BaseException as exc:  # the caller sees it from fut.result()
            fut.set_exception(exc)
        return fut

    def submit_next(
        self,
        prev: Future[list[int]],
        chunks: Sequence[SeqChunk],
        samplers: Mapping[int, Sampler],
        histories: Mapping[int, Sequence[int]],
        stop_ids: Collection[int] = frozenset(),
    ) -> Future[list[int]]:
        return submit_after(self, prev, chunks, samplers, histories, stop_ids)

    def drop(self, seq_id: int) -> None:
        for stage in self.stages:
            stage.drop(seq_id)

    def fail_pending(self, exc: BaseException) -> None:
        """Nothing is ever pending: `submit` computes before it returns."""

    def abandon(self) -> None:
        """Nothing to hang up."""

    def close(self) -> None:
        """Nothing to let go: the stages' memory goes with them."""
