"""Follow-up decode steps on a first stage: the next token starts here, without a round trip to
the head.

`FollowUps` owns the last token the pool sampled for each (plan, sequence) as this node relayed
it, and the follow-up batches parked by (plan, sequence, position) until that token comes; a
parked batch is answered with an error if the batch before it fails or its sequence is dropped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from potluck.node.plans import PlanStore, Refused
from potluck.transport import potluck_pb2 as pb
from potluck.transport.codec import error_reply, id_tensor, penalizes, skipped_reply
from potluck.transport.dataplane import Answer


class FollowUps:
    """The follow-up batches of one node; `run` computes a batch and answers it (the forwarder's
    serve_forward)."""

    def __init__(self, plans: PlanStore, run: Callable[[pb.ForwardRequest, Answer], None]) -> None:
        self.plans, self.run = plans, run
        # The last token the pool sampled for each (plan, sequence) as this node relayed it, with
        # the position right after its batch; and the follow-up batches that wait for their
        # token, by (plan, sequence, position), with how to answer them (the head may send the
        # next before this node ran the last).
        self.lock = threading.Lock()
        self.sampled: dict[tuple[str, int], tuple[int, int]] = {}
        self.parked: dict[tuple[str, int, int], tuple[pb.ForwardRequest, Answer]] = {}

    def follow_up(self, request: pb.ForwardRequest, answer: Answer) -> None:
        """A decode step whose input id is the token the pool samples for its sequence's previous
        batch: run it as soon as this node relays that token (now, if it already did), so the
        pool computes the next token while the head is still receiving the last one."""
        rid = request.request_id
        c = request.chunks[0]
        try:
            loaded = self.plans.loaded(request.plan_id)
        except Refused as exc:
            answer(error_reply(rid, exc.message, exc.code.name))
            return
        why = ""
        if len(request.chunks) != 1 or c.n != 1:
            why = (
                f"a follow-up batch is one chunk of one token, got {[x.n for x in request.chunks]}"
            )
        elif not loaded.stage.is_first:
            why = f"a follow-up batch came to layers {loaded.stage.start}–{loaded.stage.stop - 1}; only the first stage takes one"
        if why:
            answer(error_reply(rid, why, "INVALID_ARGUMENT"))
            return
        with self.lock:
            got = self.sampled.get((request.plan_id, c.seq_id))
            if got is None or got[0] != c.pos:
                key = (request.plan_id, c.seq_id, c.pos)
                if key in self.parked:
                    why = f"a second follow-up batch for sequence {c.seq_id} at position {c.pos}"
                else:
                    self.parked[key] = (request, answer)
                    return
        if why or got is None:
            answer(error_reply(rid, why, "INVALID_ARGUMENT"))
            return
        self._run_follow_up(request, answer, got[1])

    def _run_follow_up(self, request: pb.ForwardRequest, answer: Answer, token: int) -> None:
        """The follow-up batch with its input id filled in (and added to its recent ids for the
        penalties), computed like any other; skipped if the id ends the generation."""
        if token in request.stop_ids:
            answer(skipped_reply(request.request_id))
            return
        c = request.chunks[0]
        c.follow = False
        request.input.CopyFrom(id_tensor(token))
        if c.sample and penalizes(c.sampling):  # the head sent the recent ids before this one
            c.recent.append(token)
            if c.sampling.repeat_last_n > 0:
                del c.recent[: -c.sampling.repeat_last_n]
        self.run(request, answer)

    def took(
        self, request: pb.ForwardRequest, tokens: list[int] | None, error: str
    ) -> list[tuple[pb.ForwardRequest, Answer, int]]:
        """This first stage has the tokens sampled for `request` (None: the request failed, and
        `error` says why): note them, and hand back the follow-up batches that waited for them,
        each with its input id (-1: none)."""
        ready = []
        with self.lock:
            for i, c in enumerate(request.chunks):
                if not c.sample:
                    continue
                token = tokens[i] if tokens is not None and not error else -1
                if c.draft:
                    # a checked draft: the pool stands where its kept drafts end, not at pos + n
                    # (the head's next step rewinds there, and a follow-up waits for that one;
                    # the head chains none on a drafted step)
                    self.sampled.pop((request.plan_id, c.seq_id), None)
                    continue
                if token >= 0:
                    self.sampled[(request.plan_id, c.seq_id)] = (c.pos + c.n, token)
                parked = self.parked.pop((request.plan_id, c.seq_id, c.pos + c.n), None)
                if parked is not None:
                    ready.append((*parked, token))
        return ready

    def run_ready(self, ready: list[tuple[pb.ForwardRequest, Answer, int]], error: str) -> None:
        """Run the follow-up batches `took` handed back (in this thread), or fail them."""
        for req, ans, token in ready:
            if token >= 0:
                self._run_follow_up(req, ans, token)
            else:
                why = f"the batch before this follow-up failed: {error or 'no token'}"
                ans(error_reply(req.request_id, why, "UNAVAILABLE"))

    def forget(self, plan_id: str, seq_ids: Sequence[int] | None = None) -> None:
        """Drop the follow-up state of a plan (or of some of its sequences); a batch still waiting
        for its token is answered with an error."""

        def mine(key: tuple[str, int] | tuple[str, int, int]) -> bool:
            return key[0] == plan_id and (seq_ids is None or key[1] in seq_ids)

        with self.lock:
            for k in [k for k in self.sampled if mine(k)]:
                del self.sampled[k]
            parked = [self.parked.pop(k) for k in [k for k in self.parked if mine(k)]]
        for req, ans in parked:
            why = (
                f"sequence {req.chunks[0].seq_id} was dropped while this follow-up batch waited "
                "for its token"
            )
            ans(error_reply(req.request_id, why, "CANCELLED"))
