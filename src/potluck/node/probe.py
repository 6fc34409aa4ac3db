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
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
from gguf import GGMLQuantizationType

from potluck.modelfile.gguf_file import Matrix

if TYPE_CHECKING:
    from potluck.model.matvec import LayerProbe, MatVec
    from potluck.model.stage import GpuConfig

OS_HEADROOM_BYTES = 1 << 30  # left to the OS and other programs when a node reports its memory
# Left free inside a memory cgroup (the OS lives outside it): the process's own growth while it
# computes (Python objects, gRPC buffers, a graph's inputs). The process's present use is
# already subtracted from the cgroup's room.
CGROUP_HEADROOM_BYTES = 256 << 20
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2^63
_N, _K = 4096, 4096  # one probe layer, (n_out, n_in)
_MIN_LAYERS, _MAX_LAYERS = 4, 16
_QTYPE = GGMLQuantizationType.Q4_0  # the most common decode weight format; SmolLM2's Q4_1 alike


def usable_memory_bytes() -> int:
    """RAM this process can still fill with a model: the machine's available memory less
    OS_HEADROOM_BYTES, and no more than its memory cgroup's room (a container's or a systemd
    slice's limit, enforced by the kernel) less CGROUP_HEADROOM_BYTES."""
    host = max(0, psutil.virtual_memory().available - OS_HEADROOM_BYTES)
    room = cgroup_room_bytes()
    return host if room is None else min(host, max(0, room - CGROUP_HEADROOM_BYTES))


