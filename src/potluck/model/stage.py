"""A stage: the layers [start, stop) of a llama-family model, with its own KV caches.

Module attributes carry GGUF tensor names (`token_embd`, `blk["12"].attn_output`, `output_norm`;
weights over one input are stacked into one layer: `attn_qkv`, `ffn_gate_up`), and a stage keeps
global layer indices. The first stage embeds token ids; the others take hidden states;
the last one ends in the output head and returns logits for the rows asked for. Several sequences
go through one call: their tokens are concatenated for the matmuls, attention runs per sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from potluck.errors import ModelFileError, UnsupportedError
from potluck.kernels import native
from potluck.kernels.dequant import SUPPORTED_TYPES
from potluck.kernels.ops import (
    RotaryTable,
    add_rms_norm,
    attention,
    gated_act,
    neox_to_pairs,
    rms_norm,
    rotate_pairs_,
)
from potluck.kernels.qlinear import QConcat, QEmbedding, QLinear, stack
from potluck.model.kv_cache import SeqCache
from potluck.modelfile.gguf_file import TensorInfo
from potluck.modelfile.hparams import HParams

_ARENA_MIN_BYTES = 16 << 10  # weights this large go into the huge-page arena (Stage.huge_pages)
_RELEASE_EVERY_BYTES = 8 << 20  # while moving them: free memory back to the OS this often
_IN_PLACE_MIN_BYTES = 32 << 20  # larger ones (malloc maps each on its own): collapsed in place


class WeightSource(Protocol):
    """Where a stage's tensors come from: a GGUFFile, or tensors received over the network."""

    tensors: dict[str, TensorInfo]

    def raw(self, name: str) -> np.ndarray: ...


@dataclass(frozen=True)
class SeqChunk:
    """`n` consecutive new tokens of sequence `seq_id` in one forward call."""

    seq_id: int
    n: int


def _qlinear(
    src: WeightSource, name: str, shape: tuple[int, int], exact: bool, use_native: bool
) -> QLinear:
    info = _check(src, name, shape)
    raw = torch.from_numpy(np.array(src.raw(name)))
    return QLinear.from_raw(raw, info.qtype, shape, exact, use_native)


def _projection(
    src: WeightSource,
    weights: Sequence[tuple[str, tuple[int, int], torch.Tensor | None]],
    exact: bool,
    use_native: bool,
) -> QLinear | QConcat:
    """Weights (name, shape, row order or None) over one input as one layer, outputs side by side."""
    parts = []
    for name, shape, rows in weights:
        info = _check(src, name, shape)
        raw = np.array(src.raw(name))  # (n_out, bytes per row)
        if rows is not None:
            raw = raw[rows.numpy()]
        parts.append((torch.from_numpy(raw), info.qtype, shape))
    return stack(parts, exact, use_native)


def _vector(src: WeightSource, name: str, n: int) -> torch.Tensor:
    info = _check(src, name, (n,))
    raw = np.array(src.raw(name)).reshape(-1)
    from potluck.kernels.dequant import dequantize

    return dequantize(torch.from_numpy(raw), info.qtype, (1, n)).reshape(n)


def _check(src: WeightSource, name: str, shape: tuple[int, ...]) -> TensorInfo:
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


