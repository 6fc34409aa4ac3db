"""Ask every node what it can do and time the links to it: the planner's inputs."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc

from potluck.engine.contract import LOCAL, Assignment
from potluck.errors import PotluckError
from potluck.model.stage import DEFAULT_COMPUTE, Compute
from potluck.modelfile.gguf_file import Matrix
from potluck.node.probe import (
    decode_bytes_per_s,
    gpu_offer,
    model_bytes_per_s,
    physical_cores,
    usable_memory_bytes,
)
from potluck.planner import DEFAULT_LINK, THIS_MACHINE, Link, NodeInfo, Plan
from potluck.transport.auth import PoolAuth
from potluck.transport.client import NodeClient
from potluck.transport.linkprobe import quick_link

if TYPE_CHECKING:
    from potluck.transport import potluck_pb2 as pb

__all__ = ["THIS_MACHINE", "assignments_of", "node_info", "survey", "this_machine"]


def this_machine(
    mem_limit: int | None = None,
    matrices: tuple[Matrix, ...] = (),
    compute: Compute = DEFAULT_COMPUTE,
) -> NodeInfo:
    """What this machine offers: its usable RAM (at most mem_limit: the head's --mem; 0 = no
    layers here), cores, measured speed (through `matrices`, one layer of the model being
    planned, when given; else the generic probe) with compute's threads, and compute's GPU."""
    gpu = gpu_offer(compute.gpu)
    free = usable_memory_bytes()
    free = free if mem_limit is None else min(free, mem_limit)
    if mem_limit == 0:  # no layers here: its speed plays no part, and timing it takes a second
        speed = decode_bytes_per_s(0.05, compute.n_threads)
    elif matrices:
        speed = model_bytes_per_s(matrices, compute.n_threads)
    else:
        speed = decode_bytes_per_s(threads=compute.n_threads)
    cpu = (free, physical_cores(), speed)
    if gpu is None:
        return NodeInfo(THIS_MACHINE, "cpu", *cpu)
    return NodeInfo(THIS_MACHINE, "gpu", *cpu, gpu.memory_bytes, gpu.bytes_per_s, gpu.max_layers)


def node_info(
    address: str, reply: pb.HelloReply, default_speed: float, model_sha256: str = ""
) -> NodeInfo:
    """What a node's Hello says it offers: its RAM and CPU speed, a GPU where it offers one, and
    whether it has the model file whose hash is `model_sha256` ("": not known here)."""
    ram = next((d.memory_bytes for d in reply.devices if d.kind == "cpu"), 0)
    speed = reply.decode_bytes_per_s or default_speed
    cores = max(1, reply.physical_cores)
    has = bool(model_sha256) and model_sha256 in reply.model_sha256
    gpu = next((d for d in reply.devices if d.kind == "gpu" and d.bytes_per_s > 0), None)
    if gpu is None:
        return NodeInfo(address, "cpu", ram, cores, speed, has_model=has)
    return NodeInfo(
        address, "gpu", ram, cores, speed,
        gpu.memory_bytes, gpu.bytes_per_s, gpu.max_layers or 1 << 30, has,
    )  # fmt: skip


def survey(
    peers: Sequence[str],
    pings: int = 5,
    auth: PoolAuth | None = None,
    mem_limit: int | None = None,
    matrices: tuple[Matrix, ...] = (),
    compute: Compute = DEFAULT_COMPUTE,
    model_sha256: str = "",
) -> tuple[list[NodeInfo], dict[tuple[str, str], Link]]:
    """This machine plus every peer (Hello: memory, cores, measured speed), and every link the
    planner may use, measured: head→peer (latency from the Hello round trips, bandwidth from one
    1 MiB Echo) and peer↔peer (each pair measured once by one of its nodes, ProbeLink; links are
    taken as symmetric). A pair that cannot be measured keeps the planner's conservative default.
    mem_limit: the most this machine offers (the head's --mem). matrices: one layer of the model
    being planned; every node times its decode through them (ProbeSpeed), one node after the
    other (nodes that share a machine must not time each other), instead of the generic probe.
    compute: how this machine computes (its threads and GPU, as it will load its stage).
    model_sha256: the model file's hash, when known: which peers have the file ("": none known)."""
    nodes = [this_machine(mem_limit, matrices, compute)]
    links: dict[tuple[str, str], Link] = {}
    clients = {}
    try:
        for address in peers:
            client = clients[address] = NodeClient(address, auth)  # proves membership first
            rtts, reply = [], None
            for _ in range(pings):
                t0 = time.perf_counter()
                reply = client.hello(THIS_MACHINE)
                rtts.append(time.perf_counter() - t0)
            assert reply is not None
            node = node_info(address, reply, nodes[0].cpu_bytes_per_s, model_sha256)
            if matrices:
                with contextlib.suppress(PotluckError):  # an older node: its generic figure
                    speed = client.decode_speed(matrices)
                    if speed > 0:
                        node = dataclasses.replace(node, cpu_bytes_per_s=speed)
            nodes.append(node)
            rtts.sort()
            bw = DEFAULT_LINK.bytes_per_s
            with contextlib.suppress(PotluckError, grpc.RpcError):  # an older node: no Echo
                bw = quick_link(client).bytes_per_s
            links[(THIS_MACHINE, address)] = Link(rtts[len(rtts) // 2] / 2, bw)
        for i, a in enumerate(peers):
            for b in peers[i + 1 :]:
                try:
                    r = clients[a].probe_link(b)
                except PotluckError:
                    continue  # the default stands for this pair
                link = Link(r.latency_s, max(r.bytes_per_s, 1.0))
                links[(a, b)] = links[(b, a)] = link
    finally:
        for client in clients.values():
            client.close()
    return nodes, links


def assignments_of(plan: Plan) -> list[Assignment]:
    """The plan's stages as the head runs them. The head can only run the first stage itself, so
    if the plan puts this machine later in the chain, its stage moves to the front with the same
    number of layers (the ranges shift; layers are near-equal in size, so the memory check holds
    up to the embedding/head difference, which the worker's own load still checks)."""
    order = sorted(plan.stages, key=lambda st: st.node != THIS_MACHINE)  # stable: keeps the rest
    out, start = [], 0
    for st in order:
        n = st.stop - st.start
        gpu = st.n_gpu_layers + (1 if st.head_on_gpu else 0)  # (Stage's -ngl: head past them)
        node = LOCAL if st.node == THIS_MACHINE else st.node
        gpu_layers = min(gpu, n + 1) if gpu else 0
        out.append(
            Assignment(node, start, start + n, gpu_layers, st.weight_sources, st.ram_experts)
        )
        start += n
    return out
