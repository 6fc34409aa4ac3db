"""What the planner knows about the machines and the links between them: plain frozen numbers.

Workers measure these (usable memory after OS headroom, their decode speed through one layer of
the model being planned, link pings);
the planner only takes the numbers.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from potluck.planner.errors import PlanError

DEVICE_KINDS = ("cpu", "gpu", "cuda", "rocm", "mps")  # "gpu": any ggml GPU backend (Vulkan, …)
THIS_MACHINE = "this machine"  # the head's name among the nodes and in the links
# A peer whose measured link to a node is at least this fraction of the head's link counts as just
# as fast (measurements on one link differ by more than 10 % from run to run), and is asked first.
PEER_SOURCE_FRACTION = 0.75


@dataclass(frozen=True)
class NodeInfo:
    """One machine of the pool.

    memory_bytes: RAM usable for the model after OS headroom.
    cpu_bytes_per_s: weight bytes per second its CPU streams through decode (timed through one
    layer of the model being planned: node/probe.py model_bytes_per_s).
    device: its accelerator ("cpu" = none). gpu_memory_bytes / gpu_bytes_per_s: the same two numbers
    for the accelerator. On unified memory (mps) the worker splits its budget between the two
    before it reports: the planner counts them as separate pools.
    """

    name: str  # what the user sees and the plan names: a host:port or "this machine"
    device: str
    memory_bytes: int
    cores: int
    cpu_bytes_per_s: float
    gpu_memory_bytes: int = 0
    gpu_bytes_per_s: float = 0.0
    max_gpu_layers: int = 1 << 30  # the node's -ngl: at most this many of its layers on the GPU
    has_model: bool = False  # it has the model file (its Hello names the file's sha256)

    def __post_init__(self) -> None:
        if self.device not in DEVICE_KINDS:
            raise PlanError(
                f"node {self.name}: device {self.device!r} is not one of {', '.join(DEVICE_KINDS)}"
            )
        if self.memory_bytes < 0 or self.gpu_memory_bytes < 0 or self.cores < 1:
            raise PlanError(
                f"node {self.name}: memory ({self.memory_bytes}, gpu {self.gpu_memory_bytes}) "
                f"must be ≥ 0 and cores ({self.cores}) ≥ 1"
            )
        if not (math.isfinite(self.cpu_bytes_per_s) and self.cpu_bytes_per_s > 0):
            raise PlanError(f"node {self.name}: CPU speed {self.cpu_bytes_per_s} B/s must be > 0")
        if self.gpu_memory_bytes and self.device == "cpu":
            raise PlanError(f"node {self.name}: has GPU memory but its device is 'cpu'")
        if self.gpu_memory_bytes and not (
            math.isfinite(self.gpu_bytes_per_s) and self.gpu_bytes_per_s > 0
        ):
            raise PlanError(f"node {self.name}: GPU speed {self.gpu_bytes_per_s} B/s must be > 0")

    @property
    def uses_gpu(self) -> bool:
        """Whether layers go on the accelerator: it has memory and streams faster than the CPU."""
        return self.gpu_memory_bytes > 0 and self.gpu_bytes_per_s > self.cpu_bytes_per_s


@dataclass(frozen=True)
class Link:
    """One direction of a network path: one-way latency (half the round trip) and bandwidth."""

    latency_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0 and self.bytes_per_s > 0):
            raise PlanError(
                f"link latency {self.latency_s} s must be ≥ 0 and bandwidth {self.bytes_per_s} B/s > 0"
            )

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


# An unmeasured link must not make pooling look better than it will be: 1 ms one way is the slow
# end of a wired home LAN (0.1-0.3 ms) and what a good Wi-Fi link gives; 100 Mbit/s is Fast
# Ethernet, and about what Wi-Fi sustains through walls. Measured links always replace it.
DEFAULT_LINK = Link(latency_s=1e-3, bytes_per_s=100e6 / 8)

Links = Mapping[tuple[str, str], Link]


def link_between(links: Links, a: str, b: str) -> Link:
    """The link a -> b: measured that way, else measured b -> a (links are symmetric unless both
    directions are given), else DEFAULT_LINK."""
    return links.get((a, b)) or links.get((b, a)) or DEFAULT_LINK


def weight_sources(
    target: str,
    peers: Sequence[str],
    links: Links,
    head: str = THIS_MACHINE,
    holders: Collection[str] = (),
) -> list[str]:
    """The peers that node `target` should ask for the tensors it lacks before it asks the
    `head` (which always has the file), best first. A peer counts when its link to
    `target` carries at least PEER_SOURCE_FRACTION of the head's bandwidth to it: from a peer
    that is about as fast, the transfer spares the head's own link, which the head shares
    between every node it loads (and on a laptop is often Wi-Fi). A pair that was not measured
    counts as a tie, after the measured ones. `holders`, the peers known to have the file (their
    Hello names it), come first; another may have it without having hashed it: a peer without
    it says so at once, and the node asks the next."""
    via_head = links.get((head, target)) or links.get((target, head))
    measured: list[tuple[float, str]] = []
    unmeasured: list[str] = []
    for peer in dict.fromkeys(peers):
        if peer in (target, head):
            continue
        link = links.get((peer, target)) or links.get((target, peer))
        if link is None:
            unmeasured.append(peer)
        elif via_head is None or link.bytes_per_s >= PEER_SOURCE_FRACTION * via_head.bytes_per_s:
            measured.append((link.bytes_per_s, peer))
    measured.sort(key=lambda bw_peer: -bw_peer[0])
    ranked = [peer for _, peer in measured] + unmeasured
    return sorted(ranked, key=lambda peer: peer not in holders)  # (stable: holders first)
