"""What a node can do, measured: usable memory and how fast its CPU streams weights in decode.

The speed probe times batch-1 products through ggml's own kernels (model/matvec.py) over
synthetic Q4_0 weights and reports weight bytes per second. The weights are 4096 x 4096 Q4_0
matrices (9 MiB each), called in turn, as many as hold twice the CPU's last-level cache (at least
4, at most 16): a model's layers come from memory, not from the cache, and a single layer of a few
MiB measured ≈ 2x faster than a decode step streams on a 32 MiB-L3 CPU. It takes ≈ 0.3 s and is
measured once per process and thread count.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from gguf import GGMLQuantizationType

OS_HEADROOM_BYTES = 1 << 30  # left to the OS and other programs when a node reports its memory
_N, _K = 4096, 4096  # one probe layer, (n_out, n_in)
_MIN_LAYERS, _MAX_LAYERS = 4, 16
_QTYPE = GGMLQuantizationType.Q4_0  # the most common decode weight format; SmolLM2's Q4_1 alike


def usable_memory_bytes() -> int:
    return max(0, psutil.virtual_memory().available - OS_HEADROOM_BYTES)


def physical_cores() -> int:
    return psutil.cpu_count(logical=False) or psutil.cpu_count() or 1


def last_level_cache_bytes() -> int:
    """Size of the largest CPU cache Linux reports (0 where it does not)."""
    sizes = [0]
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text[:-1] if text[-1:] in "KMG" else text
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes)


def default_threads() -> int:
    from potluck.model.stage import default_threads as stage_threads

    return stage_threads()


@functools.cache
def decode_bytes_per_s(seconds: float = 0.3, threads: int | None = None) -> float:
    """Weight bytes per second one decode step streams on this CPU: the median over timed calls
    of ggml's batch-1 product, the layers taken in turn (see the module doc)."""
    from potluck.model.matvec import MatVec

    layer_bytes = _N * _K // 32 * 18
    n = -(-2 * last_level_cache_bytes() // layer_bytes)
    probe = MatVec(
        _QTYPE, _N, _K, min(_MAX_LAYERS, max(_MIN_LAYERS, n)), threads or default_threads()
    )
    try:
        for i in range(len(probe)):  # warm-up: pages touched, threads started
            probe.run(i)
        times: list[float] = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end or len(times) < 5:
            for i in range(len(probe)):
                t0 = time.perf_counter()
                probe.run(i)
                times.append(time.perf_counter() - t0)
    finally:
        probe.close()
    times.sort()
    return probe.nbytes / times[len(times) // 2]


def trim_heap() -> None:
    """Give freed memory back to the OS: a garbage collection, then glibc's malloc_trim (a few
    ms; no-op without glibc). A worker calls it after a Load, a replaced or idle-freed plan."""
    gc.collect()
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        return  # not glibc


@dataclass(frozen=True)
class GpuOffer:
    """The GPU this process offers the pool (its -ngl and --device): ggml's name, free memory
    (capped by --vram), measured speed, and how many layers at most."""

    name: str
    memory_bytes: int
    bytes_per_s: float
    max_layers: int


def gpu_offer() -> GpuOffer | None:
    """The process's GPU (model.stage.default_gpu), measured; None when it puts no layer on a
    GPU (-ngl 0, the default). Its free memory is read now, its speed measured once."""
    from potluck.model.ggml_lib import gpu_device
    from potluck.model.stage import default_gpu

    gpu = default_gpu()
    if not gpu.n_gpu_layers:
        return None
    _, dev = gpu_device(gpu.device)
    free = dev.free_bytes if gpu.vram is None else min(dev.free_bytes, gpu.vram)
    speed = gpu.bytes_per_s or decode_bytes_per_s(gpu=dev.name)
    return GpuOffer(dev.name, free, speed, gpu.n_gpu_layers)
