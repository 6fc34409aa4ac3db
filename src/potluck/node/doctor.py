"""A node's side of `potluck doctor`: what it says about itself and its speed under sustained load.

The load probe streams synthetic Q4_0 weights like node/probe.py's decode benchmark through
ggml's batch-1 products, back to back, and reports throughput per interval (weight bytes / wall second).
Throughput, not the median call: a CPU that slows down (heat, power limits, another program
taking the cores) shows as fewer calls per second even when each call alone looks the same.
"""

from __future__ import annotations

import os
import platform
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import psutil
from gguf import GGMLQuantizationType

from potluck.node.probe import physical_cores, usable_memory_bytes

_N, _K, _LAYERS = 4096, 4096, 4  # 4 × 9 MiB of Q4_0 weights, larger than the caches
MAX_LOAD_S = 600.0  # a node refuses a longer load probe
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.1, 10.0


@dataclass(frozen=True)
class SelfDescription:
    threads: int  # compute threads this node uses (-t)
    physical_cores: int
    logical_cores: int
    os: str  # platform.system()
    memory_bytes: int  # usable now, after OS headroom


def describe(threads: int) -> SelfDescription:
    """threads: the compute threads this process uses (-t)."""
    return SelfDescription(
        threads=threads,
        physical_cores=physical_cores(),
        logical_cores=psutil.cpu_count(logical=True) or os.cpu_count() or 1,
        os=platform.system(),
        memory_bytes=usable_memory_bytes(),
    )


def load_samples(
    seconds: float,
    interval: float,
    threads: int,
    lock: AbstractContextManager[object] | threading.Lock | None = None,
) -> Iterator[tuple[float, float]]:
    """Run the decode kernel for `seconds`; yield (seconds since start, weight bytes/s) once per
    `interval`. `lock` is held for each interval only (a node's compute lock: a stage's forward
    passes still get their turn between intervals). threads: the process's compute threads (-t)."""
    from potluck.model.matvec import MatVec

    probe = MatVec(GGMLQuantizationType.Q4_0, _N, _K, _LAYERS, threads)
    for i in range(len(probe)):  # warm-up
        probe.run(i)
    guard = lock if lock is not None else nullcontext()
    t_start = time.perf_counter()
    end = t_start + seconds
    while True:
        now = time.perf_counter()
        if now >= end:
            return
        calls = 0
        with guard:
            t0 = time.perf_counter()
            stop = min(t0 + interval, end)
            while time.perf_counter() < stop:
                probe.run(calls % len(probe))
                calls += 1
            t1 = time.perf_counter()
        yield t1 - t_start, calls * probe.nbytes / (t1 - t0)
