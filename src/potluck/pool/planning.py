"""Planning a pool for one model: survey the nodes, run the planner, re-plan after a failover.

The policy the commands share (cli/ only wires flags into `PlanInputs`): a --tensor-split keeps
its shares for the nodes left after a failover when it can; `potluck bench` compares with an even
pool when the planner would use one machine alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from potluck.engine.contract import Assignment
from potluck.errors import PotluckError
from potluck.model.stage import DEFAULT_COMPUTE, Compute
from potluck.planner import ModelFootprint, NodeInfo, Plan, plan_pool
from potluck.planner.nodes import Links
from potluck.pool.survey import assignments_of
from potluck.transport.auth import PoolAuth


@dataclass(frozen=True)
class PlanInputs:
    """What a plan is made for: the model and context, how this head proves membership, what the
    planner evens out ("prompt" for one conversation, "decode" for many streams), the most memory
    this machine offers for layers (None: what it has; 0: none), the sequences at once whose
    KV cache every node must hold, how this machine computes (threads, GPU), and where it
    remembers file hashes (Places.cache; None: nowhere, so no peer is known to have the file)."""

    path: Path
    ctx: int | None
    auth: PoolAuth | None = None
    balance: str = "prompt"
    mem: int | None = None
    n_seq: int = 1
    compute: Compute = DEFAULT_COMPUTE
    cache: Path | None = None
    attended: int | None = None  # positions a decode step attends to (None: the planner's default)


def survey_model(
    inputs: PlanInputs, peers: Sequence[str]
) -> tuple[list[NodeInfo], Links, ModelFootprint]:
    """(nodes, links, footprint): what the planner takes, measured on this model: every node times
    its decode through the model's middle layer, and says whether it has the file (by its hash:
    hashed once and remembered in inputs.cache, as loading it would; no cache, no hash)."""
    from potluck.engine.generate import DEFAULT_CTX
    from potluck.model.archs import hparams_from_metadata
    from potluck.modelfile.gguf_file import GGUFFile, layer_matrices
    from potluck.node.weights import sha256_file
    from potluck.planner import footprint_from_gguf, held_bytes
    from potluck.pool.survey import survey

    f = GGUFFile(inputs.path)
    hp = hparams_from_metadata(f.metadata, str(inputs.path))
    n_ctx = inputs.ctx or min(hp.n_ctx_train, DEFAULT_CTX)
    layer = layer_matrices(f.tensors, hp.n_layer // 2, hp.n_expert_used)
    sha = sha256_file(inputs.path, inputs.cache) if inputs.cache else ""
    nodes, links = survey(
        list(peers), auth=inputs.auth, mem_limit=inputs.mem, matrices=layer,
        compute=inputs.compute, model_sha256=sha,
    )  # fmt: skip
    fp = footprint_from_gguf(
        f.tensors, hp, n_ctx, held=held_bytes, n_seq=inputs.n_seq, attended=inputs.attended
    )
    return nodes, links, fp


def plan_model(
    inputs: PlanInputs, peers: Sequence[str], shares: Sequence[float] | None = None
) -> Plan:
    """Survey the peers, then plan (with `shares`: a split by hand, this machine first)."""
    if shares and len(shares) != len(peers) + 1:  # the planner says so too, without the names
        shown, n = ",".join(f"{x:g}" for x in shares), len(peers) + 1
        raise PotluckError(
            f"--tensor-split {shown} has {len(shares)} shares but the pool has {n} "
            f"node{'s' * (n > 1)} ({', '.join(['this machine', *peers])}; a worker found twice "
            "counts once): give one share per node, this machine first"
        )
    nodes, links, fp = survey_model(inputs, peers)
    return plan_pool(fp, nodes, links, list(shares) if shares else None, inputs.balance)


def replanner(
    inputs: PlanInputs, peers: Sequence[str], shares: Sequence[float] | None = None
) -> Callable[[list[str]], list[Assignment]]:
    """The re-plan a failover calls with the nodes left: a --tensor-split keeps the shares of
    those left while they still fit; otherwise the planner chooses."""

    def replan(alive: list[str]) -> list[Assignment]:
        if shares and len(shares) == len(peers) + 1:
            kept = [shares[0]] + [x for a, x in zip(peers, shares[1:], strict=True) if a in alive]
            if any(kept):
                with contextlib.suppress(PotluckError):  # e.g. they no longer fit
                    return assignments_of(plan_model(inputs, alive, kept))
        return assignments_of(plan_model(inputs, alive))

    return replan


def plan_to_compare(
    inputs: PlanInputs, peers: Sequence[str], shares: Sequence[float] | None = None
) -> Plan:
    """The pool `potluck bench` measures: the planner's, or, when it would use one machine alone,
    the layers evenly over the pool (none here with --mem 0), to show what a pool does."""
    plan = plan_model(inputs, peers, shares)
    if len(assignments_of(plan)) == 1:
        even = [0.0 if inputs.mem == 0 else 1.0] + [1.0] * len(peers)
        plan = plan_model(inputs, peers, even)
    return plan
