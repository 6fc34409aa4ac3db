"""Continuous batching: many requests share one pipeline, joining and leaving between steps.

One compute thread owns the pipeline. Each loop it admits waiting requests (up to `max_active`
sequences, each with its own KV cache), builds batches from the sequences that are ready, keeps up
to `pipeline.depth` batches in flight (one per pipelined stage, so every node of a pool stays
busy), and turns each finished batch into tokens for the requests' sinks. A batch is either one
prompt micro-batch of one sequence (`n_batch` tokens) or one decode step of up to `max_rows`
sequences; prompt and decode batches take turns, so a long prompt does not stall the others.

Batches are kept homogeneous on purpose: a sequence's prompt goes through in the same micro-batches
as `engine.generate.generate` uses alone, and decode steps stay at most `max_rows` rows (ggml
computes each row of a small batch as it computes one row alone; tests/test_scheduler.py holds
that), so greedy output through the scheduler is bit-identical to one request alone.

Callers on other threads (the HTTP server's asyncio loop) submit and cancel; events reach them
through the sink they gave, called on the compute thread (it must be quick and thread-safe, e.g.
`loop.call_soon_threadsafe`). The scheduler imports no HTTP or gRPC code.

One class over one thread's state (the sequences, the batches in flight, whose turn it is); its
request types are in engine/requests.py. Over 400 lines on purpose: split further, that state would
be passed between files.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from potluck.engine.contract import Pipeline
from potluck.engine.prefix import PrefixCache
from potluck.engine.requests import (
    BATCH,
    INTERACTIVE,
    MAX_DECODE_ROWS,
    Event,
    Failed,
    Finished,
    QueueFullError,
    QueueSink,
    Request,
    SchedulerClosedError,
    SchedulerConfig,
    Sink,
    Stats,
    TokenEvent,
    prompt_ubatch,
)
from potluck.engine.spec import DRAFT, REST, Drafter, Pace, SpecConfig
from potluck.errors import ContextError, UnsupportedError
from potluck.grammar import Vocabulary
from potluck.model.stage import SeqChunk
from potluck.modelfile.tokenizer import Tokenizer
from potluck.sampling import Sampler, Token, tokens_of

# the scheduler's whole API from here: Scheduler, Stream, and the request types of engine/requests.py
__all__ = [
    "BATCH",
    "INTERACTIVE",
    "MAX_DECODE_ROWS",
    "Event",
    "Failed",
    "Finished",
    "QueueFullError",
    "QueueSink",
    "Request",
    "Scheduler",
    "SchedulerClosedError",
    "SchedulerConfig",
    "Sink",
    "Stats",
    "Stream",
    "TokenEvent",
]

log = logging.getLogger(__name__)


class _Model(Protocol):
    pipeline: Pipeline
    n_ctx: int
    tokenizer: Tokenizer  # (its vocabulary constrains a request with a grammar)

    @property
    def kv_bytes_per_token(self) -> int: ...

    @property
    def state_bytes(self) -> int: ...

    def new_seq_id(self) -> int: ...


@dataclass
class _Seq:
    """A request's state, owned by the compute thread (except `cancelled`, a one-way flag)."""

    seq_id: int
    req: Request
    sink: Sink
    sampler: Sampler
    history: list[int]  # prompt + generated ids (the sampler's penalties read it)
    prefilled: int = 0  # prompt tokens submitted so far
    cached: int = 0  # prompt tokens reused from a cached prefix (its stages already hold them)
    # the cached sequence its first batch copies the `cached` positions from (a fork), until sent
    fork_from: int | None = None
    fed: int = 0  # leading ids of `history` whose K/V the stages hold (batches that came back)
    # a hybrid's stages keep a checkpoint of its recurrent state at this position (one token
    # before its prompt's end: SeqChunk.mark), which a later request may go back to; -1: none
    mark: int = -1
    pace: Pace = field(default_factory=Pace)  # whether it drafts (speculative decoding)
    generated: int = 0
    in_flight: int = 0  # batches of this sequence not finished yet
    last_turn: int = 0  # scheduler loop count of its last decode batch (fairness)
    cancelled: bool = False
    cancel_reason: str = "cancelled"  # the Finished reason a cancel ends it with
    done: bool = False
    # its decode step in flight alone (a batch of this sequence only), which a follow-up step
    # may be chained on (pipeline.submit_next); None when there is none
    tail: Future[list[int]] | None = None
    tail_follows: bool = False  # the tail is itself a follow-up step
    t_done: float = 0.0  # when its last batch came back (time.perf_counter)

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.req.prompt)


