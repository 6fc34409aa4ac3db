"""A model over the pool: the pipeline of a plan (with failover), built here and handed to the
engine (engine/generate.py `load_model(build=...)`), which never builds a pool itself.

`pool_build` makes the engine's `Build` for a plan; `load_model` is the engine's with a pool's
arguments (the CLI's composition root and the tests use it): the plan's `assignments`, or
`peers` that share the layers with this machine by `tensor_split`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from potluck.engine.contract import DEFAULT_TIMEOUT_S, LOCAL, Assignment, Pipeline
from potluck.engine.generate import (
    Build,
    Model,
    Opened,
    layer_ranges,
    local_pipeline,
    split_points,
)
from potluck.engine.generate import load_model as open_model
from potluck.engine.local import LocalPipeline
from potluck.model.stage import DEFAULT_COMPUTE, Compute, Stage
from potluck.pool import failover
from potluck.pool.failover import FailoverPipeline
from potluck.pool.pipeline import RemotePipeline

if TYPE_CHECKING:
    from potluck.pool.failover import FailoverEvent
    from potluck.transport.auth import PoolAuth


def load_model(
    path: str | Path,
    n_ctx: int | None = None,
    splits: Sequence[int] = (),
    on_layer: Callable[[int], None] | None = None,
    peers: Sequence[str] = (),
    tensor_split: Sequence[float] = (),
    wire_dtype: str = "float32",
    assignments: Sequence[Assignment] = (),
    auth: PoolAuth | None = None,
    failover_s: float | None = DEFAULT_TIMEOUT_S,
    replan: Callable[[list[str]], Sequence[Assignment]] | None = None,
    on_failover: Callable[[FailoverEvent], None] | None = None,
    on_transfer: Callable[[str, int, int], None] | None = None,
    n_seq: int = 1,
    loras: Sequence[tuple[Path, float]] = (),
    compute: Compute = DEFAULT_COMPUTE,
    cache: Path | None = None,
) -> Model:
    """The engine's `load_model` over a pool: exactly the given `assignments` (the planner's,
    pool/survey.py), or with `peers` (host:port) a pool where this machine takes the first share
    of the layers and each peer the next, in proportion to `tensor_split` (even by default); with
    neither, this machine alone (in-process stages split at `splits`). `auth` (the pool secret,
    TLS) is how this machine proves membership to the nodes.

    A pool fails over (pool/failover.py): a node silent for `failover_s` seconds is dropped, and
    `replan(surviving nodes)` gives the new assignments (default: the layers evenly over this
    machine and the survivors). failover_s = 0: no failover, but a node silent for OFF_TIMEOUT_S
    ends the request with an error (the CLI's --failover-timeout 0); None: a bare pipeline, no
    heartbeat at all (measurements, tests). n_seq: sequences at once (serve's -np), for which
    every node checks its memory (KV for each at n_ctx). loras: each node gets its layers' part.
    cache: where a pool's file and tensor hashes are remembered (Places.cache; None: hashed each
    time)."""

    def build(opened: Opened) -> Pipeline:
        hp = opened.hp
        plan = list(assignments)
        if not plan and peers:
            nodes = [LOCAL, *peers]
            bounds = split_points(hp.n_layer, tensor_split or [1.0] * len(nodes))
            if len(bounds) + 1 != len(nodes):
                raise ValueError(
                    f"--tensor-split needs one share per node ({len(nodes)}: this machine + "
                    f"{len(peers)} peers)"
                )
            ranges = layer_ranges(hp.n_layer, bounds)
            plan = [Assignment(n, a, b) for n, (a, b) in zip(nodes, ranges, strict=True) if b > a]
        if not plan:
            return local_pipeline(opened, compute, splits, on_layer)
        if len(plan) == 1 and plan[0].node == LOCAL:
            return local_pipeline(opened, compute, (), on_layer)
        return pool_build(
            plan, wire_dtype, auth, failover_s, replan, on_failover, on_transfer, n_seq,
            compute, cache,
        )(opened)  # fmt: skip

    return open_model(path, n_ctx, splits, on_layer, n_seq, loras, compute, build)


def pool_build(
    plan: Sequence[Assignment],
    wire_dtype: str = "float32",
    auth: PoolAuth | None = None,
    failover_s: float | None = DEFAULT_TIMEOUT_S,
    replan: Callable[[list[str]], Sequence[Assignment]] | None = None,
    on_failover: Callable[[FailoverEvent], None] | None = None,
    on_transfer: Callable[[str, int, int], None] | None = None,
    n_seq: int = 1,
    compute: Compute = DEFAULT_COMPUTE,
    cache: Path | None = None,
) -> Build:
    """The engine's Build for `plan`: its RemotePipeline, wrapped to fail over to the nodes left
    when one goes away (failover_s as `load_model` says)."""

    def build(o: Opened) -> Pipeline:
        hp = o.hp
        first = RemotePipeline(
            o.file, hp, plan, o.n_ctx, wire_dtype, auth, on_transfer=on_transfer, n_seq=n_seq,
            adapters=o.adapters, compute=compute, cache=cache,
        )  # fmt: skip
        if failover_s is None:
            return first
        if failover_s == 0:  # watched, not re-planned: a hung node ends the request, not the head
            # (read at the call: tests shorten it)
            return FailoverPipeline(first, None, failover.OFF_TIMEOUT_S, on_failover)
        remotes = [a.node for a in plan if a.node != LOCAL]

        def connect(gone: frozenset[str], epoch: int) -> Pipeline:
            alive = [n for n in remotes if n not in gone]
            if replan is not None:
                new = list(replan(alive))
            else:  # even over this machine and the survivors
                nodes = [LOCAL, *alive][: hp.n_layer]
                ranges = layer_ranges(hp.n_layer, split_points(hp.n_layer, [1.0] * len(nodes)))
                new = [Assignment(n, a, b) for n, (a, b) in zip(nodes, ranges, strict=True)]
            if all(a.node == LOCAL for a in new):
                whole = Stage(
                    hp, o.file, 0, hp.n_layer, o.n_ctx, adapters=o.adapters, compute=compute
                )
                return LocalPipeline([whole])
            return RemotePipeline(
                o.file, hp, new, o.n_ctx, wire_dtype, auth, epoch, on_transfer, n_seq=n_seq,
                adapters=o.adapters, compute=compute, cache=cache,
            )  # fmt: skip

        return FailoverPipeline(first, connect, failover_s, on_failover)

    return build
