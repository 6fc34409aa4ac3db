"""Per-sequence KV cache of one stage: fp32 buffers per layer, grown by doubling up to n_ctx.

Token-major ([position, kv head, dim]): a step appends whole rows (one contiguous copy per tensor)
and decode attention reads each key as one dense row; prefill attention takes a transposed view.
"""

from __future__ import annotations

import torch

from potluck.errors import ContextError


class SeqCache:
    """K and V of one sequence for the layers of one stage. `length` counts committed tokens."""

    def __init__(self, layers: range, n_kv: int, hd: int, hdv: int, n_ctx: int) -> None:
        self.layers, self.n_ctx = layers, n_ctx
        self.length = 0
        cap = min(64, n_ctx)
        self.k = {i: torch.empty(cap, n_kv, hd) for i in layers}  # [cap, Hkv, hd]
        self.v = {i: torch.empty(cap, n_kv, hdv) for i in layers}

    @property
    def capacity(self) -> int:
        return next(iter(self.k.values())).shape[0] if self.k else self.n_ctx

    def reserve(self, n_new: int) -> None:
        need = self.length + n_new
        if need > self.n_ctx:
            raise ContextError(
                f"sequence needs {need} positions but the context is {self.n_ctx} "
                f"({self.length} used + {n_new} new); raise -c or shorten the prompt"
            )
        if need > self.capacity:
            cap = min(self.n_ctx, max(need, 2 * self.capacity))
            for store in (self.k, self.v):
                for i, buf in store.items():
                    grown = torch.empty(cap, buf.shape[1], buf.shape[2])
                    grown[: self.length] = buf[: self.length]
                    store[i] = grown

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [T, Hkv, hd] at positions [length, length+T); return all keys/values so far,
        [length + T, Hkv, hd] each."""
        end = self.length + k.shape[0]
        kbuf, vbuf = self.k[layer], self.v[layer]
        kbuf[self.length : end] = k
        vbuf[self.length : end] = v
        return kbuf[:end], vbuf[:end]

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole K and V buffers of `layer`, [capacity, Hkv, hd]: for kernels that store the
        new positions themselves (reserve first)."""
        return self.k[layer], self.v[layer]

    def commit(self, n_new: int) -> None:
        self.length += n_new

    def truncate(self, length: int) -> None:
        """Forget positions ≥ length (e.g. to rewind a sequence)."""
        self.length = min(self.length, length)

    def nbytes(self) -> int:
        return sum(t.numel() * 4 for store in (self.k, self.v) for t in store.values())
