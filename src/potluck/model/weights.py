"""A stage's weights as ggml tensors over the model file's own bytes, mapped in place.

Each tensor of a `WeightSource` is a read-only view of a memory map (the GGUF file, or a worker's
blob of a received tensor); ggml gets a CPU buffer over exactly those bytes
(`ggml_backend_cpu_buffer_from_ptr`) and the tensor points into it: nothing is copied or
re-encoded, processes that map the same file share its pages, and "weights in memory" is the
stage's tensor bytes. A tensor meant for another device (a GPU layer, `-ngl`) is uploaded once
into that device's buffer instead. `exact=True` (tests only) dequantizes every tensor to f32 in
ordinary memory: ggml then multiplies in f32 throughout, the reference precision.

Repacked weights (`repack`, on by default as in llama.cpp): a matrix whose type and shape ggml's
CPU_REPACK buffer has a faster layout for (Q4_0, Q4_K, Q5_K, Q6_K, Q2_K, Q8_0, IQ4_NL, MXFP4 with
rows in multiples of 4 or 8, by this CPU's kernels) is copied into that buffer in the interleaved
layout — the same number of bytes — and the file's pages it came from are dropped from this
process's memory (madvise DONTNEED: they are never read again), so that memory still holds each
weight once. What it costs: those tensors no longer share the page cache with other processes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np
from gguf import GGMLQuantizationType

from potluck.errors import ModelFileError, UnsupportedError
from potluck.model.ggml_lib import (
    BUFFER_USAGE_WEIGHTS,
    STATUS_SUCCESS,
    TYPE_F32,
    BackendError,
    lib,
    repack_buffer_type,
    tensor_extra,
)
from potluck.model.ggml_lib import context as new_context
from potluck.modelfile.gguf_file import TensorInfo

# Every type ggml's CPU backend multiplies (mul_mat and get_rows), by the gguf package's names.
SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[n]
    for n in [
        "F32",
        "F16",
        "BF16",
        "Q4_0",
        "Q4_1",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ2_S",
        "IQ3_XXS",
        "IQ3_S",
        "IQ1_S",
        "IQ1_M",
        "IQ4_NL",
        "IQ4_XS",
        "TQ1_0",
        "TQ2_0",
        "MXFP4",
    ]
    if n in GGMLQuantizationType.__members__
)


class WeightSource(Protocol):
    """Where a stage's tensors come from: a GGUFFile, or tensors received over the network."""

    tensors: dict[str, TensorInfo]

    def raw(self, name: str) -> np.ndarray: ...


def check(src: WeightSource, name: str, shape: tuple[int, ...]) -> TensorInfo:
    """The tensor's index entry, after checking it exists with `shape` and a type ggml computes."""
    info = src.tensors.get(name)
    if info is None:
        raise ModelFileError(f"tensor {name} is missing from the model file")
    if info.shape != shape:
        raise ModelFileError(
            f"tensor {name} has shape {info.shape}, expected {shape} from the metadata"
        )
    if info.qtype not in SUPPORTED_TYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise UnsupportedError(
            f"tensor {name} uses quantization {info.qtype.name}, not supported; supported: {names}"
        )
    return info


