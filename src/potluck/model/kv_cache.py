"""Per-sequence KV cache of one stage, in ggml tensors: K and V per layer, grown by doubling.

Layout per layer (ggml order, innermost first): K is [head_dim * n_kv_heads, capacity] and V is
[head_dim_v * n_kv_heads, capacity], one row per position, so that a step writes its rows with
`ggml_set_rows` and attention reads a strided view [head_dim, n_kv, n_kv_heads] of the first n_kv
rows (graph.py). f16 by default as llama.cpp; f32 for exactness checks (`--cache-type f32`).
The buffers are zeroed when allocated: attention reads padded rows beyond `length` (masked out),
and a masked row must hold finite numbers (0 * NaN is NaN).

A hybrid model's recurrent layers (Gated DeltaNet) keep no K and V: per layer a fixed-size state
(`RecurrentState`: the convolution's last inputs and the delta rule's matrices, f32) that the
step's graph reads and overwrites. It holds the sequence at `length` and nowhere else, but for
one checkpoint: a copy of it at the last position the head marked (`mark`; one token before a
prompt's end, where the same prompt again and the next turn of a chat start), and the states after each token of its last drafted
chunk (`Snapshots`: speculative decoding rewinds past the drafts not kept). A cache can be
truncated or copied to its end, its checkpoint, a snapshot or 0 (a fresh state), and to no other
position.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from potluck.errors import ContextError
from potluck.model.ggml_lib import TYPE_F16, TYPE_F32, lib
from potluck.model.ggml_lib import context as new_context

CACHE_TYPES = {"f16": TYPE_F16, "f32": TYPE_F32}
_ELEMENT = {TYPE_F16: np.float16, TYPE_F32: np.float32}
MIN_CAPACITY = 256  # positions a new sequence gets first; also the padding of attention's n_kv


def cache_bytes(n_layers: int, row: int, positions: int, cache_type: int) -> int:
    """Bytes of K and V for `positions` tokens over `n_layers` layers; row: K's + V's elements
    per token and layer (n_head_kv * (head_dim + head_dim_v))."""
    return n_layers * positions * row * np.dtype(_ELEMENT[cache_type]).itemsize


class RecurrentState:
    """The recurrent layers' states of one sequence on one stage, allocated once (their size does
    not depend on the sequence's length) and zeroed: per layer `conv` f32 [(d_conv - 1) · C]
    (the convolution's last inputs) and `delta` f32 [S · S · value heads] (the delta rule's
    matrices), in buffers of their layer's device."""

    def __init__(
        self,
        layers: Sequence[int],
        sizes: tuple[int, int],
        buffer_type: Callable[[int], int],
        what: str = "a recurrent state",
    ) -> None:
        self.layers = list(layers)
        self._ctx: int | None = new_context(2 * len(self.layers))
        self.conv: dict[int, int] = {}
        self.delta: dict[int, int] = {}
        by_buft: dict[int, list[int]] = {}
        for i in self.layers:
            self.conv[i] = lib.ggml_new_tensor_1d(self._ctx, TYPE_F32, sizes[0])
            self.delta[i] = lib.ggml_new_tensor_1d(self._ctx, TYPE_F32, sizes[1])
            by_buft.setdefault(buffer_type(i), []).append(i)
        tensors = {
            b: [t for i in ls for t in (self.conv[i], self.delta[i])] for b, ls in by_buft.items()
        }
        self._buffers = _alloc_by_buft(tensors, what)
        self.clear()

    def tensors(self) -> list[int]:
        return [t for i in self.layers for t in (self.conv[i], self.delta[i])]

    def clear(self) -> None:
        """Back to the state before any token (zeros)."""
        for buf in self._buffers:
            lib.ggml_backend_buffer_clear(buf, 0)

    def copy_from(self, src: RecurrentState) -> None:
        """(ggml's tensor copy: within the device, or a plain memcpy on the CPU.)"""
        for a, b in zip(src.tensors(), self.tensors(), strict=True):
            lib.ggml_backend_tensor_copy(a, b)

    def nbytes(self) -> int:
        return sum(lib.ggml_nbytes(t) for t in self.tensors())

    def free(self) -> None:
        for buf in self._buffers:
            lib.ggml_backend_buffer_free(buf)
        if self._ctx is not None:
            lib.ggml_free(self._ctx)
        self._buffers, self._ctx, self.conv, self.delta = [], None, {}, {}


