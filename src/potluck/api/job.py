"""One HTTP request's choices (prompts × n) on the scheduler: their streams, their text so far,
and the queue their events come back on (from the compute thread, through
`loop.call_soon_threadsafe`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from potluck.api.text import StopText
from potluck.engine.scheduler import Event, Stream


@dataclass
class Choice:
    index: int
    stream: Stream
    text: StopText
    n_prompt: int
    prompt: int  # which of the request's prompts it continues (its n choices share one)
    n_generated: int = 0
    n_cached: int = 0  # of its n_prompt tokens, those reused from the prefix cache (Finished)
    finish: str | None = None
    done: bool = False
    offset: int = 0  # characters sent so far (completions' text_offset)


@dataclass(frozen=True)
class Piece:
    index: int
    text: str
    ids: list[int]
    finish: str | None


@dataclass
class Job:
    """The choices of one HTTP request, running on the scheduler."""

    choices: list[Choice] = field(default_factory=list)
    queue: asyncio.Queue[tuple[int, Event]] = field(default_factory=asyncio.Queue)
    prompt_tokens: int = 0

    def cancel(self) -> None:
        for c in self.choices:
            if not c.done:
                c.stream.cancel()

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage. Each prompt counts once however many choices continue it (n), and so
        do its cached tokens: the fewest any of its choices reused (each choice looks the prefix
        cache up by itself, so a later one may find more of it)."""
        done = sum(c.n_generated for c in self.choices)
        cached: dict[int, int] = {}  # prompt → its tokens every choice of it reused
        for c in self.choices:
            cached[c.prompt] = min(cached.get(c.prompt, c.n_cached), c.n_cached)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": done,
            "total_tokens": self.prompt_tokens + done,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
        }
