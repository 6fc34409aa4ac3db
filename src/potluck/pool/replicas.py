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
from pathlib import Path
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from potluck.engine.contract import Assignment
from potluck.engine.generate import Model, load_model
from potluck.errors import PotluckError
from potluck.model.stage import DEFAULT_COMPUTE, Compute
from potluck.planner import THIS_MACHINE, weight_sources
from potluck.planner.errors import NotEnoughMemoryError
from potluck.planner.nodes import Links
from potluck.planner.replicas import Replica, plan_replicas
from potluck.pool.planning import PlanInputs, survey_model
from potluck.pool.survey import assignments_of
from potluck.transport.auth import PoolAuth

if TYPE_CHECKING:
    from potluck.discovery.pool import PeerFinder

App = TypeVar("App")  # a replica's app (api/: an ASGI app)
Reload = Callable[[str], "Model | None"]  # reload(label): a failed replica loaded again, or None


def load_replicas(
    path: Path,
    n_ctx: int | None,
    replicas: Sequence[Replica],
    nodes: Sequence[str],
    links: Links,
    auth: PoolAuth | None,
    n_seq: int,
    compute: Compute = DEFAULT_COMPUTE,
) -> list[tuple[str, Model]]:
    """(label, model) per replica, in order; `nodes` (every node of the pool) may send weights
    to a node without the file; this machine's replica computes with `compute`. On an error,
    the replicas loaded so far are closed."""
    out: list[tuple[str, Model]] = []
    try:
        for r in replicas:
            if r.plan is not None:  # a pipeline over several nodes
                plan: Sequence[Assignment] = assignments_of(r.plan)
            elif r.nodes[0] == THIS_MACHINE:
                out.append((r.label, load_model(path, n_ctx, n_seq=n_seq, compute=compute)))
                continue
            else:
                node = r.nodes[0]
                sources = tuple(weight_sources(node, nodes, links))
                hp_layers = _n_layer(path)
                plan = [Assignment(node, 0, hp_layers, sources=sources)]
            model = load_model(
                path, n_ctx, assignments=plan, auth=auth, failover_s=0, n_seq=n_seq
            )  # fmt: skip
            out.append((r.label, model))
    except BaseException:
        for _, m in out:
            m.close()
        raise
    return out


def reloader(
    path: Path,
    n_ctx: int | None,
    replicas: Sequence[Replica],
    nodes: Sequence[str],
    links: Links,
    auth: PoolAuth | None,
    n_seq: int,
) -> Callable[[str], Model | None]:
    """reload(label): the replica of that label loaded again if it is a single machine that
    answers now; else None (a pipeline, this machine, not back yet, or the load failed).
    Blocking: the batch runner calls it on a thread."""
    by_label = {r.label: r for r in replicas}

    def reload(label: str) -> Model | None:
        r = by_label.get(label)
        return None if r is None else _reload(path, n_ctx, r, nodes, links, auth, n_seq)

    return reload


def _reload(
    path: Path,
    n_ctx: int | None,
    replica: Replica,
    nodes: Sequence[str],
    links: Links,
    auth: PoolAuth | None,
    n_seq: int,
) -> Model | None:
    from potluck.transport.client import NodeClient

    node = replica.nodes[0]
    if replica.plan is not None or node == THIS_MACHINE:
        return None  # this machine's replica does not fail; a pipeline is not reloaded
    client = NodeClient(node, auth)
    try:
        client.hello(timeout=2.0)
    except PotluckError:
        return None  # not back yet
    finally:
        client.close()
    try:
        return load_replicas(path, n_ctx, [replica], nodes, links, auth, n_seq)[0][1]
    except PotluckError:
        return None


def _n_layer(path: Path) -> int:
    from potluck.modelfile.gguf_file import GGUFFile
    from potluck.modelfile.hparams import hparams_from_metadata

    return hparams_from_metadata(GGUFFile(path).metadata, str(path)).n_layer


# -- which replicas a job gets, and the ones it gains while it runs ---------------------------------
class Say(Protocol):
    """A line for the user (the CLI prints it; notable: worth a colour, not dim)."""

    def __call__(self, text: str, notable: bool = False) -> None: ...


