"""Load the replicas of a batch job (planner/replicas.py): one Model per replica, each with its own
pipeline, so that each runs its own scheduler.

A replica on a node is a pool of one node that holds every layer; this machine's replica is a
local model. No replica fails over to the others' machines: a replica whose node goes away ends
its requests with an error (a hung node after OFF_TIMEOUT_S), and the batch runner gives them to
the replicas left.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from potluck.engine.contract import Assignment
from potluck.engine.generate import Model
from potluck.errors import PotluckError
from potluck.model.stage import DEFAULT_COMPUTE, Compute
from potluck.planner import THIS_MACHINE, weight_sources
from potluck.planner.errors import NotEnoughMemoryError
from potluck.planner.nodes import Links, NodeInfo
from potluck.planner.replicas import Replica, plan_replicas
from potluck.pool.build import load_model
from potluck.pool.planning import PlanInputs, survey_model
from potluck.pool.survey import assignments_of
from potluck.transport.auth import PoolAuth

if TYPE_CHECKING:
    from potluck.discovery.pool import PeerFinder

App = TypeVar("App")  # a replica's app (api/: an ASGI app)
Reload = Callable[[str], "Model | None"]  # reload(label): a failed replica loaded again, or None


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica of a job loads: the model, its context (None: the default) and the
    sequences at once each replica serves, how this head proves membership, how this machine
    computes its own replica, and where the model's hashes are remembered (Places.cache)."""

    path: Path
    n_ctx: int | None
    auth: PoolAuth | None
    n_seq: int
    compute: Compute = DEFAULT_COMPUTE
    cache: Path | None = None


def load_replicas(
    spec: ReplicaSpec, replicas: Sequence[Replica], nodes: Sequence[NodeInfo], links: Links
) -> list[tuple[str, Model]]:
    """(label, model) per replica, in order; `nodes` (every node of the pool) may send weights
    to a node without the file. On an error, the replicas loaded so far are closed."""
    out: list[tuple[str, Model]] = []
    try:
        for r in replicas:
            if r.plan is not None:  # a pipeline over several nodes
                plan: Sequence[Assignment] = assignments_of(r.plan)
            elif r.nodes[0] == THIS_MACHINE:
                model = load_model(
                    spec.path, spec.n_ctx, n_seq=spec.n_seq, compute=spec.compute
                )  # fmt: skip
                out.append((r.label, model))
                continue
            else:
                node = r.nodes[0]
                names, holders = [n.name for n in nodes], [n.name for n in nodes if n.has_model]
                sources = tuple(weight_sources(node, names, links, holders=holders))
                plan = [Assignment(node, 0, _n_layer(spec.path), sources=sources)]
            model = load_model(
                spec.path, spec.n_ctx, assignments=plan, auth=spec.auth, failover_s=0,
                n_seq=spec.n_seq, cache=spec.cache,
            )  # fmt: skip
            out.append((r.label, model))
    except BaseException:
        for _, m in out:
            m.close()
        raise
    return out


def reloader(
    spec: ReplicaSpec, replicas: Sequence[Replica], nodes: Sequence[NodeInfo], links: Links
) -> Callable[[str], Model | None]:
    """reload(label): the replica of that label loaded again if it is a single machine that
    answers now; else None (a pipeline, this machine, not back yet, or the load failed).
    Blocking: the batch runner calls it on a thread."""
    by_label = {r.label: r for r in replicas}

    def reload(label: str) -> Model | None:
        r = by_label.get(label)
        return None if r is None else _reload(spec, r, nodes, links)

    return reload


def _reload(
    spec: ReplicaSpec, replica: Replica, nodes: Sequence[NodeInfo], links: Links
) -> Model | None:
    from potluck.transport.client import NodeClient

    node = replica.nodes[0]
    if replica.plan is not None or node == THIS_MACHINE:
        return None  # this machine's replica does not fail; a pipeline is not reloaded
    client = NodeClient(node, spec.auth)
    try:
        client.hello(timeout=2.0)
    except PotluckError:
        return None  # not back yet
    finally:
        client.close()
    try:
        return load_replicas(spec, [replica], nodes, links)[0][1]
    except PotluckError:
        return None


def _n_layer(path: Path) -> int:
    from potluck.model.archs import hparams_from_metadata
    from potluck.modelfile.gguf_file import GGUFFile

    return hparams_from_metadata(GGUFFile(path).metadata, str(path)).n_layer


# -- which replicas a job gets, and the ones it gains while it runs ---------------------------------
class Say(Protocol):
    """A line for the user (the CLI prints it; notable: worth a colour, not dim)."""

    def __call__(self, text: str, notable: bool = False) -> None: ...


