"""Cached prefixes: finished sequences whose KV the stages keep, for a later request to start from.

A chat UI sends the whole conversation every turn; the previous turn's sequence already holds the
KV of all of it but the new message. When a sequence ends, the scheduler puts it here (its ids,
the positions the stages hold) instead of dropping it; a new request finds the entry whose ids
share the longest prefix with its prompt and computes only the rest. When it shares most of the
entry (the next turn of that chat) it takes the entry over: the stages forget the positions past
the shared part (a rewind). When it shares a smaller part (a system prompt or a batch's common
instructions, which other requests will share too) the entry stays, and the request's sequence
starts as a copy of that part (a fork); the entry is pinned until the copy is made. Entries past
the byte budget go, least recently used first (never a pinned one), and the scheduler drops
their KV everywhere.

A hybrid model's recurrent layers hold a sequence's state at its last position only, and at one
checkpoint the stages keep (one token before the end of its last prompt: SeqChunk.mark): there an
entry serves a request that keeps all of it, or all of it up to its checkpoint (the same prompt
again, and the next turn of a chat whose template re-renders the last answer otherwise, as
Qwen's drop its reasoning), taken over or copied at that point.

Plain bookkeeping: no model, no pipeline; the scheduler does the dropping (engine/scheduler.py).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# A prefix shorter than this is not worth an entry's KV (a chat template's first few tokens are
# the same in every conversation): the request starts afresh.
MIN_REUSE = 4


def budget_bytes(
    cache_ram_mib: int | None, n_ctx: int, kv_per_token: int, state_bytes: int = 0
) -> int:
    """The cache's KV budget: `cache_ram_mib` MiB (--cache-ram; 0: off), by default one full
    context's K and V (`kv_per_token`: one position over every layer) and a hybrid's recurrent
    state (`state_bytes` per sequence)."""
    if cache_ram_mib is None:
        return n_ctx * kv_per_token + state_bytes
    return cache_ram_mib << 20


def planned_sequences(budget: int, n_ctx: int, kv_per_token: int, state_bytes: int = 0) -> int:
    """How many full-context sequences' KV the budget is planned as (beside -np's): the planner
    and every node count that much more KV room."""
    return math.ceil(budget / max(1, n_ctx * kv_per_token + state_bytes))


def adopts(held: int, reuse: int) -> bool:
    """Whether a request that keeps `reuse` of a cached sequence's `held` positions takes it over
    (it drops little of it: the next turn of that chat) rather than copying the shared part and
    leaving the sequence cached (a system prompt, instructions that other requests share)."""
    return held - reuse <= max(4 * MIN_REUSE, held // 8)


@dataclass(frozen=True)
class Entry:
    seq_id: int
    ids: tuple[int, ...]  # the ids whose K/V the stages hold, position 0 on
    lora: int | None  # the adapters its K/V were computed with (a request must match them)
    mark: int = -1  # a hybrid's checkpoint of its recurrent state on the stages (-1: none)

    @property
    def n(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class Hit:
    entry: Entry
    reuse: int  # leading positions of the entry the request keeps
    # the request's sequence starts as a copy of those (SeqChunk.fork) and the entry stays; else
    # it takes the entry over (most of it is kept: the next turn of a chat)
    fork: bool = False


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Finished sequences by seq id, least recently used first, within `budget_bytes` of KV
    (`bytes_per_token`: K and V of one position over every stage of the model; `state_bytes`: a
    hybrid's recurrent state per sequence, which also means that an entry is reused whole or not
    at all)."""

    def __init__(self, budget_bytes: int, bytes_per_token: int, state_bytes: int = 0) -> None:
        self.budget_bytes = max(0, budget_bytes)
        self.bytes_per_token = max(1, bytes_per_token)
        self.state_bytes = state_bytes
        self.whole_only = state_bytes > 0
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        self._pins: dict[int, int] = {}  # entries a fork copies from now: kept until it is done

    @property
    def on(self) -> bool:
        return self.budget_bytes > 0

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(self._bytes(e.n) for e in self._entries.values())

    def _bytes(self, n: int) -> int:
        return n * self.bytes_per_token + self.state_bytes

    def take(self, prompt: Sequence[int], lora: int | None) -> Hit | None:
        """The entry sharing the longest prefix with `prompt` (at least MIN_REUSE ids, and never
        the whole prompt: its last token is computed, for the logits); None when no entry shares
        enough. A hit to adopt leaves the cache (the request's sequence becomes it); one to fork
        from stays, pinned (`unpin` once the copy is made), and becomes the most recently used.
        whole_only: an entry counts up to its end or its checkpoint, no other position."""
        best: Hit | None = None
        for e in self._entries.values():
            if e.lora != lora:
                continue
            n = min(common_prefix(e.ids, prompt), len(prompt) - 1)
            if self.whole_only:  # its end or its checkpoint, the furthest the prompt keeps
                n = max((p for p in (e.n, e.mark) if 0 < p <= n), default=0)
            if n >= MIN_REUSE and (best is None or n > best.reuse):
                best = Hit(e, n)
        if best is None:
            return None
        seq_id = best.entry.seq_id
        if adopts(best.entry.n, best.reuse) and not self._pins.get(seq_id):
            del self._entries[seq_id]
            return best
        # a shorter shared part (or one a fork copies from now): copy it, keep the entry
        self._pins[seq_id] = self._pins.get(seq_id, 0) + 1
        self._entries.move_to_end(seq_id)
        return Hit(best.entry, best.reuse, fork=True)

    def unpin(self, seq_id: int) -> list[int]:
        """A fork from `seq_id` is done; the seq ids to drop (entries the budget no longer
        holds, which the pin kept)."""
        n = self._pins.get(seq_id, 0) - 1
        if n > 0:
            self._pins[seq_id] = n
        else:
            self._pins.pop(seq_id, None)
        return self._evict()

    def put(self, seq_id: int, ids: Sequence[int], lora: int | None, mark: int = -1) -> list[int]:
        """Keep a finished sequence (mark: its recurrent state's checkpoint); the seq ids to drop
        (evicted ones, or this one when it alone is over the budget)."""
        entry = Entry(seq_id, tuple(ids), lora, mark)
        if not self.on or self._bytes(entry.n) > self.budget_bytes or not entry.n:
            return [seq_id]
        self._entries[seq_id] = entry
        self._entries.move_to_end(seq_id)
        return self._evict()

    def _evict(self) -> list[int]:
        """Least recently used entries out until the rest fit the budget (pinned ones stay)."""
        gone: list[int] = []
        for seq_id in list(self._entries):
            if self.nbytes <= self.budget_bytes:
                break
            if not self._pins.get(seq_id):
                del self._entries[seq_id]
                gone.append(seq_id)
        return gone

    def clear(self) -> list[int]:
        """Forget every entry; their seq ids (to drop)."""
        ids = list(self._entries)
        self._entries.clear()
        self._pins.clear()
        return ids
