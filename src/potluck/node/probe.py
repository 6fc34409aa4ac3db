"""What a node can do, measured: usable memory and how fast its CPU streams weights in decode.

The speed probe times batch-1 products through the layers the engine itself builds for Q4_0
weights (kernels/qlinear.QLinear: the native matrix-vector kernel where this machine has it, else
torch's int4 or bf16 path) and reports weight bytes per second. The weights are synthetic
4096 x 4096 Q4_0 layers (9 MiB each as the engine holds them), called in turn, as many as hold
twice the CPU's last-level cache (at least 4, at most 16): a model's layers come from memory, not
from the cache, and a single layer of a few MiB measured ≈ 2x faster than a decode step streams
on a 32 MiB-L3 CPU. It takes ≈ 0.3 s (+ ≈ 20 ms per layer built) and is measured once per
process.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import numpy as np
import psutil
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

OS_HEADROOM_BYTES = 1 << 30  # left to the OS and other programs when a node reports its memory
_N, _K = 4096, 4096  # one probe layer, (n_out, n_in)
_MIN_LAYERS, _MAX_LAYERS = 4, 16
_QTYPE = GGMLQuantizationType.Q4_0  # the most common decode weight format; SmolLM2's Q4_1 alike
_SCALE = 0.01  # every block's fp16 d: finite, like a real weight's


def usable_memory_bytes() -> int:
    return max(0, psutil.virtual_memory().available - OS_HEADROOM_BYTES)


def physical_cores() -> int:
    return psutil.cpu_count(logical=False) or psutil.cpu_count() or 1


def probe_layer(seed: int = 0) -> torch.nn.Module:
    """The probe's weight as the engine builds it: a QLinear from synthetic Q4_0 bytes (random
    4-bit values, d = _SCALE in every block), shape (_N, _K). `.nbytes`: bytes it holds."""
    from potluck.kernels.qlinear import QLinear

    block, type_size = GGML_QUANT_SIZES[_QTYPE]
    n_blocks = _N * _K // block
    raw = np.random.default_rng(seed).integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    raw[:, :2] = np.full((n_blocks, 1), _SCALE, dtype=np.float16).view(np.uint8)  # d: fp16
    return QLinear.from_raw(torch.from_numpy(raw.reshape(-1)), _QTYPE, (_N, _K))


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


@functools.cache
def decode_bytes_per_s(seconds: float = 0.3) -> float:
    """Weight bytes per second one decode step streams on this CPU: the median over timed calls
    of the engine's own batch-1 kernel, the layers taken in turn (see the module doc)."""
    first = probe_layer(0)
    n = -(-2 * last_level_cache_bytes() // first.nbytes)
    layers = [first] + [probe_layer(i) for i in range(1, min(_MAX_LAYERS, max(_MIN_LAYERS, n)))]
    x = torch.randn(1, _K)
    with torch.inference_mode():
        for layer in layers:  # warm-up: the native kernels compiled or loaded, pages touched
            layer(x)
        times: list[float] = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end or len(times) < 5:
            for layer in layers:
                t0 = time.perf_counter()
                layer(x)
                times.append(time.perf_counter() - t0)
    times.sort()
    return first.nbytes / times[len(times) // 2]