def batch_replicas(
    spec: ReplicaSpec, addresses: Sequence[str], mem: int | None, say: Say
) -> tuple[list[tuple[str, Model]], Reload]:
    """`potluck batch`'s replicas over the workers found, loaded: each machine that holds the
    whole model is a replica, the others one pipeline (planner/replicas.py); and reload(label),
    a failed single-machine replica loaded again once its machine answers (blocking). mem: the
    most this machine offers (--mem; 0: no replica here)."""
    inputs = PlanInputs(
        spec.path, spec.n_ctx, spec.auth, mem=mem, n_seq=spec.n_seq, compute=spec.compute,
        cache=spec.cache,
    )  # fmt: skip
    nodes, links, fp = survey_model(inputs, list(addresses))
    plan = plan_replicas(fp, nodes, links)
    for r in plan.replicas:
        how = "a pipeline" if r.plan is not None else "the whole model"
        say(f"replica {r.label}: {how}, {r.tokens_per_s:.1f} tok/s per stream")
    for node, why in plan.left_out:
        say(f"  left out {node}: {why}")
    reload = reloader(spec, plan.replicas, nodes, links)
    return load_replicas(spec, plan.replicas, nodes, links), reload


def idle_replicas(
    spec: ReplicaSpec, idle: Sequence[str], say: Say
) -> tuple[list[tuple[str, Model]], Reload | None]:
    """Batch replicas for `serve` on the workers its plan leaves idle: each that can hold the
    whole model alone (this machine serves, so it offers none); none when none can."""
    # this machine serves: it offers no memory for a replica
    inputs = PlanInputs(spec.path, spec.n_ctx, spec.auth, mem=0, n_seq=spec.n_seq, cache=spec.cache)
    nodes, links, fp = survey_model(inputs, list(idle))
    try:
        plan = plan_replicas(fp, nodes, links)
    except NotEnoughMemoryError as exc:
        say(f"no batch replicas on the idle workers: {exc}")
        return [], None
    usable = [r for r in plan.replicas if r.plan is None and r.nodes[0] != THIS_MACHINE]
    for r in usable:
        say(f"batch replica {r.label}: the whole model, for batch jobs")
    reload = reloader(spec, usable, nodes, links)
    return load_replicas(spec, usable, nodes, links), reload


class Recruiter(Generic[App]):
    """The replicas a running job gains (the batch runner's revive and join, api/batch.Recruit):
    a failed one whose worker is back, loaded again; each worker found since the start (a
    peers-file or mDNS worker started later) that can hold the whole model, loaded as a replica
    of its own. make_app(model) -> the replica's app; `replicas` ([(label, Model)]) gets each
    model loaded, for closing."""

    def __init__(
        self, spec: ReplicaSpec, finder: PeerFinder, known: Sequence[str],
        make_app: Callable[[Model], App], replicas: list[tuple[str, Model]], say: Say,
    ) -> None:  # fmt: skip
        self.spec, self.finder = spec, finder
        self.known: set[str] = set(known)  # workers used or tried already
        self.make_app, self.replicas, self.say = make_app, replicas, say
        self.reloads: dict[str, Reload] = {}  # label -> reload(label)

    def add(self, loaded: Sequence[tuple[str, Model]], reload: Reload | None) -> None:
        for label, _ in loaded:
            if reload is not None:
                self.reloads[label] = reload

    async def revive(self, label: str) -> App | None:
        reload = self.reloads.get(label)
        m = await asyncio.to_thread(reload, label) if reload is not None else None
        if m is None:
            return None
        self.replicas.append((label, m))
        return self.make_app(m)

    async def join(self) -> list[tuple[str, App]]:
        new = await asyncio.to_thread(self._newcomers)
        if not new:
            return []
        self.known.update(new)
        try:
            loaded, reload = await asyncio.to_thread(idle_replicas, self.spec, new, self.say)
        except PotluckError as exc:
            self.say(f"worker {', '.join(new)} found, but not used: {exc}", notable=True)
            return []
        self.add(loaded, reload)
        self.replicas.extend(loaded)
        return [(label, self.make_app(m)) for label, m in loaded]

    def _newcomers(self) -> list[str]:
        from potluck.discovery.pool import member
        from potluck.transport.client import NodeClient

        admit = member(lambda a: NodeClient(a, self.spec.auth))
        found = self.finder.again(lambda p: "" if p.address in self.known else admit(p))
        return [p.address for p in found.peers if p.address not in self.known]