def batch_replicas(
    path: Path,
    n_ctx: int | None,
    addresses: Sequence[str],
    auth: PoolAuth,
    mem: int | None,
    n_seq: int,
    say: Say,
    compute: Compute = DEFAULT_COMPUTE,
) -> tuple[list[tuple[str, Model]], Reload]:
    """`potluck batch`'s replicas over the workers found, loaded: each machine that holds the
    whole model is a replica, the others one pipeline (planner/replicas.py); and reload(label),
    a failed single-machine replica loaded again once its machine answers (blocking). compute:
    how this machine computes (its speed is measured so, and its replica runs so)."""
    inputs = PlanInputs(path, n_ctx, auth, mem=mem, n_seq=n_seq, compute=compute)
    nodes, links, fp = survey_model(inputs, list(addresses))
    plan = plan_replicas(fp, nodes, links)
    for r in plan.replicas:
        how = "a pipeline" if r.plan is not None else "the whole model"
        say(f"replica {r.label}: {how}, {r.tokens_per_s:.1f} tok/s per stream")
    for node, why in plan.left_out:
        say(f"  left out {node}: {why}")
    names = [n.name for n in nodes]
    reload = reloader(path, n_ctx, plan.replicas, names, links, auth, n_seq)
    loaded = load_replicas(path, n_ctx, plan.replicas, names, links, auth, n_seq, compute)
    return loaded, reload


def idle_replicas(
    path: Path, n_ctx: int | None, idle: Sequence[str], auth: PoolAuth, n_seq: int, say: Say
) -> tuple[list[tuple[str, Model]], Reload | None]:
    """Batch replicas for `serve` on the workers its plan leaves idle: each that can hold the
    whole model alone (this machine serves, so it offers none); none when none can."""
    # this machine serves: it offers no memory for a replica
    nodes, links, fp = survey_model(PlanInputs(path, n_ctx, auth, mem=0, n_seq=n_seq), list(idle))
    try:
        plan = plan_replicas(fp, nodes, links)
    except NotEnoughMemoryError as exc:
        say(f"no batch replicas on the idle workers: {exc}")
        return [], None
    usable = [r for r in plan.replicas if r.plan is None and r.nodes[0] != THIS_MACHINE]
    for r in usable:
        say(f"batch replica {r.label}: the whole model, for batch jobs")
    names = [n.name for n in nodes]
    reload = reloader(path, n_ctx, usable, names, links, auth, n_seq)
    return load_replicas(path, n_ctx, usable, names, links, auth, n_seq), reload


class Recruiter(Generic[App]):
    """The replicas a running job gains (the batch runner's revive and join, api/batch.Recruit):
    a failed one whose worker is back, loaded again; each worker found since the start (a
    peers-file or mDNS worker started later) that can hold the whole model, loaded as a replica
    of its own. make_app(model) -> the replica's app; `replicas` ([(label, Model)]) gets each
    model loaded, for closing."""

    def __init__(
        self, path: Path, n_ctx: int | None, finder: PeerFinder, known: Sequence[str],
        auth: PoolAuth, n_seq: int, make_app: Callable[[Model], App],
        replicas: list[tuple[str, Model]], say: Say,
    ) -> None:  # fmt: skip
        self.path, self.n_ctx, self.finder, self.n_seq = path, n_ctx, finder, n_seq
        self.known: set[str] = set(known)  # workers used or tried already
        self.auth, self.make_app, self.replicas, self.say = auth, make_app, replicas, say
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
            loaded, reload = await asyncio.to_thread(
                idle_replicas, self.path, self.n_ctx, new, self.auth, self.n_seq, self.say
            )
        except PotluckError as exc:
            self.say(f"worker {', '.join(new)} found, but not used: {exc}", notable=True)
            return []
        self.add(loaded, reload)
        self.replicas.extend(loaded)
        return [(label, self.make_app(m)) for label, m in loaded]

    def _newcomers(self) -> list[str]:
        from potluck.discovery.pool import member
        from potluck.transport.client import NodeClient

        admit = member(lambda a: NodeClient(a, self.auth))
        found = self.finder.again(lambda p: "" if p.address in self.known else admit(p))
        return [p.address for p in found.peers if p.address not in self.known]
