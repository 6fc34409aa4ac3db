"""Generations that survive a node going away.

A FailoverPipeline wraps the pool's RemotePipeline. A heartbeat asks every node for a Hello twice
a second; a node that has not answered for `timeout_s` (or whose link broke) is declared gone, and
the batches in flight fail over: the head re-plans on the survivors (`connect`), which loads the
missing layers there, replays each live sequence's tokens (the ones whose batches completed) to
rebuild the KV caches, and sends the failed batches again. Callers of `submit` see a pause, not an
error. When the survivors cannot run the model, every waiting batch and every later call fails
with PoolLostError, within the timeout: nothing hangs.

With no `connect` (failover off) the heartbeat still watches: a node silent for `timeout_s` ends
every waiting batch and later call with PoolLostError, so that a hung machine never hangs the
head.

Replay gives the same tokens as a run without the fault, greedy or seeded (a token's random draw
depends only on the seed and its position: sampling.uniform_at, so the new last stage draws what
the old one would have). Rewinds (cached prefixes, rejected drafts) cut the replay of their
sequence; a fork copies its source's prefix into it (`_confirm`).

One state machine (heartbeat, declaring nodes gone, re-plan, replay, resend) over state guarded by
one lock; over 400 lines on purpose: split, the lock's reach would cross files.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import numpy as np

from potluck.engine.chain import follow_inputs
from potluck.engine.contract import DEFAULT_TIMEOUT_S, Assignment, Held, NodeStatus, Pipeline
from potluck.errors import PoolLostError, PotluckError, StepRefused
from potluck.model.stage import SeqChunk, Stage
from potluck.pool.pipeline import status_of
from potluck.sampling import Sampler
from potluck.transport.auth import PoolAuth
from potluck.transport.client import NodeClient, NodeError

OFF_TIMEOUT_S = 30.0  # failover off: how long a node may stay silent before the request ends
STATUS_SILENT_S = 2.0  # a node silent this long shows as not answering (the dashboard)
MAX_RECOVERIES_IN_A_ROW = 4  # another node failing during a recovery starts it over, this often


log = logging.getLogger(__name__)
_LIVE: weakref.WeakSet[FailoverPipeline] = weakref.WeakSet()


@atexit.register
def _close_live() -> None:
    """Stop every heartbeat and recovery at exit: gRPC calls still starting in background threads
    while the interpreter tears down make gRPC's C++ core abort."""
    for pipe in list(_LIVE):
        with contextlib.suppress(Exception):  # best effort at exit
            pipe.close()


def _off_error(who: str, reason: str) -> PoolLostError:
    return PoolLostError(
        f"{who} went away ({reason}) and failover is off (--failover-timeout 0): start the "
        "request again, or turn failover on to go on without it"
    )


@dataclass(frozen=True)
class FailoverEvent:
    """One recovery, for the log and bench/RESULTS.md."""

    gone: tuple[str, ...]
    reason: str
    detect_s: float  # from the node's last sign of life to the decision that it is gone
    recover_s: float  # from that decision to the first batch sent on the new plan
    replayed_tokens: int
    assignments: tuple[str, ...]  # the new plan, described


@dataclass
class _Batch:
    tokens: np.ndarray
    chunks: list[SeqChunk]
    samplers: Mapping[int, Sampler]
    histories: Mapping[int, Sequence[int]]
    out: Future[list[int]]
    epoch: int = 0
    # a follow-up step (submit_next): its input ids are what `prev` gives, not `tokens`
    prev: Future[list[int]] | None = None
    stop_ids: Collection[int] = frozenset()
    refused: bool = False  # an answering node refused it once: sent again after a re-plan


@dataclass
class _Health:
    last_ok: float
    probing: bool = False
    gone: bool = False
    reason: str = ""
    last_seen: float = field(default=0.0)
    status: NodeStatus | None = None  # from its last Hello


# (nodes declared gone so far, epoch) -> a new pipeline over the others; raises PotluckError when
# they cannot run the model
Connect = Callable[[frozenset[str], int], Pipeline]


