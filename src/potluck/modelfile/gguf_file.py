"""Open a GGUF file safely: check it is one, that it is whole, and index its tensors.

The header is parsed here (the `gguf` package's GGUFReader takes ≈ 9 s on Gemma-3's 262k-token
vocabulary; this parser ≈ 0.3 s) with the `gguf` package's tables for value and tensor types; the
tensor data is memory-mapped, so a stage that asks for its own layers touches only those bytes.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from potluck.errors import ModelFileError, UnsupportedError

GGUF_MAGIC = b"GGUF"
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # logical shape, outermost first: (n_out, n_in) for a matrix
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def layer(self) -> int | None:
        """The global block index of a `blk.N.*` tensor, None for embeddings / head / norms."""
        m = _BLOCK_RE.match(self.name)
        return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Matrix:
    """One weight matrix a probe multiplies: its GGML type and (n_out, n_in); n_experts > 0:
    that many experts of a stack, each (n_out, n_in), which a token reads through mul_mat_id."""

    qtype: GGMLQuantizationType
    n_out: int
    n_in: int
    n_experts: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes a token reads (of a stack: its n_experts experts')."""
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return self.n_out * self.n_in // block * type_size * max(1, self.n_experts)


def layer_matrices(
    tensors: Mapping[str, TensorInfo], layer: int, experts_used: int = 0
) -> tuple[Matrix, ...]:
    """The weight matrices of block `layer` (what a decode step streams through it): its
    matrices, and of each stack of routed experts [n_expert, n_out, n_in] the `experts_used`
    that a token reads."""
    out: list[Matrix] = []
    for t in tensors.values():
        if t.layer == layer and len(t.shape) == 2:
            out.append(Matrix(t.qtype, *t.shape))
        elif t.layer == layer and len(t.shape) == 3 and experts_used:
            out.append(Matrix(t.qtype, t.shape[1], t.shape[2], min(experts_used, t.shape[0])))
    return tuple(out)


class GGUFFile:
    """A validated GGUF file: metadata as plain Python values and a tensor index.

    Raises ModelFileError for a missing, foreign, truncated or otherwise unreadable file.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFileError(f"{self.path}: no such file")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ModelFileError(
                f"{self.path}: not a GGUF file (starts with {magic!r}, expected b'GGUF'); "
                "convert it with llama.cpp's convert_hf_to_gguf.py or download a .gguf build"
            )
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            self.metadata, self.tensors, self.data_start = read_header(m, str(self.path))
        end = max((t.offset + t.nbytes for t in self.tensors.values()), default=self.data_start)
        if end > size:
            raise ModelFileError(
                f"{self.path}: file is truncated: tensors need {end:,} bytes but the file has {size:,} "
                f"({end - size:,} missing); re-download it"
            )
        self.size_bytes = size
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")

    @property
    def arch(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError(f"{self.path}: metadata key general.architecture is missing")
        return arch

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as uint8 [rows, bytes_per_row] (a read-only view of the memory map)."""
        info = self.tensors.get(name)
        if info is None:
            raise ModelFileError(f"{self.path}: tensor {name!r} is missing")
        flat = self._map[info.offset : info.offset + info.nbytes]
        rows = math.prod(info.shape[:-1]) if len(info.shape) > 1 else 1
        return flat.reshape(rows, info.nbytes // rows)

    def header_bytes(self) -> bytes:
        """The file's header (metadata + tensor index, no tensor data), as sent to workers."""
        return bytes(self._map[: self.data_start])

    def has(self, name: str) -> bool:
        return name in self.tensors

    def quant_mix(self) -> str:
        """E.g. 'Q4_1 ×210, Q8_0 ×1' over the matrices (norm vectors left out)."""
        mix = Counter(t.qtype.name for t in self.tensors.values() if len(t.shape) > 1)
        return ", ".join(f"{k} ×{v}" for k, v in mix.most_common())


def read_header(
    buf: bytes | mmap.mmap, source: str
) -> tuple[dict[str, Any], dict[str, TensorInfo], int]:
    """Parse and check a GGUF header from the bytes of a file that start at its magic (the file
    mapped, or the header a head sent).

    Returns (metadata, tensors by name with absolute offsets, data start). Raises ModelFileError.
    """
    try:
        meta, infos, data_start = _parse_header(buf)
    except UnsupportedError as exc:  # a sound file of a newer format: re-downloading won't help
        raise UnsupportedError(f"{source}: {exc}") from exc
    except (ValueError, UnicodeDecodeError, struct.error, EOFError) as exc:
        raise ModelFileError(
            f"{source}: GGUF header is corrupt or truncated ({exc}); re-download the file"
        ) from exc
    tensors: dict[str, TensorInfo] = {}
    for name, dims, qtype_id, rel in infos:
        try:
            qtype = GGMLQuantizationType(qtype_id)
        except ValueError:
            raise ModelFileError(
                f"{source}: tensor {name!r} has unknown GGML type id {qtype_id}"
            ) from None
        shape = tuple(reversed(dims))
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        if shape[-1] % block or shape[-1] == 0:
            raise ModelFileError(
                f"{source}: tensor {name!r} row of {shape[-1]} is not a whole number of {qtype.name} blocks ({block})"
            )
        nbytes = math.prod(shape) // block * block_bytes
        tensors[name] = TensorInfo(name, qtype, shape, data_start + rel, nbytes)
    return meta, tensors, data_start


_SCALAR = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "<u1", GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}  # fmt: skip
_MAX_COUNT = 1 << 31  # no real file has more array items, tensors or keys than this