class Stream:
    """The caller's handle on a submitted request."""

    def __init__(self, scheduler: Scheduler, seq: _Seq) -> None:
        self._scheduler, self._seq = scheduler, seq

    @property
    def seq_id(self) -> int:
        """Its sequence (a cached prefix's, once admitted with one)."""
        return self._seq.seq_id

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop generating and free the sequence's KV cache (a no-op once it has finished); it
        finishes with `reason` (e.g. "stop" when the caller found a stop sequence in the text)."""
        self._scheduler._cancel(self._seq, reason)


@dataclass(frozen=True)
class _Batch:
    kind: str  # "prompt" or "decode"
    seqs: tuple[_Seq, ...]
    chunks: tuple[SeqChunk, ...]
    samples: bool  # whether the batch's tokens are sampled (a prompt's last micro-batch, decode)
    t0: float
    follow: bool = False  # a follow-up decode step: its input is the token of the one before


def _ema(old: list[float], new: Sequence[float], a: float = 0.2) -> list[float]:
    if len(old) != len(new):
        return list(new)
    return [o + a * (x - o) for o, x in zip(old, new, strict=True)]


class Scheduler:
    """Continuous batching over one model's pipeline, on its own compute thread."""

    def __init__(
        self,
        model: _Model,
        config: SchedulerConfig | None = None,
        drafter: Drafter | None = None,
        inline: bool = False,
    ) -> None:
        """drafter: drafts for speculative decoding (engine/spec.py), as config.spec says.
        inline: no compute thread: `run_one` turns the loop in its caller's thread (one
        synchronous caller, `generate`: no hand-over between threads per token)."""
        self.inline = inline
        self.model, self.pipeline = model, model.pipeline
        self.config = config or SchedulerConfig()
        self.spec: SpecConfig = self.config.spec
        if self.spec.on and drafter is None:
            raise ValueError(f"--spec-type {self.spec.kind} needs a drafter")
        self.drafter = drafter if self.spec.on else None
        self._plain_rate = 0.0  # tokens per ms of plain one-sequence decode steps (recent)
        self.n_ctx = model.n_ctx
        self.depth = max(1, self.pipeline.depth)
        self.logprobs_ok = self.pipeline.supports_logprobs
        self.stats = Stats()
        self._lock = threading.Lock()
        self._waiting: deque[_Seq] = deque()
        self._active: dict[int, _Seq] = {}
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._inflight: list[_Batch] = []
        self._turn = itertools.count(1)
        self._prefer_prompt = True
        self._late_drops: set[int] = set()  # finished sequences with a batch still in flight
        self.prefixes = PrefixCache(
            self.config.cache_bytes, model.kv_bytes_per_token, model.state_bytes
        )
        self._marks = self.prefixes.on and self.prefixes.whole_only  # (checkpoints: a hybrid)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="potluck-scheduler", daemon=True)
        if not inline:
            self._thread.start()

    # -- callers' side (any thread) ----------------------------------------------------------------
    def submit(self, req: Request, sink: Sink) -> Stream:
        """Queue a request. Raises ContextError (empty or too long), QueueFullError, UnsupportedError."""
        n = len(req.prompt)
        if n == 0:
            raise ContextError("the prompt is empty after tokenization; give some text")
        if n >= self.n_ctx:
            raise ContextError(
                f"prompt is {n} tokens but the context is {self.n_ctx}; shorten the prompt or "
                f"restart the server with a larger -c"
            )
        if req.params.logprobs is not None and not self.logprobs_ok:
            raise UnsupportedError("logprobs are not yet supported over a pool")
        params, vocab = req.params, None
        if params.grammar is not None:  # the grammar constrains what follows the prompt
            params = dataclasses.replace(params, grammar_from=n)
            vocab = Vocabulary.of(self.model.tokenizer)
        seq = _Seq(
            seq_id=0,
            req=req,
            sink=sink,
            sampler=Sampler(params, vocab),
            history=list(req.prompt),
        )
        with self._lock:
            if self._closed:
                raise SchedulerClosedError("the server is shutting down")
            free = self.config.max_active - len(self._active)
            if len(self._waiting) >= self.config.max_queue + max(0, free):
                self.stats.requests_rejected += 1
                raise QueueFullError(
                    f"server busy: {len(self._active)} requests generating and "
                    f"{len(self._waiting)} waiting (limit {self.config.max_queue}); retry shortly"
                )
            seq.seq_id = self.model.new_seq_id()
            self._waiting.append(seq)
            self.stats.requests_total += 1
        self._inbox.put(("wake", None))
        return Stream(self, seq)

    def run_one(self, req: Request, timeout: float = 3600.0) -> Iterator[TokenEvent | Finished]:
        """Submit `req` and yield its events here, ending with its Finished (for one synchronous
        caller: `potluck chat`); raises what a Failed carries; closing the iterator before the
        end (an exception in the caller, Ctrl-C) cancels the request."""
        sink = QueueSink()
        stream = self.submit(req, sink)
        done = False
        try:
            for ev in self._turned(sink) if self.inline else sink.events(timeout):
                if isinstance(ev, Failed):
                    done = True
                    raise ev.error
                done = isinstance(ev, Finished)
                yield ev
        finally:
            if not done:
                stream.cancel()

    def _turned(self, sink: QueueSink) -> Iterator[Event]:
        """The events of the one request of an inline scheduler, turning its loop here until
        it ends."""
        while True:
            self._cycle(False)
            self._wait(False, 1.0)
            while True:
                try:
                    ev = sink.q.get_nowait()
                except queue.Empty:
                    break
                yield ev
                if isinstance(ev, Finished | Failed):
                    return

    def _cancel(self, seq: _Seq, reason: str) -> None:
        if not seq.cancelled:
            seq.cancel_reason = reason
        seq.cancelled = True
        self._inbox.put(("wake", None))

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def close(self, timeout: float = 10.0) -> None:
        """Finish: cancel everything, free the caches, stop the thread."""
        with self._lock:
            self._closed = True
        self._inbox.put(("close", None))
        if self.inline:
            self._run()
        else:
            self._thread.join(timeout)

    # -- the compute thread ------------------------------------------------------------------------
    def _run(self) -> None:
        closing = False
        while True:
            try:
                if self._cycle(closing):
                    return
                closing = self._wait(closing, 1.0)
            except Exception:  # a bug here must not silently stop every request: log and go on
                log.exception("scheduler loop error")
                time.sleep(0.05)

    def _cycle(self, closing: bool) -> bool:
        """Admit, submit what is ready; True once closing found nothing left."""
        self._admit()
        self._reap(closing)
        if closing and not self._active and not self._waiting and not self._inflight:
            return True
        while self._plain_in_flight() < self.depth and not closing:
            batch = self._next_batch()
            if batch is None:
                break
            self._submit(batch)
        if not closing:
            self._follow_ups()
        return False

    def _wait(self, closing: bool, timeout: float) -> bool:
        """Wait for a finished batch or news from a caller (with nothing in flight and nothing
        to do, the timeout only bounds how long a missed wake-up could last) and take in all
        there is; whether the scheduler is closing."""
        try:
            kind, item = self._inbox.get(timeout=timeout)
        except queue.Empty:
            return closing
        while True:
            if kind == "close":
                closing = True
            elif kind == "done":
                self._finish_batch(*item)  # type: ignore[misc]
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return closing

    def _admit(self) -> None:
        with self._lock:
            while self._waiting and len(self._active) < self.config.max_active:
                # the first waiting request of the most urgent kind (FIFO within a kind)
                seq = min(self._waiting, key=lambda s: s.req.priority)
                self._waiting.remove(seq)
                self._reuse(seq)
                self._active[seq.seq_id] = seq
        # a request cancelled while it waited never touches the pipeline
        for seq in [s for s in self._active.values() if s.cancelled and s.in_flight == 0]:
            self._end(seq, Finished(seq.cancel_reason, len(seq.req.prompt), seq.generated))

    def _reuse(self, seq: _Seq) -> None:
        """Start `seq` from the cached sequence that shares the longest prefix with its prompt,
        if any: it becomes that sequence, and its first prompt batch rewinds the stages to the
        shared part (SeqChunk.pos); or, when it shares a small part of it (a system prompt), its
        first batch copies that part (SeqChunk.fork) and the cached one stays for others."""
        if not self.prefixes.on or seq.cancelled:
            return
        hit = self.prefixes.take(seq.req.prompt, seq.req.lora)
        st = self.stats
        if hit is None:
            st.prefix_misses += 1
        else:
            if hit.fork:
                seq.fork_from = hit.entry.seq_id
            else:
                seq.seq_id = hit.entry.seq_id
                seq.mark = hit.entry.mark if hit.entry.mark <= hit.reuse else -1
            seq.cached = seq.prefilled = seq.fed = hit.reuse
            st.prefix_hits += 1
            st.cached_tokens += hit.reuse
        self._count_prefixes()

    def _unpin(self, seq_id: int) -> None:
        for gone in self.prefixes.unpin(seq_id):
            self._drop(gone)
        self._count_prefixes()

    def _count_prefixes(self) -> None:
        self.stats.prefix_entries = self.prefixes.entries
        self.stats.prefix_bytes = self.prefixes.nbytes

    def _reap(self, closing: bool) -> None:
        if not closing:
            return
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
        for seq in waiting:
            self._emit(seq, Failed(SchedulerClosedError("the server is shutting down")))
        for seq in self._active.values():
            seq.cancelled = True
        for seq in [s for s in self._active.values() if s.in_flight == 0]:
            self._end(seq, Finished("cancelled", len(seq.req.prompt), seq.generated))
        for seq_id in self.prefixes.clear():
            self._drop(seq_id)
        self._count_prefixes()

    def _next_batch(self) -> _Batch | None:
        live = [s for s in self._active.values() if not s.cancelled and not s.done]
        # a prompt's micro-batches may follow each other down a pool before the first returns
        # (nodes keep a sequence's batches in order); only the last one samples
        prompts = [s for s in live if not s.decoding]
        decodes = [s for s in live if s.decoding and s.in_flight == 0]
        if prompts and (self._prefer_prompt or not decodes):
            self._prefer_prompt = False
            return self._prompt_batch(prompts[0])
        if decodes:
            self._prefer_prompt = True
            n_decoding = sum(1 for s in live if s.decoding)
            # spread the decoding sequences over `depth` batches so each stage has one to work on
            size = min(self.config.max_rows, math.ceil(n_decoding / self.depth))
            decodes.sort(key=lambda s: s.last_turn)
            return self._decode_batch(decodes[:size])
        return None

    def _plain_in_flight(self) -> int:
        """Batches in flight that keep a stage busy now (a follow-up step waits for the one before
        it, so it does not count against the pipeline's depth)."""
        return sum(1 for b in self._inflight if not b.follow)

    def _follow_ups(self) -> None:
        """Over a pool whose first stage is a node, chain a follow-up step on every sequence whose
        decode step is in flight alone: the first node starts it as soon as that step's token
        passes through, so this machine's round trip leaves the sequence's critical path. Only
        steps the plain loop would also take (a stop id is checked by the node)."""
        if not self.pipeline.chains:
            return
        live = [s for s in self._active.values() if not s.cancelled and not s.done]
        if sum(1 for s in live if s.decoding) > self.depth:
            return  # more streams than stages: they go in batches of several rows instead
        for s in live:
            if (
                s.tail is None
                or s.in_flight != 1
                or s.generated + 1 >= s.req.max_tokens  # the step in flight gives the last token
                or len(s.history) + 1 >= self.n_ctx  # ... or fills the context
                # drafting: one follow-up at a time, so that the step after it may carry drafts
                # (a chain of follow-ups never comes back to the drafter)
                or (self.drafter is not None and s.tail_follows)
            ):
                continue
            batch = _Batch(
                "decode", (s,), (SeqChunk(s.seq_id, 1, s.req.lora),), True, 0.0, follow=True
            )
            self._submit(batch)
            self.stats.follow_ups += 1

    def _prompt_batch(self, seq: _Seq) -> _Batch:
        a = seq.prefilled
        n = len(seq.req.prompt)  # micro-batches as generate() cuts them alone (same tokens)
        b = min(a + prompt_ubatch(n - seq.cached, self.config.n_batch, self.depth), n)
        # a hybrid's stages keep their recurrent state one token before the prompt's end (a
        # checkpoint: the last token goes in a batch of its own), where the same prompt again
        # (a regenerated answer) and the next turn of its chat both start
        mark = self._marks and a < n - 1 <= b
        if mark:
            b = n - 1
            seq.mark = b
        seq.prefilled = b
        # after a cached prefix the first batch says where it starts: the stages forget the rest,
        # or copy the shared part of another sequence (a fork)
        pos = a if a == seq.cached and a else -1
        fork = None
        if pos >= 0:
            fork, seq.fork_from = seq.fork_from, None
        return _Batch(
            "prompt",
            (seq,),
            (SeqChunk(seq.seq_id, b - a, seq.req.lora, pos=pos, fork=fork, mark=mark),),
            b == len(seq.req.prompt),
            time.perf_counter(),
        )

    def _decode_batch(self, seqs: list[_Seq]) -> _Batch:
        turn = next(self._turn)
        for s in seqs:
            s.last_turn = turn
        t0 = time.perf_counter()  # (before drafting: a draft model's time is the step's too)
        if self.drafter is None:
            chunks = tuple(SeqChunk(s.seq_id, 1, s.req.lora) for s in seqs)
        else:
            n_decoding = sum(1 for s in self._active.values() if s.decoding and not s.done)
            chunks = tuple(self._decode_chunk(s, n_decoding) for s in seqs)
        return _Batch("decode", tuple(seqs), chunks, True, t0)

    def _decode_chunk(self, s: _Seq, n_decoding: int) -> SeqChunk:
        """A decode step's chunk: the last token, and drafted ids after it when drafting pays
        (few streams, drafts kept often enough; never where logprobs are asked). A drafting
        sequence's chunk names its position: a step after drafts that were not all kept rewinds
        the stages past them."""
        assert self.drafter is not None
        spec = self.spec
        room = min(
            spec.n_max,
            s.req.max_tokens - s.generated - 1,  # the step gives up to k + 1 tokens
            self.n_ctx - len(s.history) - 1,
        )
        verdict = s.pace.next(spec, self._plain_rate)
        if verdict != DRAFT:
            room = 0
        if verdict == REST:
            self.stats.draft_rests += 1
        draft: list[int] = []
        if room > 0 and n_decoding <= spec.max_streams and s.req.params.logprobs is None:
            draft = self.drafter.draft(s.seq_id, s.history, room)[:room]
        return SeqChunk(s.seq_id, 1 + len(draft), s.req.lora, pos=s.fed, draft=tuple(draft))

    def _submit(self, batch: _Batch) -> None:
        samplers = {s.seq_id: s.sampler for s in batch.seqs} if batch.samples else {}
        for s in batch.seqs:
            s.in_flight += 1
        self._inflight.append(batch)
        self.stats.max_in_flight = max(self.stats.max_in_flight, len(self._inflight))
        try:
            if batch.follow:  # its input id is the token of the step in flight (s.tail)
                s = batch.seqs[0]
                assert s.tail is not None
                # (a copy: the history grows before this step is done)
                # (the penalties read it; a grammar's new last stage catches up on it after a
                # failover turns this step into an ordinary one)
                keep = s.sampler.params.penalizes or s.sampler.constraint is not None
                hist = {s.seq_id: list(s.history)} if keep else {}
                fut = self.pipeline.submit_next(
                    s.tail, list(batch.chunks), samplers, hist, s.req.stop_ids
                )
            else:
                if batch.kind == "prompt":
                    seq = batch.seqs[0]
                    a = seq.prefilled - batch.chunks[0].n
                    ids = list(seq.req.prompt[a : seq.prefilled])
                else:
                    ids = [
                        t
                        for s, c in zip(batch.seqs, batch.chunks, strict=True)
                        for t in (s.history[-1], *c.draft)
                    ]
                histories = {s.seq_id: s.history for s in batch.seqs}
                fut = self.pipeline.submit(
                    np.array(ids, np.int64), list(batch.chunks), samplers, histories
                )
        except Exception as exc:  # a pipeline that fails before returning a future
            fut = Future()
            fut.set_exception(exc)
        if batch.kind == "decode" and len(batch.seqs) == 1 and not batch.chunks[0].draft:
            batch.seqs[0].tail, batch.seqs[0].tail_follows = fut, batch.follow
        fut.add_done_callback(lambda f: self._inbox.put(("done", (batch, f))))

    def _finish_batch(self, batch: _Batch, fut: Future[list[int]]) -> None:
        self._inflight.remove(batch)
        for c in batch.chunks:
            if c.fork is not None:  # the copy is made (or failed): its source may go now
                self._unpin(c.fork)
        now_pc = time.perf_counter()
        t_start = batch.t0
        for s in batch.seqs:
            if batch.follow:  # it started when the step before it came back
                t_start = s.t_done
            s.in_flight -= 1
            s.t_done = now_pc
            if s.tail is fut:
                s.tail = None
            if s.in_flight == 0 and s.seq_id in self._late_drops:
                self._late_drops.discard(s.seq_id)
                self._drop(s.seq_id)
        exc = fut.exception()
        if exc is None and not (batch.follow and not fut.result()):
            for s, c, tok in zip(batch.seqs, batch.chunks, fut.result(), strict=True):
                # (a skipped follow-up step computed nothing; of drafted ids, only those kept)
                s.fed += len(tokens_of(tok)) if c.draft else c.n
                if c.draft:
                    alone = len(batch.seqs) == 1  # (its time is its own)
                    ms = (now_pc - batch.t0) * 1e3 if alone else None
                    s.pace.took(len(c.draft), len(tokens_of(tok)) - 1, ms)
                    self.stats.drafted += len(c.draft)
                    self.stats.draft_kept += len(tokens_of(tok)) - 1
                    self.stats.draft_steps += 1
        if exc is not None:
            log.warning("batch of %d sequences failed: %s", len(batch.seqs), exc)
            err = exc if isinstance(exc, Exception) else RuntimeError(str(exc))
            for s in batch.seqs:
                if not s.done:
                    s.cancelled = True
                    self._fail(s, err)
            return
        tokens = fut.result()
        if batch.follow and not tokens:
            return  # skipped by the node: the step before it gave a stop id (that ended it)
        ms = (now_pc - t_start) * 1e3
        if batch.kind == "decode":
            self._record_decode(len(batch.seqs), ms)
            plain = len(batch.seqs) == 1 and not batch.chunks[0].draft
            if self.drafter is not None and plain and ms > 0:  # what drafted steps must beat
                old, rate = self._plain_rate, 1 / ms
                self._plain_rate = rate if not old else old + 0.2 * (rate - old)
        if not batch.samples:
            return
        now = time.monotonic()
        n_new = 0
        for s, sampled in zip(batch.seqs, tokens, strict=True):
            if s.done:
                continue
            if s.cancelled:
                if s.in_flight == 0:
                    self._end(s, Finished(s.cancel_reason, len(s.req.prompt), s.generated))
                continue
            if s.req.params.logprobs is not None and not isinstance(sampled, Token):
                self._fail(s, UnsupportedError("logprobs are not yet supported over a pool"))
                continue
            for tok in tokens_of(sampled):  # one, or a drafted step's kept drafts and one more
                s.history.append(tok)
                s.generated += 1
                n_new += 1
                self._emit(s, TokenEvent(tok, s.generated - 1))
                if tok in s.req.stop_ids:
                    self._end(s, Finished("stop", len(s.req.prompt), s.generated))
                elif s.generated >= s.req.max_tokens or len(s.history) >= self.n_ctx:
                    self._end(s, Finished("length", len(s.req.prompt), s.generated))
                if s.done:
                    break
        self.stats.generated_tokens += n_new
        self.stats.recent.append((now, n_new))

    def _record_decode(self, rows: int, ms: float) -> None:
        st = self.stats
        st.decode_steps += 1
        st.decode_rows += 0.2 * (rows - st.decode_rows) if st.decode_steps > 1 else rows
        stage = list(self.pipeline.last_stage_ms)
        hop = list(self.pipeline.last_hop_ms)
        if not stage:  # a local pipeline: the whole step is this machine's compute
            stage, hop = [ms], [0.0]
        # hop_ms[i] is the hop into stage i: a local first stage has none
        hop = [0.0] * (len(stage) - len(hop)) + hop
        st.stage_ms = _ema(st.stage_ms, stage)
        st.hop_ms = _ema(st.hop_ms, hop)

    def _fail(self, seq: _Seq, exc: Exception) -> None:
        self._release(seq, keep=False)
        self._emit(seq, Failed(exc))

    def _end(self, seq: _Seq, fin: Finished) -> None:
        fin = dataclasses.replace(fin, n_cached=seq.cached)
        self._release(seq, keep=True)
        fin_count = self.stats.requests_finished
        fin_count[fin.reason] = fin_count.get(fin.reason, 0) + 1
        self.stats.prompt_tokens += fin.n_prompt
        self._emit(seq, fin)

    def _emit(self, seq: _Seq, ev: Event) -> None:
        try:
            seq.sink(ev)
        except Exception as exc:  # a caller that went away (e.g. its event loop closed): stop it
            log.warning("sequence %d: its sink failed (%s); cancelling", seq.seq_id, exc)
            seq.cancelled = True

    def _release(self, seq: _Seq, keep: bool) -> None:
        """Mark done; keep its KV as a cached prefix (`keep`, when nothing of it is in flight and
        the cache has room), else free it once no batch of the sequence is in flight."""
        seq.done = True
        seq.cancelled = True
        if seq.fork_from is not None:  # it ended before its first batch: no copy to wait for
            self._unpin(seq.fork_from)
            seq.fork_from = None
            seq.fed = 0  # (its stages hold nothing)
        self._active.pop(seq.seq_id, None)
        if seq.in_flight == 0:
            if keep and seq.fed and not self._closed:
                mark = seq.mark if seq.mark <= seq.fed else -1
                gone = self.prefixes.put(seq.seq_id, seq.history[: seq.fed], seq.req.lora, mark)
            else:
                gone = [seq.seq_id]
            for seq_id in gone:
                self._drop(seq_id)
            self._count_prefixes()
        else:  # dropped when its last batch comes back
            self._late_drops.add(seq.seq_id)

    def _drop(self, seq_id: int) -> None:
        if self.drafter is not None:
            self.drafter.forget(seq_id)
        try:
            self.pipeline.drop(seq_id)
        except Exception as exc:  # a node that is gone: its caches went with it
            log.warning("could not free sequence %d: %s", seq_id, exc)