class Weights:
    """Named ggml tensors for a stage. `tensor(name)` gives the ggml tensor (an address).

    placement(name) -> None (this CPU, mapped in place) or a ggml buffer type to upload into."""

    def __init__(
        self,
        src: WeightSource,
        shapes: Iterable[tuple[str, tuple[int, ...]]],
        exact: bool = False,
        placement: Callable[[str], int | None] = lambda name: None,
        repack: Callable[[str], bool] = lambda name: False,
        threads: int = 1,
    ) -> None:
        """repack(name): whether a matrix this CPU keeps may be repacked (a matmul weight; never
        one that get_rows also reads, such as token_embd). threads: how many repack at once."""
        self.threads = threads
        wanted = list(dict.fromkeys(shapes))
        self._ctx = new_context(len(wanted))
        self._tensors: dict[str, int] = {}
        self._keep: list[np.ndarray] = []  # the arrays the CPU buffers point into
        self._buffers: list[int] = []
        self.nbytes = 0  # bytes of weights this stage holds (in RAM or device memory)
        self.device_bytes: dict[int, int] = {}  # buffer type -> bytes uploaded there
        self.repacked_bytes = 0  # of nbytes, those held in the CPU_REPACK layout
        uploads: dict[int, list[tuple[str, int, np.ndarray]]] = {}
        repacks: list[tuple[str, int, np.ndarray]] = []
        repack_buft = None if exact else repack_buffer_type()
        try:
            for name, shape in wanted:
                info = check(src, name, shape)
                raw = src.raw(name)
                qtype = int(info.qtype)
                if exact and info.qtype != GGMLQuantizationType.F32:
                    from gguf.quants import dequantize

                    raw = np.ascontiguousarray(dequantize(np.asarray(raw), info.qtype), np.float32)
                    qtype = TYPE_F32
                t = _new_tensor(self._ctx, qtype, info.shape)
                lib.ggml_set_name(t, name.encode())
                self._tensors[name] = t
                buft = placement(name)
                if buft is None and repack_buft and repack(name) and _repackable(repack_buft, info):
                    repacks.append((name, t, raw))
                elif buft is None:
                    self._map(t, raw, name)
                else:
                    uploads.setdefault(buft, []).append((name, t, raw))
            for buft, items in uploads.items():
                self._upload(buft, items)
            if repacks:
                assert repack_buft is not None
                self._upload(repack_buft, repacks, device=False)
                self.repacked_bytes = sum(raw.nbytes for _, _, raw in repacks)
        except BaseException:
            self.free()
            raise

    def _map(self, t: int, raw: np.ndarray, name: str) -> None:
        if not raw.flags.c_contiguous:
            raw = np.ascontiguousarray(raw)  # (never for a memory map's view; defensive)
        n = raw.nbytes
        if n != lib.ggml_nbytes(t):
            raise ModelFileError(
                f"tensor {name} has {n:,} bytes, its type and shape need {lib.ggml_nbytes(t):,}"
            )
        addr = raw.ctypes.data
        buf = cpu_buffer_over(addr, n)
        if not buf or lib.ggml_backend_tensor_alloc(buf, t, addr) != STATUS_SUCCESS:
            raise BackendError(f"ggml could not map tensor {name} in place")
        lib.ggml_backend_buffer_set_usage(buf, BUFFER_USAGE_WEIGHTS)
        self._buffers.append(buf)
        self._keep.append(raw)
        self.nbytes += n

    def _upload(
        self, buft: int, items: list[tuple[str, int, np.ndarray]], device: bool = True
    ) -> None:
        align = 256
        size = sum(-(-lib.ggml_nbytes(t) // align) * align for _, t, _ in items)
        buf = lib.ggml_backend_buft_alloc_buffer(buft, size)
        if not buf:
            name = lib.ggml_backend_buft_name(buft).decode()
            raise BackendError(
                f"{name}: out of device memory for {len(items)} tensors ({size / 2**20:.0f} MiB); "
                "put fewer layers on the GPU (-ngl)"
            )
        lib.ggml_backend_buffer_set_usage(buf, BUFFER_USAGE_WEIGHTS)
        self._buffers.append(buf)
        base, at = lib.ggml_backend_buffer_get_base(buf), 0
        for _, t, _ in items:  # (alloc in order: ggml's buffers are not thread-safe there)
            lib.ggml_backend_tensor_alloc(buf, t, base + at)
            at += -(-lib.ggml_nbytes(t) // align) * align

        def put(item: tuple[str, int, np.ndarray]) -> None:
            _, t, raw = item
            data = np.ascontiguousarray(raw)
            lib.ggml_backend_tensor_set(t, data.ctypes.data, 0, lib.ggml_nbytes(t))
            if not device:
                _drop_pages(raw)  # at once: the file's copy and the repacked one never both

        if device or self.threads <= 1:
            for item in items:
                put(item)
        else:  # repacking is CPU work, tensor by tensor, the GIL released: on every thread
            with ThreadPoolExecutor(self.threads) as pool:
                list(pool.map(put, items))
        if device:
            self.nbytes += size
            self.device_bytes[buft] = self.device_bytes.get(buft, 0) + size
        else:  # repacked in this process's memory: the same bytes as the file's tensors
            self.nbytes += sum(raw.nbytes for _, _, raw in items)

    def tensor(self, name: str) -> int:
        return self._tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def free(self) -> None:
        for buf in self._buffers:
            lib.ggml_backend_buffer_free(buf)
        self._buffers = []
        if self._ctx:
            lib.ggml_free(self._ctx)
            self._ctx = 0
        self._keep = []

    def __del__(self) -> None:
        self.free()


_REPACKABLE: dict[tuple[int, tuple[int, ...]], bool] = {}


def _repackable(buft: int, info: TensorInfo) -> bool:
    """Whether the repack buffer has a layout for this type and shape on this CPU: asked of ggml
    itself (a probe tensor in a probe buffer: its init_tensor sets `extra` to the layout or
    NULL), once per (type, shape)."""
    if len(info.shape) not in (2, 3):  # matrices, and stacks of experts (mul_mat_id)
        return False
    key = (int(info.qtype), info.shape)
    if key not in _REPACKABLE:
        ctx = new_context(1)
        try:
            t = _new_tensor(ctx, int(info.qtype), info.shape)
            buf = lib.ggml_backend_buft_alloc_buffer(buft, lib.ggml_nbytes(t))
            if not buf:
                return False
            try:
                lib.ggml_backend_tensor_alloc(buf, t, lib.ggml_backend_buffer_get_base(buf))
                _REPACKABLE[key] = tensor_extra(t) != 0
            finally:
                lib.ggml_backend_buffer_free(buf)
        finally:
            lib.ggml_free(ctx)
    return _REPACKABLE[key]


def _drop_pages(raw: np.ndarray) -> None:
    """Give back the memory-mapped pages wholly inside `raw`: a file's, read again on demand.
    Only for an array over a file mapping (on ordinary memory DONTNEED would zero it). No-op
    where the system has no madvise (Windows)."""
    import ctypes
    import mmap

    dontneed = getattr(mmap, "MADV_DONTNEED", None)
    base: np.ndarray | None = raw
    while base is not None and not isinstance(base, np.memmap):
        base = base.base if isinstance(base, np.ndarray) else None
    if base is None or dontneed is None:
        return
    page = mmap.PAGESIZE  # 4 KiB on x86-64; 16 KiB on Apple silicon (madvise wants it aligned)
    start = -(-raw.ctypes.data // page) * page
    end = (raw.ctypes.data + raw.nbytes) // page * page
    if end <= start:
        return
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise(start, end - start, dontneed)


def cpu_buffer_over(addr: int, nbytes: int) -> int:
    """A ggml CPU buffer that covers the bytes [addr, addr + nbytes) of memory we keep alive.

    ggml wants a buffer's base aligned to 32 bytes; a tensor inside may lie anywhere (GGUF aligns
    tensor data to `general.alignment` from the data section, numpy to 16). So the buffer starts
    at the page boundary below `addr`: a buffer is only a range to ggml (it never frees or clears
    one made from a pointer), and the tensor's own bytes are the only ones read."""
    base = addr & ~4095
    buf: int = lib.ggml_backend_cpu_buffer_from_ptr(base, addr + nbytes - base)
    return buf


def _new_tensor(ctx: int, qtype: int, shape: tuple[int, ...]) -> int:
    ne = list(reversed(shape))  # ggml: innermost dimension first
    t: int
    if len(ne) == 1:
        t = lib.ggml_new_tensor_1d(ctx, qtype, *ne)
    elif len(ne) == 2:
        t = lib.ggml_new_tensor_2d(ctx, qtype, *ne)
    elif len(ne) == 3:
        t = lib.ggml_new_tensor_3d(ctx, qtype, *ne)
    else:
        t = lib.ggml_new_tensor_4d(ctx, qtype, *ne)
    return t
