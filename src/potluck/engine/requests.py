"""What a scheduler takes and gives: requests, their events, the limits, the counters.

Plain data for the callers of engine/scheduler.py (the HTTP server, batch jobs, tests); nothing
here computes.
"""

from __future__ import annotations

import math
import queue
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from potluck.engine.spec import SpecConfig
from potluck.errors import PotluckError
from potluck.sampling import SamplingParams


class QueueFullError(PotluckError):
    """Too many requests are waiting: the caller should retry later (HTTP 429)."""


class SchedulerClosedError(PotluckError):
    """The scheduler was shut down."""


DEFAULT_N_BATCH = 512  # prompt tokens per forward pass on one machine (llama.cpp's -b)
# Over a pool: micro-batches small enough that the stages work on one prompt at once. Measured
# (bench/RESULTS.md, SmolLM2 over two single-core workers, 512-token prompt): 64 → 1.38×, 96 and
# 128 → 1.45× one core; 256 → 1.06×, 512 → no overlap at all.
POOL_N_BATCH = 128
# The smallest micro-batch a prompt is cut into over a pool: below it, ggml's matrix products lose
# more per token than the overlap gains (prompt_ubatch).
MIN_POOL_UBATCH = 32

MAX_DECODE_ROWS = 8  # sequences in one decode step by default
INTERACTIVE, BATCH = 0, 1  # Request.priority: who is admitted first when sequences free up


def prompt_ubatch(n_prompt: int, n_batch: int, depth: int) -> int:
    """Tokens per micro-batch for a prompt of n_prompt tokens: at most n_batch; over a pool of
    `depth` stages, small enough that the prompt makes 2 × depth micro-batches, so that every
    stage works on one while the others work on theirs (with k equal micro-batches, the prompt
    takes (k + depth - 1) / k stage-times instead of depth), but not under MIN_POOL_UBATCH
    tokens. One machine: n_batch."""
    if depth <= 1:
        return n_batch
    return max(1, min(n_batch, max(MIN_POOL_UBATCH, math.ceil(n_prompt / (2 * depth)))))


@dataclass(frozen=True)
class SchedulerConfig:
    n_batch: int = 512  # prompt tokens per micro-batch (llama.cpp's -b)
    max_queue: int = 64  # requests waiting for a slot; one more is refused (QueueFullError)
    max_active: int = 16  # sequences generating at once (each holds a KV cache up to n_ctx)
    max_rows: int = MAX_DECODE_ROWS  # decode rows (sequences) per forward
    # KV bytes (over every stage) of finished sequences kept for later requests that begin with
    # the same ids (engine/prefix.py; serve's --cache-ram); 0: none kept
    cache_bytes: int = 0
    spec: SpecConfig = SpecConfig()  # speculative decoding (engine/spec.py): off by default

    def __post_init__(self) -> None:
        for name in ("n_batch", "max_active", "max_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.cache_bytes < 0:
            raise ValueError(f"cache_bytes must be ≥ 0, got {self.cache_bytes}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be ≥ 0, got {self.max_queue}")


@dataclass(frozen=True)
class Request:
    """What to generate: prompt ids, how to sample, at most `max_tokens` new ids, ending early on
    any of `stop_ids` (which is still delivered)."""

    prompt: tuple[int, ...]
    params: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int]
    priority: int = INTERACTIVE  # lower runs first: a chat before a batch job's request
    lora: int | None = None  # the model's adapters it uses (SeqChunk.lora: None all, -1 none)


@dataclass(frozen=True)
class TokenEvent:
    token: int  # a sampling.Token (with .logprob, .top) when params.logprobs is set
    index: int  # 0 for the first generated token


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" (a stop id), "length" (max_tokens or the context is full), "cancelled"
    n_prompt: int
    n_generated: int
    n_cached: int = 0  # of the n_prompt tokens, those reused from a cached prefix (not computed)


@dataclass(frozen=True)
class Failed:
    error: Exception


Event = TokenEvent | Finished | Failed
Sink = Callable[[Event], None]


class QueueSink:
    """A sink for synchronous callers: `events()` yields until Finished or Failed."""

    def __init__(self) -> None:
        self.q: queue.SimpleQueue[Event] = queue.SimpleQueue()

    def __call__(self, ev: Event) -> None:
        self.q.put(ev)

    def events(self, timeout: float = 120.0) -> Iterator[Event]:
        while True:
            try:
                ev = self.q.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no event from the scheduler in {timeout:.0f} s") from None
            yield ev
            if isinstance(ev, Finished | Failed):
                return


@dataclass
class Stats:
    """Counters and recent timings, read by the metrics endpoint (plain numbers, no locking
    needed for a consistent-enough snapshot)."""

    requests_total: int = 0
    requests_rejected: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    # per stage of the pipeline, recent ms per decode step: compute, and the network hop into it
    # (0 for a stage on this machine)
    stage_ms: list[float] = field(default_factory=list)
    hop_ms: list[float] = field(default_factory=list)
    decode_rows: float = 0.0  # recent rows per decode step
    max_in_flight: int = 0  # most batches in flight at once so far
    follow_ups: int = 0  # decode steps sent before the token they follow was back (pool)
    # the prefix cache (engine/prefix.py): requests that reused a cached prefix, the prompt tokens
    # they did not compute, and what the cache holds now (sequences, KV bytes over every stage)
    prefix_hits: int = 0
    prefix_misses: int = 0
    cached_tokens: int = 0
    prefix_entries: int = 0
    prefix_bytes: int = 0
    # speculative decoding: decode steps that carried drafts, ids drafted, and those kept
    draft_steps: int = 0
    drafted: int = 0
    draft_kept: int = 0
    draft_rests: int = 0  # times a sequence stopped drafting a while (it did not pay)
    recent: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=4096))

    def tokens_per_s(self, window_s: float = 5.0) -> float:
        """Generated tokens per second over the last `window_s` seconds."""
        now = time.monotonic()
        n = sum(k for t, k in list(self.recent) if now - t <= window_s)
        return n / window_s
