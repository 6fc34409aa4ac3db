"""A node's side of `potluck doctor`: what it says about itself and its speed under sustained load.

The load probe streams the same packed-int4 weight as node/probe.py's decode benchmark through
batch-1 matmuls, back to back, and reports throughput per interval (weight bytes / wall second).
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
import torch

from potluck.node.probe import physical_cores, usable_memory_bytes

_N, _K, _GROUP = 4096, 4096, 32  # 8 MiB of int4 weights, larger than the caches, as probe.py
MAX_LOAD_S = 600.0  # a node refuses a longer load probe
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.1, 10.0


@dataclass(frozen=True)
class SelfDescription:
    threads: int  # compute threads this node uses (-t)
    physical_cores: int
    logical_cores: int
    os: str  # platform.system()
    memory_bytes: int  # usable now, after OS headroom


def describe(threads: int | None) -> SelfDescription:
    return SelfDescription(
        threads=threads or torch.get_num_threads(),
        physical_cores=physical_cores(),
        logical_cores=psutil.cpu_count(logical=True) or os.cpu_count() or 1,
        os=platform.system(),
        memory_bytes=usable_memory_bytes(),
    )


def load_samples(
    seconds: float, interval: float, lock: AbstractContextManager | threading.Lock | None = None
) -> Iterator[tuple[float, float]]:
    """Run the decode kernel for `seconds`; yield (seconds since start, weight bytes/s) once per
    `interval`. `lock` is held for each interval only (a node's compute lock: a stage's forward
    passes still get their turn between intervals)."""
    q = torch.randint(0, 16, (_N, _K), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.rand(_K // _GROUP, _N, 2, dtype=torch.bfloat16)
    x = torch.randn(1, _K, dtype=torch.bfloat16)
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    nbytes = _N * _K // 2 + sz.numel() * 2
    mm(x, packed, _GROUP, sz)  # warm-up
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
                mm(x, packed, _GROUP, sz)
                calls += 1
            t1 = time.perf_counter()
        yield t1 - t_start, calls * nbytes / (t1 - t0)
