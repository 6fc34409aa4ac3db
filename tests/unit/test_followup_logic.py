"""A first node's follow-up steps (node/followup.py) after a checked draft: the step after it
rewinds the sequence, and a follow-up chained on that step must wait for its token, not take the
one the drafted step gave (its position, pos + n, is where the rewind leaves the pool too).
Found by bench/bench_spec.py: over a pool, a token came out twice ("stir stir"). The node's
plans are a stand-in here (the first stage's `is_first` is all follow_up reads)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from potluck.node.followup import FollowUps
from potluck.transport import potluck_pb2 as pb
from potluck.transport.codec import id_tensor, tensor_from_proto
from potluck.transport.dataplane import Answer


class _Plans:
    def loaded(self, plan_id: str) -> SimpleNamespace:
        return SimpleNamespace(stage=SimpleNamespace(is_first=True, start=0, stop=1))


def _request(**chunk: object) -> pb.ForwardRequest:
    return pb.ForwardRequest(
        plan_id="p", chunks=[pb.SeqChunk(seq_id=1, sample=True, **chunk)], input=id_tensor(0)
    )


def test_a_follow_up_after_a_rewound_step_waits_for_that_steps_token() -> None:
    ran: list[pb.ForwardRequest] = []
    answered: list[pb.ForwardReply] = []
    fu = FollowUps(_Plans(), lambda req, ans: ran.append(req))  # type: ignore[arg-type]
    # a drafted step at 175..183, its last draft not kept: it gives token 28 ...
    drafted = _request(n=9, pos=175, draft=[5, 6, 7, 8, 9, 10, 11, 12])
    assert fu.took(drafted, [28], "") == []
    # ... the head's next step rewinds to 183 (in flight), and the follow-up on it comes first
    rewound = _request(n=1, pos=183, rewind=True)
    follow = _request(n=1, pos=184, follow=True)
    answer: Answer = answered.append
    fu.follow_up(follow, answer)
    assert ran == [] and answered == []  # parked: 28 is not its input
    fu.run_ready(fu.took(rewound, [12822], ""), "")
    (req,) = ran
    assert tensor_from_proto(req.input).tolist() == [12822]
    assert not req.chunks[0].follow


def test_a_follow_up_after_a_plain_step_runs_with_its_token() -> None:
    ran: list[pb.ForwardRequest] = []
    fu = FollowUps(_Plans(), lambda req, ans: ran.append(req))  # type: ignore[arg-type]
    fu.took(_request(n=1, pos=40), [7], "")
    fu.follow_up(_request(n=1, pos=41, follow=True), lambda r: None)
    (req,) = ran
    assert np.asarray(tensor_from_proto(req.input)).tolist() == [7]