_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class _Cursor:
    """Reads little-endian GGUF values from a buffer, checking every length first."""

    def __init__(self, buf: bytes | mmap.mmap) -> None:
        self.buf, self.size, self.pos = buf, len(buf), 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise EOFError(f"wants {n} bytes at offset {self.pos} of {self.size}")
        self.pos += n
        return self.buf[self.pos - n : self.pos]

    def u32(self) -> int:
        return int(_U32.unpack(self.take(4))[0])

    def u64(self) -> int:
        return int(_U64.unpack(self.take(8))[0])

    def count(self) -> int:
        n = self.u64()
        if n > _MAX_COUNT:
            raise ValueError(f"implausible count {n}")
        return n

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, n: int) -> list[str]:
        """n strings in a row (a vocabulary: Gemma-3's 262k tokens) in one tight loop."""
        buf, pos, size, out = self.buf, self.pos, self.size, []
        for _ in range(n):
            if pos + 8 > size:
                raise EOFError(f"wants 8 bytes at offset {pos} of {size}")
            k = _U64.unpack_from(buf, pos)[0]
            pos += 8
            if k > _MAX_COUNT:
                raise ValueError(f"implausible count {k}")
            if pos + k > size:
                raise EOFError(f"wants {k} bytes at offset {pos} of {size}")
            out.append(buf[pos : pos + k].decode("utf-8", errors="replace"))
            pos += k
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        vt = GGUFValueType(vtype)
        if vt == GGUFValueType.STRING:
            return self.string()
        if vt == GGUFValueType.ARRAY:
            item, n = GGUFValueType(self.u32()), self.count()
            if item == GGUFValueType.STRING:
                return self.strings(n)
            if item == GGUFValueType.ARRAY:
                return [self.value(GGUFValueType.ARRAY) for _ in range(n)]
            dt = np.dtype(_SCALAR[item])
            arr = np.frombuffer(self.take(n * dt.itemsize), dtype=dt)
            return [bool(v) for v in arr] if item == GGUFValueType.BOOL else arr.tolist()
        dt = np.dtype(_SCALAR[vt])
        v = np.frombuffer(self.take(dt.itemsize), dtype=dt)[0].item()
        return bool(v) if vt == GGUFValueType.BOOL else v


def _parse_header(
    buf: bytes | mmap.mmap,
) -> tuple[dict[str, Any], list[tuple[str, list[int], int, int]], int]:
    """Metadata, (name, dims innermost-first, type id, relative offset) per tensor, data start."""
    cur = _Cursor(buf)
    cur.take(4)  # magic, checked by the caller
    version = cur.u32()
    if version not in (2, 3):
        raise UnsupportedError(
            f"GGUF version {version} is not supported (2 and 3 are): a newer Potluck may read it"
            if version > 3
            else f"GGUF version {version} is not supported (2 and 3 are): convert the model again"
        )
    n_tensors, n_kv = cur.count(), cur.count()
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.u32())
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.u32()
        if not 1 <= n_dims <= 4:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
        dims = [cur.u64() for _ in range(n_dims)]
        qtype, rel = cur.u32(), cur.u64()
        infos.append((name, dims, qtype, rel))
    align = int(meta.get("general.alignment", 32))
    if align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment {align} is not a power of two")
    data_start = -(-cur.pos // align) * align
    return meta, infos, data_start
