"""A worker's forward passes: check a request against its stage (`prepare`, also rehearsed while
the node polls), wait for its sequences' turn, run the stage under the compute lock, sample on the
last stage (`finish`), or relay the output down this node's own link to the next hop and pass the
reply back up (`serve_forward`, the data port's handler and ForwardStream's).

One compute lock: the stage runs one forward at a time (ggml already uses every core it is given);
a batch waits ≤ ORDER_WAIT_S for its sequence's earlier batch, and a stale one is refused.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future

import grpc
import numpy as np

from potluck.errors import ContextError, PotluckError, StepRefused
from potluck.grammar import ConstraintError, GrammarError
from potluck.model.stage import SeqChunk, Stage, sample_rows
from potluck.node.followup import FollowUps
from potluck.node.plans import LoadedStage, PlanStore, Refused
from potluck.sampling import Accepted, Sampler
from potluck.transport import potluck_pb2 as pb
from potluck.transport.codec import (
    WireError,
    error_reply,
    forward_request,
    logits_reply,
    lora_from_wire,
    sampling_from_proto,
    tensor_from_proto,
    tokens_reply,
)
from potluck.transport.dataplane import Answer
from potluck.transport.limits import check_message
from potluck.transport.spin import computing

log = logging.getLogger(__name__)

REHEARSE_MAX_BYTES = 64 << 10  # largest input rehearsed while waiting (Forwarder.rehearse)
ORDER_WAIT_S = 30.0  # longest a batch waits for an earlier batch of its sequence (seconds)


class OrderError(PotluckError):
    """A batch waited too long for an earlier batch of the same sequence."""


class Forwarder:
    """Runs the forward requests for the stages in `plans`, one at a time under `compute` (the
    node's compute lock), in each sequence's order; owns the node's follow-up batches."""

    def __init__(self, plans: PlanStore, compute: threading.Lock) -> None:
        self.plans = plans
        self.turn = threading.Condition(compute)  # compute, and wait for a sequence's turn
        self.last_request: pb.ForwardRequest | None = None  # see rehearse
        self.follow = FollowUps(plans, self.serve_forward)

    def prepare(
        self, request: pb.ForwardRequest
    ) -> tuple[LoadedStage, list[SeqChunk], np.ndarray, np.ndarray | None]:
        """Check a forward request against its stage: (stage, chunks, input, logits rows). Changes
        nothing. Raises Refused with the status to answer."""
        loaded = self.plans.loaded(request.plan_id)
        stage = loaded.stage
        try:
            chunks = [
                SeqChunk(
                    c.seq_id,
                    c.n,
                    lora_from_wire(c.lora),
                    c.pos,
                    c.fork_from if c.fork else None,
                    tuple(c.draft),
                    c.mark,
                )
                for c in request.chunks
            ]
            if any(len(c.draft) >= c.n for c in chunks):
                raise WireError("a chunk's drafted ids must be fewer than its ids")
            if any(c.fork and c.fork_from == c.seq_id for c in request.chunks):
                raise WireError("a sequence cannot fork itself")
            total = sum(c.n for c in chunks)
            if not chunks or any(c.n < 1 for c in chunks) or total > stage.n_ctx * len(chunks):
                raise WireError(
                    f"{len(chunks)} chunks of {[c.n for c in chunks]} tokens are not a valid batch"
                )
            if len({c.seq_id for c in chunks}) != len(chunks):
                raise WireError("a sequence appears twice in one batch")
            if any(c.follow for c in request.chunks):
                raise WireError("a follow-up batch goes on the forward stream or the data port")
            n_vocab = stage.hp.n_vocab
            if any(not 0 <= t < n_vocab for c in request.chunks for t in c.recent):
                raise WireError(f"recent token ids (for penalties) must be in [0, {n_vocab})")
            if any(not 0 <= t < n_vocab for c in request.chunks for t in c.draft):
                raise WireError(f"drafted token ids must be in [0, {n_vocab})")
            x = tensor_from_proto(request.input)
            if stage.is_first:
                if x.dtype != np.int64 or x.shape != (total,):
                    raise WireError(
                        f"the first stage takes int64 token ids [{total}], got {x.dtype} {tuple(x.shape)}"
                    )
                if int(x.min()) < 0 or int(x.max()) >= stage.hp.n_vocab:
                    raise WireError(f"token ids must be in [0, {stage.hp.n_vocab})")
            elif x.dtype != np.float32 or x.shape != (total, stage.hp.n_embd):
                raise WireError(
                    f"expected hidden states [{total}, {stage.hp.n_embd}], got {x.dtype} {tuple(x.shape)}"
                )
            rows = np.arange(total) if request.want_logits else None
            if stage.is_last and rows is None and not any(c.sample for c in request.chunks):
                rows = np.empty(0, np.int64)  # an early prompt micro-batch: no head
            elif stage.is_last and rows is None and any(c.draft for c in chunks):
                rows = sample_rows(chunks)  # a row before each drafted id too
            return loaded, chunks, x, rows
        except WireError as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None

    def rehearse(self) -> None:
        """Check the last request computed here again (`prepare`), computing nothing: run while
        the node polls for the next one, so that that one's path is in the core's caches
        (transport/spin.py says why)."""
        request = self.last_request
        if request is not None:
            with contextlib.suppress(Refused, WireError):  # e.g. its plan was freed meanwhile
                check_message(request)
                self.prepare(request)

    def compute(
        self, request: pb.ForwardRequest, wait_s: float
    ) -> tuple[LoadedStage, np.ndarray, float]:
        """Check a forward request, wait for its sequences' turn, run the stage: (stage, output,
        compute ms). Raises Refused with the status to answer."""
        loaded, chunks, x, rows = self.prepare(request)
        loaded.last_used = loaded.last_compute = time.monotonic()
        # a decode step is rehearsed while this node waits for the next (not a prompt's batch)
        self.last_request = request if request.input.ByteSize() <= REHEARSE_MAX_BYTES else None
        stage = loaded.stage
        try:
            with self.turn:
                self._wait_turn(stage, request.chunks, wait_s)
                t0 = time.perf_counter()
                try:
                    with computing():  # no thread of this process spins meanwhile
                        if stage.is_last:
                            y = stage(x, chunks, rows, hidden=request.want_hidden)
                        else:
                            y = stage(x, chunks)
                finally:
                    self.turn.notify_all()
                return loaded, y, (time.perf_counter() - t0) * 1e3
        except (WireError, ValueError) as exc:  # a repeated or stale batch (_wait_turn), a fork
            # of positions this node does not hold (Stage.place)
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except ContextError as exc:
            raise Refused(grpc.StatusCode.OUT_OF_RANGE, str(exc)) from None
        except OrderError as exc:
            raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)) from None

    def downstream(
        self, loaded: LoadedStage, request: pb.ForwardRequest, y: np.ndarray
    ) -> pb.ForwardRequest:
        return forward_request(
            request.plan_id, request.chunks, y, loaded.wire_dtype, request.want_logits,
            want_hidden=request.want_hidden,
        )  # fmt: skip

    @staticmethod
    def relay(reply: pb.ForwardReply, stage_ms: float, wall_ms: float) -> pb.ForwardReply:
        """The downstream reply (changed in place: its logits may be large) with this stage's
        compute and the hop to the next node in front."""
        stages, hops = list(reply.stage_ms), list(reply.hop_ms)
        del reply.stage_ms[:], reply.hop_ms[:]
        reply.stage_ms.extend([stage_ms, *stages])
        reply.hop_ms.extend([wall_ms - sum(stages) - sum(hops), *hops])
        reply.request_id = 0  # the downstream link's id; the caller sets its own
        return reply

    def finish(
        self, loaded: LoadedStage, request: pb.ForwardRequest, y: np.ndarray, stage_ms: float
    ) -> pb.ForwardReply:
        """The last stage's answer: logits of every row, or one sampled token per chunk."""
        if request.want_logits:
            return logits_reply(y, stage_ms)
        if y.shape[0] == 0:  # nothing to sample in this batch (the output head was skipped)
            return tokens_reply([-1] * len(request.chunks), stage_ms)
        tokens: list[int] = []
        at = 0
        for chunk in request.chunks:
            rows = y[at : at + len(chunk.draft) + 1]
            at += len(rows)
            if not chunk.sample:
                tokens.append(-1)
                continue
            # a sampler is its settings and seed (a token's draw is keyed by its position): made
            # again when they change (a new request in a cached sequence), else kept
            kept = loaded.samplers.get(chunk.seq_id)
            if not chunk.HasField("sampling"):  # opened by an earlier batch of the request
                if kept is None:
                    raise Refused(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"sequence {chunk.seq_id} asks for a token, but no sampling settings "
                        "reached this node for it",
                    )
            else:
                try:
                    params = sampling_from_proto(chunk.sampling)
                except WireError as exc:
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
                if kept is None or kept.params != params:
                    vocab = loaded.vocabulary() if params.grammar is not None else None
                    try:
                        kept = loaded.samplers[chunk.seq_id] = Sampler(params, vocab)
                    except GrammarError as exc:
                        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            sampler = kept
            end = chunk.pos + chunk.n  # the position of the token after the chunk
            if chunk.constrained and sampler.constraint is not None:
                try:  # a new last stage's matcher catches up on the answer so far
                    sampler.constraint.sync(end - len(chunk.draft), chunk.constrained)
                except ConstraintError as exc:
                    raise Refused(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
            try:
                if chunk.draft:
                    first = end - len(chunk.draft)  # the position of the first sampled token
                    run = sampler.verify(rows, chunk.draft, list(chunk.recent), first)
                    tokens.append(Accepted(run))
                else:
                    tokens.append(sampler.sample(rows[0], list(chunk.recent), end))
            except ConstraintError as exc:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        return tokens_reply(tokens, stage_ms)

    def serve_forward(self, request: pb.ForwardRequest, answer: Answer) -> None:
        """Compute one request (in the calling thread) and answer it: the last stage answers at
        once; any other sends its output on to the next node and answers when that node does
        (from the thread that reads the next node's replies). Used by ForwardStream and by the
        data port (transport/dataplane.py). A follow-up batch waits for its input token (see
        node/followup.py)."""
        rid = request.request_id
        if any(c.follow for c in request.chunks):
            self.follow.follow_up(request, answer)
            return
        try:
            loaded, y, stage_ms = self.compute(request, ORDER_WAIT_S)
            if loaded.next_hop is None:
                reply = self.finish(loaded, request, y, stage_ms)
                reply.request_id = rid
                answer(reply)  # first: a follow-up step's answer must come after this one
                if loaded.stage.is_first:
                    self.follow.run_ready(self.follow.took(request, list(reply.tokens), ""), "")
                return
        except Refused as exc:
            answer(error_reply(rid, exc.message, exc.code.name))
            return
        t1 = time.perf_counter()
        first = loaded.stage.is_first

        def relay(f: Future[pb.ForwardReply]) -> None:
            exc = f.exception()
            if exc is not None:
                # (a refusal further down the chain keeps its code: the head fails the request
                # rather than the node)
                code = exc.code if isinstance(exc, StepRefused) else "UNAVAILABLE"
                answer(error_reply(rid, str(exc), code))
                if first:
                    self.follow.run_ready(self.follow.took(request, None, str(exc)), str(exc))
                return
            reply = self.relay(f.result(), stage_ms, (time.perf_counter() - t1) * 1e3)
            reply.request_id = rid
            if first:
                # The follow-up steps that waited for these tokens run before the answer goes
                # up: the head then reads it while the next node computes, not before this one
                # does (a head on this machine would otherwise be woken on this core first;
                # measured 0.5 ms per token of a two-node pool on loopback).
                self.follow.run_ready(
                    self.follow.took(request, list(reply.tokens), reply.error), reply.error
                )
            answer(reply)

        loaded.next_hop.link.send(self.downstream(loaded, request, y)).add_done_callback(relay)

    def serve_stream(
        self, request_iterator: Iterator[pb.ForwardRequest]
    ) -> Iterator[pb.ForwardReply]:
        """Forward for a stream of requests: each is computed as it arrives (in order) and sent on
        down this node's own link to the next node; replies go back as they complete."""
        out: queue.SimpleQueue[pb.ForwardReply | None] = queue.SimpleQueue()
        lock = threading.Lock()
        state = {"pending": 0, "ended": False}

        def emit(reply: pb.ForwardReply) -> None:
            out.put(reply)
            with lock:
                state["pending"] -= 1
                last = state["ended"] and state["pending"] == 0
            if last:
                out.put(None)

        def pump() -> None:
            try:
                for request in request_iterator:
                    with lock:
                        state["pending"] += 1
                    self.serve_forward(request, emit)
            except grpc.RpcError:
                pass  # the upstream went away; its in-flight answers have no one to go to
            finally:
                with lock:
                    state["ended"] = True
                    last = state["pending"] == 0
                if last:
                    out.put(None)

        threading.Thread(target=pump, name="potluck-forward-stream", daemon=True).start()
        while (reply := out.get()) is not None:
            yield reply

    def _wait_turn(self, stage: Stage, chunks: Sequence[pb.SeqChunk], wait_s: float) -> None:
        """Hold `self.turn` until every chunk's sequence is exactly at the chunk's position: batches
        of one sequence may arrive out of order when several are in flight (pipelining)."""
        deadline = time.monotonic() + wait_s
        said = False
        while True:
            late = None
            for c in chunks:
                at = stage.position(c.fork_from if c.fork else c.seq_id)
                if (c.rewind or c.fork) and at >= c.pos:
                    continue  # it may hold more: they are forgotten (rewind) or not copied
                if at > c.pos:
                    raise WireError(
                        f"sequence {c.seq_id} is at position {at} here, but a batch for position "
                        f"{c.pos} came: a repeated or stale batch"
                    )
                if at < c.pos:
                    late = (c, at)
            if late is None:
                return
            if not said:  # rare: batches of one sequence reach a node over one connection in order
                said = True
                log.info(
                    "sequence %d: the batch at position %d came before tokens %d–%d; it waits",
                    late[0].seq_id, late[0].pos, late[1], late[0].pos - 1,
                )  # fmt: skip
            left = deadline - time.monotonic()
            if left <= 0 or not self.turn.wait(left):
                c, at = late
                raise OrderError(
                    f"waited {wait_s:.0f} s for sequence {c.seq_id}'s tokens {at}–{c.pos - 1} before "
                    f"the batch at position {c.pos}; the head or the previous node lost a batch"
                )
