"""Load the replicas of a batch job (planner/replicas.py): one Model per replica, each with its own
pipeline, so that each runs its own scheduler.

A replica on a node is a pool of one node that holds every layer; this machine's replica is a
local model. No replica fails over to the others' machines: a replica whose node goes away ends
its requests with an error (a hung node after OFF_TIMEOUT_S), and the batch runner gives them to
the replicas left.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from potluck.engine.contract import Assignment
from potluck.engine.generate import Model, load_model
from potluck.planner import THIS_MACHINE, weight_sources
from potluck.planner.nodes import Links
from potluck.planner.replicas import Replica
from potluck.pool.survey import assignments_of
from potluck.transport.auth import PoolAuth


def load_replicas(
    path: Path,
    n_ctx: int | None,
    replicas: Sequence[Replica],
    nodes: Sequence[str],
    links: Links,
    auth: PoolAuth | None,
    n_seq: int,
) -> list[tuple[str, Model]]:
    """(label, model) per replica, in order; `nodes` (every node of the pool) may send weights
    to a node without the file. On an error, the replicas loaded so far are closed."""
    out: list[tuple[str, Model]] = []
    try:
        for r in replicas:
            if r.plan is not None:  # a pipeline over several nodes
                plan: Sequence[Assignment] = assignments_of(r.plan)
            elif r.nodes[0] == THIS_MACHINE:
                out.append((r.label, load_model(path, n_ctx, n_seq=n_seq)))
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
    from potluck.errors import PotluckError
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
