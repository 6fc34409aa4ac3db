"""What a node can do, measured: usable memory and how fast its CPU streams weights in decode.

The speed probe times batch-1 matmuls over a packed int4 weight of 8 MiB (larger than the caches,
like a model's layers), the kernel most decode time goes to, and reports weight bytes per second.
It takes ≈ 0.3 s and is measured once per process.
"""

from __future__ import annotations

import functools
import time

import psutil
import torch

OS_HEADROOM_BYTES = 1 << 30  # left to the OS and other programs when a node reports its memory
_N, _K, _GROUP = 4096, 4096, 32  # 4096 x 4096 int4 weights = 8 MiB


def usable_memory_bytes() -> int:
    return max(0, psutil.virtual_memory().available - OS_HEADROOM_BYTES)


def physical_cores() -> int:
    return psutil.cpu_count(logical=False) or psutil.cpu_count() or 1


@functools.cache
def decode_bytes_per_s(seconds: float = 0.3) -> float:
    """Weight bytes per second one decode step streams on this CPU (median of timed calls)."""
    q = torch.randint(0, 16, (_N, _K), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.rand(_K // _GROUP, _N, 2, dtype=torch.bfloat16)
    x = torch.randn(1, _K, dtype=torch.bfloat16)
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    nbytes = _N * _K // 2 + sz.numel() * 2
    mm(x, packed, _GROUP, sz)  # warm-up
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        t0 = time.perf_counter()
        mm(x, packed, _GROUP, sz)
        times.append(time.perf_counter() - t0)
    times.sort()
    return nbytes / times[len(times) // 2]