class FailoverPipeline:
    """A Pipeline (engine/generate.py) over a pool that re-plans when a node goes away."""

    supports_logprobs = True

    def __init__(
        self,
        first: Pipeline,
        connect: Connect | None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        on_event: Callable[[FailoverEvent], None] | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"the failover timeout must be positive, got {timeout_s} s")
        self.inner = first
        self.connect, self.timeout_s, self.on_event = connect, timeout_s, on_event
        self.epoch = 0
        self.gone: set[str] = set()
        self.events: list[FailoverEvent] = []
        self._lock = threading.RLock()
        # every batch every stage has computed, as (chunk, its token ids) lists, in order: the replay
        # sends them again with the same shapes, so the rebuilt caches are bit-identical (a prompt
        # batch and single-token steps take different kernels; re-chunking would shift the floats)
        self._confirmed: list[list[tuple[SeqChunk, list[int]]]] = []
        self._lengths: dict[int, int] = {}  # per sequence, the positions its confirmed batches hold
        self._failed: PoolLostError | None = None
        self._redo: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._health: dict[str, _Health] = {}
        self._closed = threading.Event()
        self._shut = False  # close() ran
        self._pings = ThreadPoolExecutor(8, thread_name_prefix="potluck-heartbeat")
        self._watch(first)
        _LIVE.add(self)
        threading.Thread(target=self._recoverer, name="potluck-failover", daemon=True).start()
        threading.Thread(target=self._heartbeat, name="potluck-heartbeat", daemon=True).start()

    # -- the Pipeline protocol --------------------------------------------------------------------
    @property
    def depth(self) -> int:
        return self.inner.depth

    @property
    def stages(self) -> list[Stage]:
        return self.inner.stages

    @property
    def assignments(self) -> list[Assignment]:
        return list(self.inner.assignments)

    @property
    def held(self) -> dict[str, Held]:
        """Per node, what it holds of the current plan."""
        return dict(self.inner.held)

    @property
    def last_stage_ms(self) -> list[float]:
        return list(self.inner.last_stage_ms)

    @property
    def last_hop_ms(self) -> list[float]:
        return list(self.inner.last_hop_ms)

    @property
    def auth(self) -> PoolAuth | None:
        """How this head proves pool membership (the current plan's)."""
        return self.inner.auth

    @property
    def nodes(self) -> list[str]:
        return list(self.inner.nodes)

    @property
    def clients(self) -> list[NodeClient]:
        return list(self.inner.clients)

    @property
    def node_status(self) -> dict[str, NodeStatus]:
        """The current plan's nodes as the heartbeat last saw them: one silent for STATUS_SILENT_S
        (or declared gone) is not ok."""
        out = dict(self.inner.node_status)
        now = time.monotonic()
        for node, h in list(self._health.items()):
            seen = h.status or out.get(node) or NodeStatus(node, 0, True)
            ok = not h.gone and now - h.last_ok < STATUS_SILENT_S
            out[node] = dataclasses.replace(seen, ok=ok)
        return out

    @property
    def plan_id(self) -> str:
        return self.inner.plan_id

    def submit(
        self,
        tokens: np.ndarray,
        chunks: Sequence[SeqChunk],
        samplers: Mapping[int, Sampler],
        histories: Mapping[int, Sequence[int]],
    ) -> Future[list[int]]:
        out: Future[list[int]] = Future()
        self._launch(_Batch(tokens, list(chunks), samplers, histories, out))
        return out

    @property
    def chains(self) -> bool:
        return self.inner.chains

    def submit_next(
        self,
        prev: Future[list[int]],
        chunks: Sequence[SeqChunk],
        samplers: Mapping[int, Sampler],
        histories: Mapping[int, Sequence[int]],
        stop_ids: Collection[int] = frozenset(),
    ) -> Future[list[int]]:
        out: Future[list[int]] = Future()
        placeholder = np.zeros(len(chunks), np.int64)
        self._launch(
            _Batch(
                placeholder, list(chunks), samplers, histories, out, prev=prev, stop_ids=stop_ids
            )
        )
        return out

    def step(
        self,
        tokens: np.ndarray,
        chunks: Sequence[SeqChunk],
        samplers: Mapping[int, Sampler],
        histories: Mapping[int, Sequence[int]],
    ) -> list[int]:
        return self.submit(tokens, chunks, samplers, histories).result()

    def forward(
        self,
        tokens: np.ndarray,
        chunks: Sequence[SeqChunk],
        logits_rows: np.ndarray | None = None,
        hidden: bool = False,
    ) -> np.ndarray:
        """Logits (perplexity) are not replayed: a node going away ends the call with an error."""
        with self._lock:
            self._raise_if_failed()
            inner = self.inner
        logits = inner.forward(tokens, chunks, logits_rows, hidden)
        with self._lock:
            self._confirm(chunks, tokens)
        return logits

    def drop(self, seq_id: int) -> None:
        with self._lock:
            kept = [[(c, t) for c, t in batch if c.seq_id != seq_id] for batch in self._confirmed]
            self._confirmed = [batch for batch in kept if batch]
            self._lengths.pop(seq_id, None)
            inner = self.inner
        with contextlib.suppress(PotluckError):  # a node that is gone took its caches with it
            inner.drop(seq_id)

    def fail_pending(self, exc: BaseException) -> None:
        self.inner.fail_pending(exc)

    def abandon(self) -> None:
        """Stop watching and hang up without a word to the nodes."""
        self._stop()
        with contextlib.suppress(PotluckError):
            self.inner.abandon()

    def close(self) -> None:
        """Stop watching and let the pool go (the nodes free this plan). Once: later calls do
        nothing (a command closes its model, and the exit hook closes every pool left)."""
        given_up = self._closed.is_set()  # the pool was lost: its plan was hung up on already
        if self._stop() and not given_up:
            with contextlib.suppress(PotluckError):
                self.inner.close()

    def _stop(self) -> bool:
        """Stop the heartbeat and the recovery thread; False when that was done before."""
        if self._shut:
            return False
        self._shut = True
        self._closed.set()
        self._redo.put(None)
        self._pings.shutdown(wait=False, cancel_futures=True)
        return True

    # -- sending and settling ---------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise self._failed

    def _launch(self, b: _Batch) -> None:
        if b.prev is not None and b.prev.done():  # its input ids are known: an ordinary step
            self._resolve(b, b.prev)
            return
        with self._lock:
            if self._failed is not None:
                b.out.set_exception(self._failed)
                return
            b.epoch = self.epoch
            inner = self.inner
            if b.prev is None:
                fut = inner.submit(b.tokens, b.chunks, b.samplers, b.histories)
            else:
                fut = inner.submit_next(b.prev, b.chunks, b.samplers, b.histories, b.stop_ids)
        fut.add_done_callback(lambda f: self._settle(b, f))

    def _resolve(self, b: _Batch, prev: Future[list[int]]) -> None:
        """Launch a follow-up step whose previous one is done as an ordinary step with its ids."""
        exc = prev.exception()
        if exc is not None:
            b.out.set_exception(exc)
            return
        inputs = follow_inputs(prev.result(), b.chunks, b.histories, b.stop_ids)
        if inputs is None:
            b.out.set_result([])  # the generation ended with the previous step
            return
        b.tokens, b.histories = inputs
        b.prev = None
        self._launch(b)

    def _settle(self, b: _Batch, f: Future[list[int]]) -> None:
        exc = f.exception()
        if exc is None and b.prev is not None and not f.result():
            b.out.set_result([])  # a skipped follow-up step: nothing was computed
            return
        if exc is None and b.prev is not None:
            # A follow-up step's input ids, for the replay: its previous step settled first (the
            # first node answers that one before it runs this one, on the same connection).
            if not b.prev.done() or b.prev.exception() is not None:
                exc = PotluckError("internal: a follow-up step finished before the step it follows")
            else:
                b.tokens = np.array([int(t) for t in b.prev.result()], np.int64)
        if exc is None:
            with self._lock:
                current = b.epoch == self.epoch
                if current:
                    self._confirm(b.chunks, b.tokens)
            if current:
                b.out.set_result(f.result())
            else:  # it finished on the old plan after the replay was taken: run it on the new one
                self._redo.put(b)
        elif isinstance(exc, StepRefused) and b.refused and b.epoch == self.epoch:
            # an answering node refused the step itself, again after a re-plan (which sends
            # every sequence's settings and ids afresh: what a lost one needed): the same step
            # would be refused for ever, so the request fails with the node's reason
            b.out.set_exception(exc)
        elif (
            isinstance(exc, StepRefused) and self.connect is not None and not self._closed.is_set()
        ):
            b.refused = True
            self._redo.put(b)
        elif isinstance(exc, NodeError) and self.connect is None:
            # failover off: a call's own error is the answer (a node that still answers may have
            # refused it); only a node the heartbeat declares gone ends the pool for good
            b.out.set_exception(
                self._failed or NodeError(f"{exc} (failover is off: --failover-timeout 0)")
            )
        elif isinstance(exc, NodeError) and not self._closed.is_set():
            self._redo.put(b)  # a node failed: the recovery thread re-plans and sends it again
        else:
            b.out.set_exception(exc)

    def _confirm(self, chunks: Sequence[SeqChunk], tokens: np.ndarray) -> None:
        """Under self._lock: remember a computed batch for the replay. A chunk that rewinds its
        sequence cuts the sequence's batches to its position first; one that forks another's
        prefix becomes a copy of that sequence's batches up to its position (the replay computes
        the prefix again for it: the source may be gone by then)."""
        batch = []
        for c, ids in zip(chunks, _split(tokens, chunks), strict=True):
            if c.fork is not None:
                self._cut(c.seq_id, 0)
                for piece, part in self._pieces(c.fork, c.pos):
                    self._confirmed.append([(dataclasses.replace(piece, seq_id=c.seq_id), part)])
                self._lengths[c.seq_id] = c.pos
                c = dataclasses.replace(c, fork=None)
            elif 0 <= c.pos < self._lengths.get(c.seq_id, 0):
                self._cut(c.seq_id, c.pos)
            batch.append((c, ids))
            at = c.pos if c.pos >= 0 else self._lengths.get(c.seq_id, 0)
            self._lengths[c.seq_id] = at + c.n
        self._confirmed.append(batch)

    def _pieces(self, seq_id: int, keep: int) -> list[tuple[SeqChunk, list[int]]]:
        """The confirmed chunks of `seq_id` that hold its first `keep` positions, in order (the
        last one cut short where it reaches past them)."""
        out: list[tuple[SeqChunk, list[int]]] = []
        at = 0
        for batch in self._confirmed:
            for c, ids in batch:
                if c.seq_id != seq_id or at >= keep:
                    continue
                n = min(c.n, keep - at)
                out.append((c if n == c.n else dataclasses.replace(c, n=n), ids[:n]))
                at += n
        return out

    def _cut(self, seq_id: int, keep: int) -> None:
        """Under self._lock: the confirmed batches keep `seq_id`'s first `keep` positions only."""
        self._lengths[seq_id] = keep
        pieces = iter(self._pieces(seq_id, keep))  # one per chunk of it, in order, while kept
        out = []
        for batch in self._confirmed:
            part = []
            for c, ids in batch:
                if c.seq_id != seq_id:
                    part.append((c, ids))
                elif (piece := next(pieces, None)) is not None:
                    part.append(piece)
            if part:
                out.append(part)
        self._confirmed = out

    # -- recovery ---------------------------------------------------------------------------------
    def _recoverer(self) -> None:
        while True:
            b = self._redo.get()
            if self._closed.is_set():
                if b is not None:
                    b.out.set_exception(self._failed or PotluckError("the pool was closed"))
                continue
            with self._lock:
                if b is None or b.epoch == self.epoch:  # the first failure of this plan
                    if b is None and not any(h.gone for h in self._health.values()):
                        continue
                    self._recover()
            if b is not None:
                self._launch(b)

    def _recover(self) -> None:
        """Under self._lock: declare the dead gone, connect a new plan, replay. Sets _failed when
        the survivors cannot run the model."""
        if self._failed is not None:
            # failover off, and the heartbeat declared a node gone: hang up (no goodbye to a
            # node that may hang) and stop watching, as when a batch found it
            if not self._closed.is_set():
                with contextlib.suppress(PotluckError):
                    self.inner.abandon()
                self._closed.set()
            return
        for _ in range(MAX_RECOVERIES_IN_A_ROW):
            t_decide = time.monotonic()
            old = self.inner
            dead, reason, last_seen = self._find_dead(old)
            self.gone |= set(dead)
            with contextlib.suppress(PotluckError):
                old.fail_pending(NodeError(f"failing over: {reason}"))
                old.abandon()  # no goodbye: the first node may be the hung one
            self.epoch += 1
            who = ", ".join(dead) or "a node"
            if self.connect is None:
                self._failed = self._failed or _off_error(who, reason)
                self._closed.set()
                return
            try:
                new = self.connect(frozenset(self.gone), self.epoch)
            except (PotluckError, ValueError, MemoryError) as exc:
                lost = (
                    f"{who} went away and the machines left cannot run the model"
                    if dead
                    else "this head's stages were lost on a node that still answers (another head "
                    "may have taken its place while this one was idle) and re-planning failed"
                )
                self._failed = PoolLostError(f"{lost}: {exc}")
                self._closed.set()  # nothing left to watch
                return
            self.inner = new
            self._watch(new)
            try:
                replayed = self._replay(new)
            except NodeError as exc:  # another node failed during the replay: start over
                reason = str(exc)
                continue
            event = FailoverEvent(
                gone=tuple(dead),
                reason=reason,
                detect_s=max(0.0, t_decide - last_seen) if last_seen else 0.0,
                recover_s=time.monotonic() - t_decide,
                replayed_tokens=replayed,
                assignments=tuple(a.describe() for a in new.assignments),
            )
            self.events.append(event)
            if self.on_event is not None:
                self.on_event(event)
            return
        self._failed = PoolLostError(f"nodes kept failing while recovering: {reason}")
        self._closed.set()  # nothing left to watch

    def _replay(self, pipe: Pipeline) -> int:
        """Send every confirmed batch of the live sequences through the new plan again, in order
        and with the same shapes (no sampling); all in flight at once, so stages overlap."""
        pending = []
        n = 0
        for batch in self._confirmed:
            ids = [t for _, part in batch for t in part]
            n += len(ids)
            chunks = [c for c, _ in batch]
            pending.append(pipe.submit(np.array(ids, np.int64), chunks, {}, {}))
        for fut in pending:
            try:
                fut.result(timeout=max(60.0, 10 * self.timeout_s))
            except FutureTimeout:
                raise NodeError("a node did not answer while the sequences were replayed") from None
        return n

    def _find_dead(self, pipe: Pipeline) -> tuple[list[str], str, float]:
        """The nodes of `pipe` that are gone: declared by the heartbeat, or not answering a Hello
        now. (A batch failed, so at least one of them should be.)"""
        nodes = list(pipe.nodes)
        declared = [n for n in nodes if self._health.get(n, _Health(0)).gone]
        if declared:
            h = self._health[declared[0]]
            return declared, h.reason, h.last_ok
        clients = {c.address: c for c in pipe.clients}
        dead, reasons = [], []
        for n in nodes:
            try:
                clients[n].hello("head", timeout=min(2.0, self.timeout_s))
            except PotluckError as exc:
                dead.append(n)
                reasons.append(str(exc))
        if not dead:
            return [], "a call failed but every node answers; reconnecting", 0.0
        # (a node the heartbeat has not watched yet, as right after a re-plan, has no last_ok)
        last = min((self._health[n].last_ok for n in dead if n in self._health), default=0.0)
        return dead, reasons[0], last

    # -- heartbeat --------------------------------------------------------------------------------
    def _watch(self, pipe: Pipeline) -> None:
        now = time.monotonic()
        self._health = {c.address: self._health.get(c.address, _Health(now)) for c in pipe.clients}
        for h in self._health.values():
            h.last_ok = max(h.last_ok, now)

    def _heartbeat(self) -> None:
        interval = min(0.5, self.timeout_s / 5)
        while not self._closed.wait(interval):
            if self._failed is not None:
                return
            with self._lock:
                clients = list(self.inner.clients)
                health = self._health
                plan_id = self.plan_id
            now = time.monotonic()
            for c in clients:
                h = health.get(c.address)
                if h is None or h.gone:
                    continue
                if now - h.last_ok > self.timeout_s - interval:  # declared within the timeout
                    h.gone = True
                    h.reason = f"node {c.address} did not answer for {now - h.last_ok:.1f} s"
                    if self.connect is None:  # before the batches fail: they carry this error
                        self._failed = self._failed or _off_error(c.address, h.reason)
                    with contextlib.suppress(PotluckError):
                        self.inner.fail_pending(NodeError(h.reason))
                    self._redo.put(None)  # recover even when nothing is in flight
                    continue
                if not h.probing:
                    h.probing = True
                    try:
                        self._pings.submit(self._ping, c, h, plan_id)
                    except RuntimeError:  # shut down
                        return

    def _ping(self, client: NodeClient, h: _Health, plan_id: str) -> None:
        try:  # naming the plan keeps the nodes from freeing it while this head is idle
            reply = client.hello("head", [plan_id], timeout=self.timeout_s)
            h.last_ok = time.monotonic()
            h.status = status_of(client.address, reply)
        except PotluckError:
            pass  # silence counts against the node in _heartbeat
        except Exception:  # a bug, not the node: say so (it would otherwise count as silence)
            log.exception("the heartbeat's Hello to %s failed", client.address)
        finally:
            h.probing = False


def _split(tokens: np.ndarray, chunks: Sequence[SeqChunk]) -> list[list[int]]:
    out, i = [], 0
    ids = tokens.tolist()
    for c in chunks:
        out.append(ids[i : i + c.n])
        i += c.n
    return out