class Snapshots:
    """The recurrent layers' states after each token of one chunk (a drafted one): `slots[j]`
    holds them after the chunk's token j (the graph copies them there: each token's convolution
    window, and ggml_gated_delta_net's state slots)."""

    def __init__(
        self,
        layers: Sequence[int],
        sizes: tuple[int, int],
        n: int,
        buffer_type: Callable[[int], int],
    ) -> None:
        what = "the drafts' state snapshots"
        self.slots = [RecurrentState(layers, sizes, buffer_type, what) for _ in range(n)]

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.slots)

    def free(self) -> None:
        for s in self.slots:
            s.free()


def _alloc_by_buft(by_buft: dict[int, list[int]], what: str) -> list[int]:
    """Allocate the tensors of one context, one buffer per buffer type (device) they go to."""
    buffers: list[int] = []
    for buft, tensors in by_buft.items():
        size = sum(lib.ggml_nbytes(t) + 256 for t in tensors)  # 256: alignment slack per tensor
        buf: int | None = lib.ggml_backend_buft_alloc_buffer(buft, size)
        if not buf:
            for b in buffers:
                lib.ggml_backend_buffer_free(b)
            raise ContextError(f"no memory for {what} ({size / 2**20:.0f} MiB); lower -np")
        base = lib.ggml_backend_buffer_get_base(buf)
        at = 0
        for t in tensors:
            at = -(-at // 256) * 256
            lib.ggml_backend_tensor_alloc(buf, t, base + at)
            at += lib.ggml_nbytes(t)
        buffers.append(buf)
    return buffers


class SeqCache:
    """K and V of one sequence for the attention layers of one stage, and the recurrent state of
    its recurrent layers (`state`; None where it has none). `length` counts committed tokens;
    `generation` changes whenever the KV buffers move (a graph that points into them is stale)."""

    def __init__(
        self,
        layers: range,
        n_kv_heads: int,
        head_dim: int,
        head_dim_v: int,
        n_ctx: int,
        cache_type: int,
        buffer_type: Callable[[int], int],
        recurrent: Sequence[int] = (),
        state_sizes: tuple[int, int] = (0, 0),
    ) -> None:
        """buffer_type(layer): the ggml buffer type that layer's cache lives in (its device);
        recurrent: the layers of `layers` that keep a state of state_sizes (f32 elements of its
        convolution's and of its delta rule's) instead of K and V."""
        self.layers, self.n_ctx, self.cache_type = layers, n_ctx, cache_type
        self.attn_layers = [i for i in layers if i not in set(recurrent)]
        self.row_k, self.row_v = n_kv_heads * head_dim, n_kv_heads * head_dim_v
        self._buffer_type = buffer_type
        self.length = 0
        self.generation = 0
        self.capacity = 0
        self.k: dict[int, int] = {}  # layer -> ggml tensor [row_k, capacity]
        self.v: dict[int, int] = {}
        self._ctx: int | None = None
        self._buffers: list[int] = []
        self.state = RecurrentState(recurrent, state_sizes, buffer_type) if recurrent else None
        # the state at position `marked` (-1: none), made by the first mark
        self.checkpoint: RecurrentState | None = None
        self.marked = -1
        # the states after each token of the last drafted chunk, which ended at `snap_end`:
        # those at positions [snap_lo, snap_hi] still hold this sequence's history
        self.snaps: Snapshots | None = None
        self.snap_end = self.snap_lo = 0
        self.snap_hi = -1
        self._state_args = (recurrent, state_sizes, buffer_type)
        if self.attn_layers:
            self._allocate(min(MIN_CAPACITY, n_ctx))
        else:  # nothing grows with the sequence
            self.capacity = n_ctx

    def _allocate(self, capacity: int) -> None:
        old = (self.k, self.v, self._ctx, self._buffers)
        ctx = new_context(2 * len(self.attn_layers))
        k: dict[int, int] = {}
        v: dict[int, int] = {}
        by_buft: dict[int, list[int]] = {}
        for i in self.attn_layers:
            k[i] = lib.ggml_new_tensor_2d(ctx, self.cache_type, self.row_k, capacity)
            v[i] = lib.ggml_new_tensor_2d(ctx, self.cache_type, self.row_v, capacity)
            by_buft.setdefault(self._buffer_type(i), []).append(i)
        buffers: list[int] = []
        if len(by_buft) == 1:
            buft = next(iter(by_buft))
            buf: int | None = lib.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft)
            if not buf:
                lib.ggml_free(ctx)
                raise ContextError(
                    f"no memory for a KV cache of {capacity} positions "
                    f"({self._bytes(capacity) / 2**20:.0f} MiB); lower -c or -np"
                )
            buffers.append(buf)
        else:  # layers on several devices: one buffer per device
            buffers = self._alloc_split(ctx, k, v, by_buft, capacity)
        for buf in buffers:
            lib.ggml_backend_buffer_clear(buf, 0)
        if old[2] is not None and self.length:
            for i in self.attn_layers:  # copy the positions held so far
                for src, dst, row in ((old[0][i], k[i], self.row_k), (old[1][i], v[i], self.row_v)):
                    n = self.length * row * np.dtype(_ELEMENT[self.cache_type]).itemsize
                    tmp = np.empty(n, np.uint8)
                    lib.ggml_backend_tensor_get(src, tmp.ctypes.data, 0, n)
                    lib.ggml_backend_tensor_set(dst, tmp.ctypes.data, 0, n)
        self.k, self.v, self._ctx, self._buffers = k, v, ctx, buffers
        self.capacity = capacity
        self.generation += 1
        if old[2] is not None:
            for buf in old[3]:
                lib.ggml_backend_buffer_free(buf)
            lib.ggml_free(old[2])

    def _alloc_split(
        self,
        ctx: int,
        k: dict[int, int],
        v: dict[int, int],
        by_buft: dict[int, list[int]],
        cap: int,
    ) -> list[int]:
        """Tensors of several devices in one context: allocate each device's tensors in a buffer
        of its own (ggml_backend_alloc_ctx_tensors_from_buft takes a whole context)."""
        buffers: list[int] = []
        for buft, layers in by_buft.items():
            size = sum(
                lib.ggml_nbytes(t) + 256 for i in layers for t in (k[i], v[i])
            )  # 256: alignment slack per tensor
            buf: int | None = lib.ggml_backend_buft_alloc_buffer(buft, size)
            if not buf:
                raise ContextError(
                    f"no memory for a KV cache of {cap} positions on a device "
                    f"({size / 2**20:.0f} MiB); lower -c or -np, or put fewer layers there (-ngl)"
                )
            base = lib.ggml_backend_buffer_get_base(buf)
            at = 0
            for i in layers:
                for t in (k[i], v[i]):
                    at = -(-at // 256) * 256
                    lib.ggml_backend_tensor_alloc(buf, t, base + at)
                    at += lib.ggml_nbytes(t)
            buffers.append(buf)
        return buffers

    def _bytes(self, capacity: int) -> int:
        kv = cache_bytes(len(self.attn_layers), self.row_k + self.row_v, capacity, self.cache_type)
        states = (self.state, self.checkpoint, self.snaps)
        return kv + sum(s.nbytes() for s in states if s is not None)

    def reserve(self, n_new: int) -> None:
        need = self.length + n_new
        if need > self.n_ctx:
            raise ContextError(
                f"sequence needs {need} positions but the context is {self.n_ctx} "
                f"({self.length} used + {n_new} new); raise -c or shorten the prompt"
            )
        if need > self.capacity:
            self._allocate(min(self.n_ctx, max(need, 2 * self.capacity)))

    def commit(self, n_new: int) -> None:
        self.length += n_new

    def mark(self) -> None:
        """Keep the recurrent state as it is now (at `length`): the checkpoint, replacing the
        one before. (Nothing to keep without recurrent layers: K and V can be truncated.)"""
        if self.state is None:
            return
        if self.checkpoint is None:
            self.checkpoint = RecurrentState(*self._state_args)
        self.checkpoint.copy_from(self.state)
        self.marked = self.length

    def will_snap(self, n: int) -> None:
        """The next chunk (n tokens, drafted) keeps the states after each of its tokens: room
        for n snapshots (new buffers, a new generation, when there were fewer)."""
        if self.state is None:
            return
        if self.snaps is None or len(self.snaps.slots) < n:
            if self.snaps is not None:
                self.snaps.free()
            recurrent, sizes, buffer_type = self._state_args
            self.snaps = Snapshots(recurrent, sizes, n, buffer_type)
            self.generation += 1

    def snapped(self, n: int) -> None:
        """The chunk of n tokens that just ended at `length` wrote its snapshots."""
        self.snap_end, self.snap_lo, self.snap_hi = self.length, self.length - n + 1, self.length

    def _state_at(self, n: int, length: int) -> str | None:
        """Why the recurrent state cannot stand at position n of `length` (None: it can: its
        end, its checkpoint, a snapshot, or 0)."""
        if self.state is None or n in (0, length, self.marked):
            return None
        if self.snap_lo <= n <= self.snap_hi:
            return None
        kept = f"; its checkpoint is at {self.marked}" if self.marked >= 0 else ""
        return f"it holds only its last position {length}{kept}"

    def truncate(self, n: int) -> None:
        """Forget the positions from `n` on (their rows stay, masked out, until overwritten). A
        recurrent state goes back to its checkpoint or to 0 (cleared), nowhere else."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot keep {n} positions of a cache holding {self.length}")
        if why := self._state_at(n, self.length):
            raise ValueError(f"cannot rewind a recurrent state from {self.length} to {n}: {why}")
        if self.state is not None and n < self.length:
            if n == 0:
                self.state.clear()
            elif n == self.marked:
                assert self.checkpoint is not None
                self.state.copy_from(self.checkpoint)
            else:  # a snapshot: after the drafted chunk's token n - snap_lo
                assert self.snaps is not None
                self.state.copy_from(self.snaps.slots[n - self.snap_lo])
        if n < self.marked:
            self.marked = -1
        self.snap_hi = min(self.snap_hi, n)  # (positions past n will be other tokens')
        self.length = n

    def copy_from(self, src: SeqCache, n: int) -> None:
        """Hold exactly the first `n` positions of `src` (a forked prefix), replacing what this
        cache held."""
        if src.layers != self.layers or (src.row_k, src.row_v) != (self.row_k, self.row_v):
            raise ValueError("a cache can only copy a cache of the same layers and shape")
        if not 0 <= n <= src.length:
            raise ValueError(f"cannot copy {n} positions of a cache holding {src.length}")
        if why := src._state_at(n, src.length):
            raise ValueError(f"cannot copy the first {n} positions of a recurrent state: {why}")
        self.length, self.marked, self.snap_hi = 0, -1, -1
        self.reserve(n)
        if self.state is not None and src.state is not None:
            if n == 0:
                self.state.clear()
            elif n == src.length:
                self.state.copy_from(src.state)
            elif n == src.marked:
                assert src.checkpoint is not None
                self.state.copy_from(src.checkpoint)
            else:
                assert src.snaps is not None
                self.state.copy_from(src.snaps.slots[n - src.snap_lo])
        size = np.dtype(_ELEMENT[self.cache_type]).itemsize
        for i in self.attn_layers:
            for a, b, row in ((src.k[i], self.k[i], self.row_k), (src.v[i], self.v[i], self.row_v)):
                nbytes = n * row * size
                tmp = np.empty(nbytes, np.uint8)
                lib.ggml_backend_tensor_get(a, tmp.ctypes.data, 0, nbytes)
                lib.ggml_backend_tensor_set(b, tmp.ctypes.data, 0, nbytes)
        self.length = n

    def nbytes(self) -> int:
        return self._bytes(self.capacity)

    def free(self) -> None:
        for buf in self._buffers:
            lib.ggml_backend_buffer_free(buf)
        if self._ctx is not None:
            lib.ggml_free(self._ctx)
        self._buffers, self._ctx, self.k, self.v = [], None, {}, {}
        for state in (self.state, self.checkpoint, self.snaps):
            if state is not None:
                state.free()

    def __del__(self) -> None:
        self.free()