class Block(nn.Module):
    """One transformer block: attention and a gated FFN, each behind an RMSNorm residual.

    attn_qkv holds attn_q, attn_k and attn_v stacked (one matmul; GGUF's name for the fused
    weight), ffn_gate_up holds ffn_gate and ffn_up. For neox-style RoPE the rows of attn_q/attn_k
    are reordered per head (ops.neox_to_pairs) so that RoPE is one complex multiply in place.
    """

    def __init__(
        self,
        hp: HParams,
        index: int,
        src: WeightSource,
        exact: bool = False,
        use_native: bool = True,
    ) -> None:
        super().__init__()
        p, d = f"blk.{index}.", hp.n_embd
        H, Hkv, hd, hdv = hp.n_head, hp.n_head_kv, hp.head_dim, hp.head_dim_v
        self.index, self.hp, self.use_native = index, hp, use_native
        head_rows = neox_to_pairs(hd, hp.rope_dim) if hp.rules.rope_style == "neox" else None

        def rows(n_heads: int) -> torch.Tensor | None:
            if head_rows is None:
                return None
            return (torch.arange(n_heads)[:, None] * hd + head_rows).flatten()

        self.attn_norm = nn.Parameter(_vector(src, p + "attn_norm.weight", d), requires_grad=False)
        qkv = [
            (p + "attn_q.weight", (H * hd, d), rows(H)),
            (p + "attn_k.weight", (Hkv * hd, d), rows(Hkv)),
            (p + "attn_v.weight", (Hkv * hdv, d), None),
        ]
        self.attn_qkv = _projection(src, qkv, exact, use_native)
        self.attn_qkv_bias: torch.Tensor | None = None
        if p + "attn_q.bias" in src.tensors:  # qwen2
            biases = [
                _vector(src, name[: -len("weight")] + "bias", shape[0]) for name, shape, _ in qkv
            ]
            for i, (_, _, order) in enumerate(qkv):
                if order is not None:
                    biases[i] = biases[i][order]
            self.attn_qkv_bias = torch.cat(biases)
        if hp.rules.qk_norm:
            # one norm over the H + Hkv heads of q and k: [H + Hkv, hd], rows in RoPE pair order
            q_norm = _vector(src, p + "attn_q_norm.weight", hd)
            k_norm = _vector(src, p + "attn_k_norm.weight", hd)
            if head_rows is not None:
                q_norm, k_norm = q_norm[head_rows], k_norm[head_rows]
            self.attn_qk_norm = torch.cat([q_norm.expand(H, hd), k_norm.expand(Hkv, hd)])
        self.attn_output = _qlinear(src, p + "attn_output.weight", (d, H * hdv), exact, use_native)
        self.ffn_norm = _vector(src, p + "ffn_norm.weight", d)
        gate_up = [
            (p + "ffn_gate.weight", (hp.n_ff, d), None),
            (p + "ffn_up.weight", (hp.n_ff, d), None),
        ]
        self.ffn_gate_up = _projection(src, gate_up, exact, use_native)
        self.ffn_down = _qlinear(src, p + "ffn_down.weight", (d, hp.n_ff), exact, use_native)
        if hp.rules.post_norms:
            self.post_attention_norm = _vector(src, p + "post_attention_norm.weight", d)
            self.post_ffw_norm = _vector(src, p + "post_ffw_norm.weight", d)
        self.window = hp.sliding_window if hp.is_sliding(index) else 0
        # A single decoded token: q/k norms, RoPE, the cache write and attention in one call.
        self.decode_attention: native.DecodeAttention | None = None
        if use_native and native.library() is not None and native.attention_decode_fits(hd, hdv):
            qk_norm = self.attn_qk_norm if hp.rules.qk_norm else None
            self.decode_attention = native.DecodeAttention(
                H, Hkv, (hd, hdv), hp.attn_scale, qk_norm, hp.rms_eps
            )

    def forward(
        self,
        x: torch.Tensor,
        chunks: Sequence[SeqChunk],
        caches: Sequence[SeqCache],
        rope: RotaryTable,
    ) -> torch.Tensor:
        """x: [T_total, D] -> [T_total, D]."""
        hp, eps, fast = self.hp, self.hp.rms_eps, self.use_native
        H, Hkv, hd, hdv = hp.n_head, hp.n_head_kv, hp.head_dim, hp.head_dim_v
        h = rms_norm(x, self.attn_norm, eps, fast)
        qkv = self.attn_qkv(h)  # [T, (H + Hkv) hd + Hkv hdv], a new tensor: changed in place
        if self.attn_qkv_bias is not None:
            qkv = qkv + self.attn_qkv_bias
        if self.decode_attention is not None and all(c.n == 1 for c in chunks):
            outs = []  # decode: one token per sequence, one native call each
            for i, cache in enumerate(caches):
                pos = cache.length
                first = pos + 1 - self.window if self.window and pos + 1 > self.window else 0
                table, kv = rope.upto(pos + 1), cache.buffers(self.index)
                outs.append(self.decode_attention(qkv[i : i + 1], table, kv, pos, first))
            o = torch.cat(outs) if len(outs) > 1 else outs[0]  # [T, H hdv]
        else:
            qk = qkv[:, : (H + Hkv) * hd].unflatten(-1, (H + Hkv, hd))  # [T, H + Hkv, hd]
            v = qkv[:, (H + Hkv) * hd :].unflatten(-1, (Hkv, hdv))  # [T, Hkv, hdv]
            if hp.rules.qk_norm:
                qk = rms_norm(qk, self.attn_qk_norm, eps, fast)
            outs, t0 = [], 0
            for chunk, cache in zip(chunks, caches, strict=True):
                t1 = t0 + chunk.n
                start = cache.length
                part = qk[t0:t1]
                rotate_pairs_(part, rope.get(start, chunk.n))
                kall, vall = cache.write(self.index, part[:, H:], v[t0:t1])  # [L, Hkv, hd]
                outs.append(
                    attention(part[:, :H], kall, vall, start, hp.attn_scale, self.window, fast)
                )
                t0 = t1
            o = torch.cat(outs) if len(outs) > 1 else outs[0]  # [T, H hdv]
        a = self.attn_output(o)
        if hp.rules.post_norms:
            a = rms_norm(a, self.post_attention_norm, eps, fast)
        x, h = add_rms_norm(x, a, self.ffn_norm, eps, fast)
        f = self.ffn_down(gated_act(self.ffn_gate_up(h), hp.rules.activation, fast))
        if hp.rules.post_norms:
            f = rms_norm(f, self.post_ffw_norm, eps, fast)
        return x + f


