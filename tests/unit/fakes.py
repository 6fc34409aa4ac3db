"""In-memory stand-ins for a pipeline, a node's link and a model: no model file, no sockets.

FakePipeline implements potluck.engine.contract.Pipeline. Each sequence's "KV cache" is the list
of ids fed to it so far, and a row's logits peak on `next_token(cache)`, a hash of every id before
it in order: a batch fed twice, lost or out of order changes every token after it, as a real
model's cache would. Batches complete at once, or are held in flight until the test releases
them (`hold=True`), or fail (`fail_if`, `submit_raises`). Everything it was sent is in `sent`.
"""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from potluck.engine.chain import submit_after
from potluck.engine.contract import Assignment, Held, NodeStatus, Pipeline
from potluck.errors import NodeError
from potluck.model.stage import SeqChunk
from potluck.sampling import Accepted, Sampler
from potluck.transport import potluck_pb2 as pb

VOCAB = 97
PEAK = 5.0  # the logit of the fake model's next token; every other logit is 0


def next_token(ids: Sequence[int]) -> int:
    """The greedy token after a cache holding `ids`: depends on every id and on their order."""
    h = 0
    for t in ids:
        h = (h * 31 + int(t) + 1) % 1_000_003
    return h % VOCAB


def alone(prompt: Sequence[int], n: int) -> list[int]:
    """The n tokens greedy decoding gives after `prompt`, one sequence by itself."""
    ids, out = list(prompt), []
    for _ in range(n):
        out.append(next_token(ids))
        ids.append(out[-1])
    return out


def logits_after(ids: Sequence[int]) -> np.ndarray:
    """(VOCAB,) fp32: PEAK at next_token(ids), 0 elsewhere."""
    row = np.zeros(VOCAB, np.float32)
    row[next_token(ids)] = PEAK
    return row


@dataclass(frozen=True)
class Sent:
    """One batch as a FakePipeline received it."""

    ids: tuple[int, ...]
    chunks: tuple[SeqChunk, ...]
    sampled: frozenset[int]  # the sequences it samples a token for (those with a sampler)

    @property
    def seq_ids(self) -> tuple[int, ...]:
        return tuple(c.seq_id for c in self.chunks)


@dataclass
class _Held:
    sent: Sent
    samplers: Mapping[int, Sampler]
    histories: Mapping[int, Sequence[int]]
    out: Future[list[int]]