def cgroup_room_bytes(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """Bytes this process's memory cgroup can still take: its limit (the tightest of it and its
    ancestors) less what it uses, the page cache of files not counted as used (the kernel drops
    it under the limit; "available" memory counts it alike). A worker that ran a plan keeps its
    file pages cached after the plan is freed: counted as used, the worker offered 1 GiB less
    after each run. None where no limit applies or cgroups cannot be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:  # "4:memory:/a/b" (v1) or "0::/a/b" (v2)
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return _v1_room(root / "memory" / path.lstrip("/"))
    for line in lines:
        if line.startswith("0::"):
            return _v2_room(root, line[3:])
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" else int(text)


def _stat(path: Path) -> dict[str, int]:
    try:
        pairs = (line.split() for line in path.read_text().splitlines())
        return {k: int(v) for k, v in pairs}
    except (OSError, ValueError):
        return {}


def _v1_room(group: Path) -> int | None:
    stat = _stat(group / "memory.stat")
    limit = stat.get("hierarchical_memory_limit", _read_int(group / "memory.limit_in_bytes"))
    usage = _read_int(group / "memory.usage_in_bytes")
    if limit is None or limit >= _UNLIMITED or usage is None:
        return None
    cache = stat.get("total_inactive_file", 0) + stat.get("total_active_file", 0)
    return limit - (usage - cache)


def _v2_room(root: Path, path: str) -> int | None:
    """The smallest room over the cgroup and its ancestors (v2 has no hierarchical figure)."""
    rooms = []
    group = root / path.strip("/")
    while True:
        limit, usage = _read_int(group / "memory.max"), _read_int(group / "memory.current")
        if limit is not None and usage is not None and limit < _UNLIMITED:
            rooms.append(limit - (usage - _stat(group / "memory.stat").get("file", 0)))
        if group == root or root not in group.parents:
            break
        group = group.parent
    return min(rooms) if rooms else None


def physical_cores() -> int:
    return psutil.cpu_count(logical=False) or psutil.cpu_count() or 1


def last_level_cache_bytes() -> int:
    """Size of the largest CPU cache Linux reports (0 where it does not, as on Windows and macOS,
    which have no /sys: the probes then fill their floor of matrices)."""
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
def decode_bytes_per_s(
    seconds: float = 0.3, threads: int | None = None, gpu: str | None = None
) -> float:
    """Weight bytes per second one decode step streams on this CPU (threads None: every core),
    or on the ggml GPU device named `gpu`: the median over timed calls of ggml's batch-1 product,
    the layers taken in turn (see the module doc)."""
    from potluck.model.ggml_lib import gpu_device
    from potluck.model.matvec import MatVec
    from potluck.model.stage import every_core

    layer_bytes = _N * _K // 32 * 18
    n = -(-2 * last_level_cache_bytes() // layer_bytes)
    device = gpu_device(gpu)[0] if gpu is not None else None
    probe = MatVec(
        _QTYPE, _N, _K, min(_MAX_LAYERS, max(_MIN_LAYERS, n)), threads or every_core(), device
    )
    try:
        return probe.nbytes / _median_seconds(probe, seconds, per_layer=True)
    finally:
        probe.close()


def _median_seconds(probe: MatVec | LayerProbe, seconds: float, per_layer: bool) -> float:
    """Median seconds of one call (per_layer: `probe.run(i)`) or one pass over every layer,
    timed for `seconds` (at least 5 samples) after one warm-up pass (pages touched, threads
    started). probe: a MatVec or LayerProbe."""
    for i in range(len(probe)):
        probe.run(i)
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        t_pass = time.perf_counter()
        for i in range(len(probe)):
            t0 = time.perf_counter()
            probe.run(i)
            if per_layer:
                times.append(time.perf_counter() - t0)
        if not per_layer:
            times.append(time.perf_counter() - t_pass)
    times.sort()
    return times[len(times) // 2]


_PROBE_MATRIX_BYTES = 8 << 20  # each probed matrix cut to at most this many bytes (rows dropped)
_ROWS = 16  # ... in whole groups of rows, as ggml's repacked layouts interleave 4 or 8
_PROBE_FILL_BYTES, _MAX_COPIES = 96 << 20, 64


def _cut(m: Matrix) -> Matrix:
    """The matrix with fewer rows, at most _PROBE_MATRIX_BYTES: per byte, a batch-1 product
    streams the same way through a large matrix as through a slice of it."""
    if m.nbytes <= _PROBE_MATRIX_BYTES:
        return m
    rows = max(_ROWS, _PROBE_MATRIX_BYTES * m.n_out // m.nbytes // _ROWS * _ROWS)
    return Matrix(m.qtype, rows, m.n_in, m.n_experts)


# a measured speed is reused this long (re-plans after a failover), then timed again
_PROBE_TTL_S = 300.0
_probed: dict[tuple[tuple[Matrix, ...], int], tuple[float, float]] = {}


def model_bytes_per_s(
    matrices: tuple[Matrix, ...],
    threads: int | None = None,
    seconds: float = 1.0,
    remember: bool = True,
) -> float:
    """model_layer_speed, remembered for _PROBE_TTL_S per (layer, threads): one unlucky second
    is not kept for the life of a worker (on this project's VMs, single 0.3 s probes of SmolLM2
    read 3.5-5.7 GB/s on one core, its real decode 4.55). remember=False: a figure taken while
    something else runs here is neither taken from nor kept for later."""
    from potluck.model.stage import every_core

    key = (matrices, threads or every_core())
    now = time.monotonic()
    hit = _probed.get(key)
    if remember and hit is not None and now - hit[0] < _PROBE_TTL_S:
        return hit[1]
    speed = model_layer_speed(matrices, key[1], seconds)
    if remember:
        _probed[key] = (now, speed)
    return speed


def model_layer_speed(matrices: tuple[Matrix, ...], threads: int, seconds: float = 1.0) -> float:
    """Weight bytes per second one decode step streams through one layer of *this model*: its
    matrices' own types and widths (held as a stage holds them: repacked where ggml can), copies
    of the layer taken in turn until they fill 4 x the last-level cache (96 MiB at least).
    Median over timed passes over `seconds`, plus making the synthetic weights."""
    from potluck.model.matvec import LayerProbe

    cut = [_cut(m) for m in matrices]
    layer = sum(m.nbytes for m in cut)
    # 4 x the cache (and at least 96 MiB), at least 4 copies: with 2 x the cache the passes
    # spread ±15 % and read 20 % below the 7B's real decode at 2 threads; SmolLM2 at 1 thread,
    # real decode 4.55 GB/s: 16 copies (35 MB) 3.67, 42 copies (93 MB) 4.59
    fill = max(4 * last_level_cache_bytes(), _PROBE_FILL_BYTES)
    copies = min(_MAX_COPIES, max(4, -(-fill // layer)))
    probe = LayerProbe(cut, copies, threads)
    try:
        return probe.nbytes * len(probe) / _median_seconds(probe, seconds, per_layer=False)
    finally:
        probe.close()


def trim_heap() -> None:
    """Give freed memory back to the OS: a garbage collection, then glibc's malloc_trim (a few
    ms; no-op without glibc). A worker calls it after a Load, a replaced or idle-freed plan."""
    gc.collect()
    if not sys.platform.startswith("linux"):
        return  # no glibc (and on Windows ctypes.CDLL(None), the process itself, is a TypeError)
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


def gpu_offer(gpu: GpuConfig) -> GpuOffer | None:
    """The GPU of a process's settings (its -ngl, --device, --vram), measured; None when it puts
    no layer on a GPU (-ngl 0, the default). Its free memory is read now, its speed measured once
    (or given: gpu.bytes_per_s)."""
    from potluck.model.ggml_lib import gpu_device

    if not gpu.n_gpu_layers:
        return None
    _, dev = gpu_device(gpu.device)
    free = dev.free_bytes if gpu.vram is None else min(dev.free_bytes, gpu.vram)
    speed = gpu.bytes_per_s or decode_bytes_per_s(gpu=dev.name)
    return GpuOffer(dev.name, free, speed, gpu.n_gpu_layers)