class Stage(nn.Module):
    """Layers [start, stop) of the model described by `hp`, loaded from `src`.

    forward(x, chunks): x is LongTensor [T_total] of token ids when start == 0, else fp32 hidden
    states [T_total, n_embd]. Returns hidden states [T_total, n_embd], or for the last stage logits
    [R, n_vocab] for the rows selected by `logits_rows` (default: the last token of each chunk).
    """

    def __init__(
        self,
        hp: HParams,
        src: WeightSource,
        start: int,
        stop: int,
        n_ctx: int,
        on_layer: Callable[[int], None] | None = None,
        exact: bool = False,
        use_native: bool = True,
        huge_pages: bool = True,
    ) -> None:
        """huge_pages: move the weights into 2 MiB pages now (see `huge_pages`)."""
        super().__init__()
        if not 0 <= start < stop <= hp.n_layer:
            raise ValueError(f"layer range [{start}, {stop}) is not inside [0, {hp.n_layer})")
        self.hp, self.start, self.stop, self.n_ctx = hp, start, stop, n_ctx
        self.use_native = use_native
        self.is_first, self.is_last = start == 0, stop == hp.n_layer
        if self.is_first or self.is_last:
            info = _check(src, "token_embd.weight", (hp.n_vocab, hp.n_embd))
            embd_raw = torch.from_numpy(np.array(src.raw("token_embd.weight")))
        if self.is_first:
            self.token_embd = QEmbedding.from_raw(embd_raw, info.qtype, (hp.n_vocab, hp.n_embd))
        self.blk = nn.ModuleDict()
        for i in range(start, stop):
            self.blk[str(i)] = Block(hp, i, src, exact, use_native)
            if on_layer is not None:
                on_layer(i)
        if self.is_last:
            self.output_norm = _vector(src, "output_norm.weight", hp.n_embd)
            if "output.weight" in src.tensors:
                shape = (hp.n_vocab, hp.n_embd)
                self.output = _qlinear(src, "output.weight", shape, exact, use_native)
            else:  # tied embeddings: the head reads the embedding matrix
                shape = (hp.n_vocab, hp.n_embd)
                self.output = QLinear.from_raw(embd_raw, info.qtype, shape, exact, use_native)
        self.ropes: dict[float, RotaryTable] = {}
        for i in range(start, stop):
            base = hp.rope_base_for(i)
            if base not in self.ropes:
                self.ropes[base] = RotaryTable(hp.rope_dim, hp.head_dim, base, hp.rope_scale)
        self.caches: dict[int, SeqCache] = {}
        self.arena: torch.Tensor | None = None  # the weights' huge-page mapping (huge_pages)
        if huge_pages:
            self.huge_pages()

    def huge_pages(self) -> int:
        """Move this stage's weights (every parameter and buffer of 16 KiB or more) into one
        mapping backed by 2 MiB pages (native.huge_page_arena says why) and give the memory they
        leave back to the OS; those of 32 MiB or more go into huge pages where they lie where the
        kernel can (native.collapse_in_place), so that no copy of them is ever held twice. The
        bytes now in huge pages, 0 where the OS has none for us. Once."""
        if self.arena is not None:  # moved already (what was collapsed in place not counted)
            return self.arena.numel()
        at: dict[int, int] = {}  # tensor id -> its offset in the arena (ids of live tensors)
        offset, in_place = 0, 0
        for m in self.modules():
            for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
                n = t.numel() * t.element_size()
                if t.device.type != "cpu" or n < _ARENA_MIN_BYTES or id(t) in at:
                    continue
                if n >= _IN_PLACE_MIN_BYTES and native.collapse_in_place(t):
                    in_place += n  # (a copy of this one would double the peak by its size)
                    continue
                at[id(t)] = offset
                offset += -(-n // 64) * 64  # each one 64-byte aligned
        arena = native.huge_page_arena(offset) if at else None
        if arena is None:
            return in_place
        native.release_free_memory()  # the load's scratch first: the peak is the stage + a little
        moved = [0]
        copies: dict[int, torch.Tensor] = {}  # id of a moved tensor -> its copy (one per tensor)

        def move(t: torch.Tensor) -> torch.Tensor:
            if id(t) in copies:  # the same tensor held by a second module
                return copies[id(t)]
            start = at.get(id(t))
            if start is None:
                return t
            n = t.numel() * t.element_size()
            new = arena[start : start + n].view(t.dtype).view(t.shape)
            new.copy_(t)
            copies[id(t)] = new
            moved[0] += n
            return new

        for m in self.modules():  # module by module, the old copies going back to the OS as it goes
            m._apply(move, recurse=False)
            if moved[0] >= _RELEASE_EVERY_BYTES:
                native.release_free_memory()
                moved[0] = 0
        self.arena = arena
        native.release_free_memory()
        return arena.numel() + in_place

    # -- sequences -------------------------------------------------------------------------------
    def cache(self, seq_id: int) -> SeqCache:
        if seq_id not in self.caches:
            hp = self.hp
            self.caches[seq_id] = SeqCache(
                range(self.start, self.stop), hp.n_head_kv, hp.head_dim, hp.head_dim_v, self.n_ctx
            )
        return self.caches[seq_id]

    def drop(self, seq_id: int) -> None:
        self.caches.pop(seq_id, None)

    def position(self, seq_id: int) -> int:
        """Tokens of `seq_id` already in this stage's cache (0 for a sequence it has not seen)."""
        cache = self.caches.get(seq_id)
        return 0 if cache is None else cache.length

    def weight_bytes(self) -> int:
        """Bytes of weights this stage holds in memory (see QLinear: u4/u8, int4, bf16 or fp32)."""
        total = 0
        for m in self.modules():
            if isinstance(m, QLinear | QEmbedding):
                total += m.nbytes
        for blk in self.blk.values():
            total += sum(
                t.numel() * t.element_size()
                for t in vars(blk).values()
                if isinstance(t, torch.Tensor)
            )
        return total

    # -- compute ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        x: torch.Tensor,
        chunks: Sequence[SeqChunk],
        logits_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        total = sum(c.n for c in chunks)
        if x.shape[0] != total:
            raise ValueError(f"input has {x.shape[0]} rows but the chunks add up to {total}")
        caches = [self.cache(c.seq_id) for c in chunks]
        for c, cache in zip(chunks, caches, strict=True):
            cache.reserve(c.n)
        if self.is_first:
            x = self.token_embd(x)
            if self.hp.rules.embed_scale_sqrt:
                x = x * torch.tensor(self.hp.n_embd**0.5, dtype=torch.float32)
        for i in range(self.start, self.stop):
            x = self.blk[str(i)](x, chunks, caches, self.ropes[self.hp.rope_base_for(i)])
        for c, cache in zip(chunks, caches, strict=True):
            cache.commit(c.n)
        if not self.is_last:
            return x
        if logits_rows is not None:
            x = x[logits_rows]
        elif len(chunks) == 1:
            x = x[-1:]
        else:
            x = x[torch.tensor(np.cumsum([c.n for c in chunks]) - 1)]
        h = rms_norm(x, self.output_norm, self.hp.rms_eps, self.use_native)
        return self.output(h)