class FakeClient:
    """A node's link as the heartbeat sees it: `hello` answers, or raises NodeError when `down`."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.down = False
        self.hellos: list[tuple[str, tuple[str, ...]]] = []  # (head_name, plan_ids) asked
        self.pinged = threading.Event()  # set at every hello

    def hello(
        self,
        head_name: str = "",
        plan_ids: Sequence[str] = (),
        timeout: float = 5.0,
        authenticate: bool = True,
    ) -> pb.HelloReply:
        self.hellos.append((head_name, tuple(plan_ids)))
        self.pinged.set()
        if self.down:
            raise NodeError(f"node {self.address} is unreachable (fake: down)")
        return pb.HelloReply(
            node_name=f"box-{self.address}", devices=[pb.Device(memory_bytes=8 << 30)]
        )


class FakePipeline:
    """A Pipeline over `nodes` (host:port names; none = all in this process) computing with
    `next_token` instead of a model."""

    auth = None
    held: Mapping[str, Held] = {}
    node_status: Mapping[str, NodeStatus] = {}  # as loaded: the heartbeat (failover) keeps it up

    def __init__(
        self,
        nodes: Sequence[str] = (),
        *,
        depth: int = 1,
        chains: bool = False,
        hold: bool = False,
        supports_logprobs: bool = True,
        plan_id: str = "",
    ) -> None:
        self.depth, self.chains, self.hold = depth, chains, hold
        self.supports_logprobs, self.plan_id = supports_logprobs, plan_id
        self.nodes = list(nodes)
        self.clients = [FakeClient(n) for n in nodes]
        self.assignments = [Assignment(n, i, i + 1) for i, n in enumerate(nodes)]
        self.stages: list = []  # no ggml stage runs in this process
        self.last_stage_ms: list[float] = []
        self.last_hop_ms: list[float] = []
        self.caches: dict[int, list[int]] = {}
        self.sent: list[Sent] = []
        self.dropped: list[int] = []
        self.misuse: list[str] = []  # contract breaches seen (a test asserts it stays empty)
        self.fail_if: Callable[[Sent], BaseException | None] | None = None
        self.submit_raises: BaseException | None = None
        self.abandoned = self.closed = False
        self.max_held = 0
        self._held: list[_Held] = []
        self._cond = threading.Condition(threading.RLock())

    # -- computing ----------------------------------------------------------------------------
    def forward(
        self,
        tokens: np.ndarray,
        chunks: Sequence[SeqChunk],
        logits_rows: np.ndarray | None = None,
    ) -> np.ndarray:
        """Feed the chunks' ids to their caches; the logits of each chunk's last row."""
        assert logits_rows is None or len(logits_rows) == 0, "fake: only last rows or none"
        ids = [int(t) for t in tokens]
        assert len(ids) == sum(c.n for c in chunks), (ids, chunks)
        rows, i = [], 0
        with self._cond:
            for c in chunks:
                if c.fork is not None:  # a forked prefix: the source's first pos ids
                    src = self.caches.get(c.fork, [])
                    if len(src) < c.pos:
                        self.misuse.append(f"fork of {c.pos} positions of a {len(src)}-long cache")
                    self.caches[c.seq_id] = list(src[: c.pos])
                cache = self.caches.setdefault(c.seq_id, [])
                if c.pos > len(cache):
                    self.misuse.append(f"chunk at {c.pos} for a {len(cache)}-long cache")
                elif c.pos >= 0:
                    del cache[c.pos :]  # a rewind
                cache.extend(ids[i : i + c.n])
                i += c.n
                rows.append(logits_after(cache))
        if logits_rows is not None:
            return np.empty((0, VOCAB), np.float32)
        return np.stack(rows)

    def step(
        self,
        tokens: np.ndarray,
        chunks: Sequence[SeqChunk],
        samplers: Mapping[int, Sampler],
        histories: Mapping[int, Sequence[int]],
    ) -> list[int]:
        return self.submit(tokens, chunks, samplers, histories).result()

    def submit(
        self,
        tokens: np.ndarray,
        chunks: Sequence[SeqChunk],
        samplers: Mapping[int, Sampler],
        histories: Mapping[int, Sequence[int]],
    ) -> Future[list[int]]:
        if self.submit_raises is not None:
            raise self.submit_raises
        sent = Sent(
            tuple(int(t) for t in tokens),
            tuple(chunks),
            frozenset(c.seq_id for c in chunks if c.seq_id in samplers),
        )
        job = _Held(sent, samplers, histories, Future())
        with self._cond:
            for c in chunks:
                if c.seq_id in self.dropped:
                    self.misuse.append(f"batch for sequence {c.seq_id} after it was dropped")
            self.sent.append(sent)
            if self.hold:
                self._held.append(job)
                self.max_held = max(self.max_held, len(self._held))
                self._cond.notify_all()
                return job.out
        self._run(job)
        return job.out

    def submit_next(
        self,
        prev: Future[list[int]],
        chunks: Sequence[SeqChunk],
        samplers: Mapping[int, Sampler],
        histories: Mapping[int, Sequence[int]],
        stop_ids: Collection[int] = frozenset(),
    ) -> Future[list[int]]:
        return submit_after(self, prev, chunks, samplers, histories, stop_ids)

    def _run(self, job: _Held) -> None:
        """Compute a batch and complete its future (outside the lock: callbacks run here)."""
        exc = self.fail_if(job.sent) if self.fail_if is not None else None
        if exc is not None:
            job.out.set_exception(exc)
            return
        sent = job.sent
        if not sent.sampled:  # an early prompt micro-batch: no output head
            self.forward(np.array(sent.ids, np.int64), sent.chunks, np.empty(0, np.int64))
            job.out.set_result([-1] * len(sent.chunks))
            return
        self.forward(np.array(sent.ids, np.int64), sent.chunks)
        out: list[int] = []
        with self._cond:
            for c in sent.chunks:
                if c.seq_id not in job.samplers:
                    out.append(-1)
                    continue
                s, hist = job.samplers[c.seq_id], job.histories.get(c.seq_id, ())
                cache = self.caches[c.seq_id]
                end = len(cache)  # the position after the chunk
                # the logits after the id before each draft, and after the last id
                rows = np.stack(
                    [logits_after(cache[: end - k]) for k in range(len(c.draft), -1, -1)]
                )
                if c.draft:
                    out.append(Accepted(s.verify(rows, c.draft, hist, end - len(c.draft))))
                else:
                    out.append(s.sample(rows[0], hist, end))
        job.out.set_result(out)

    # -- batches held in flight ---------------------------------------------------------------
    @property
    def in_flight(self) -> list[Sent]:
        with self._cond:
            return [h.sent for h in self._held]

    def wait_held(self, n: int = 1, timeout: float = 5.0) -> None:
        """Wait until at least n batches are held (the caller submits from another thread)."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._held) >= n, timeout):
                raise TimeoutError(f"{len(self._held)} batches held after {timeout} s, wanted {n}")

    def release(self, n: int | None = None) -> int:
        """Compute the first n held batches (all when None), in the order they were sent."""
        done = 0
        while n is None or done < n:
            with self._cond:
                if not self._held:
                    break
                job = self._held.pop(0)
            self._run(job)
            done += 1
        return done

    def release_one(self, rng: random.Random) -> bool:
        """Compute one held batch picked by rng among those with no earlier batch of the same
        sequence still held (the contract keeps a sequence's batches in order); False if none."""
        with self._cond:
            if not self._held:
                return False
            ready = [
                h
                for i, h in enumerate(self._held)
                if not set(h.sent.seq_ids) & {s for e in self._held[:i] for s in e.sent.seq_ids}
            ]
            job = rng.choice(ready)
            self._held.remove(job)
        self._run(job)
        return True

    # -- letting go ---------------------------------------------------------------------------
    def drop(self, seq_id: int) -> None:
        with self._cond:
            if any(seq_id in h.sent.seq_ids for h in self._held):
                self.misuse.append(f"sequence {seq_id} dropped with a batch in flight")
            self.caches.pop(seq_id, None)
            self.dropped.append(seq_id)

    def fail_pending(self, exc: BaseException) -> None:
        with self._cond:
            held, self._held = self._held, []
        for h in held:
            h.out.set_exception(exc)

    def abandon(self) -> None:
        self.abandoned = True

    def close(self) -> None:
        self.closed = True


class Releaser:
    """Releases a held pipeline's batches from a thread of its own, in a random order that keeps
    each sequence's batches in order (seeded: a failure reproduces), until stopped."""

    def __init__(self, pipe: FakePipeline, seed: int = 0) -> None:
        self.pipe, self.rng = pipe, random.Random(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-releaser", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.pipe.wait_held(1, timeout=0.05)
            except TimeoutError:
                continue
            self.pipe.release_one(self.rng)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)


class FakeModel:
    """What the scheduler needs of a model: a pipeline, the context size and sequence ids."""

    def __init__(self, pipeline: Pipeline, n_ctx: int = 64) -> None:
        self.pipeline, self.n_ctx = pipeline, n_ctx
        self._ids = itertools.count(1)

    def new_seq_id(self) -> int:
        return next(self._ids)

    kv_bytes_per_token = 1  # the prefix cache's budget counts positions here
    state_bytes = 0  # (a hybrid's recurrent state: none)
