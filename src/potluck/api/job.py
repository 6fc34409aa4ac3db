"""One HTTP request's choices (prompts × n) on the scheduler: their streams, their text so far,
and the queue their events come back on (from the compute thread, through
`loop.call_soon_threadsafe`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from potluck.api.text import StopText
from potluck.engine.scheduler import Event, Stream


@dataclass
class Choice:
    index: int
    stream: Stream
    text: StopText
    n_prompt: int
    n_generated: int = 0
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

    def usage(self) -> dict[str, int]:
        done = sum(c.n_generated for c in self.choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": done,
            "total_tokens": self.prompt_tokens + done,
        }
