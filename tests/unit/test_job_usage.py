"""OpenAI's usage object of one request (api/job.py `Job.usage`): each prompt counts once however
many choices continue it, and so do its cached tokens (`prompt_tokens_details.cached_tokens`,
from each choice's `Finished.n_cached`). The end-to-end form: tests/test_api.py."""

from __future__ import annotations

from typing import Any

from potluck.api.job import Choice, Job


def job(prompts: list[int], n: int, cached: list[int], generated: list[int]) -> Job:
    """A finished request: `prompts` (their lengths) × n choices, choice i having reused
    cached[i] prompt tokens and generated generated[i]."""
    j = Job(prompt_tokens=sum(prompts))
    for i, (c, g) in enumerate(zip(cached, generated, strict=True)):
        p = i // n
        stream: Any = None  # (usage reads neither the stream nor the text)
        j.choices.append(Choice(i, stream, stream, prompts[p], p, n_generated=g, n_cached=c))
    return j


def test_usage_has_cached_tokens_even_when_none_were() -> None:
    assert job([7], 1, [0], [3]).usage() == {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_cached_tokens_count_each_prompt_once() -> None:
    """Two prompts × n=2: the prompts' tokens once each (as prompt_tokens), the completions of
    every choice; a prompt's cached tokens are those all of its choices reused."""
    u = job([10, 6], 2, [5, 5, 4, 6], [1, 2, 3, 4]).usage()
    assert u["prompt_tokens"] == 16 and u["completion_tokens"] == 10
    assert u["prompt_tokens_details"] == {"cached_tokens": 5 + 4}
    assert u["prompt_tokens_details"]["cached_tokens"] <= u["prompt_tokens"]
    one = job([10], 3, [5, 5, 5], [1, 1, 1]).usage()
    assert one["prompt_tokens"] == 10 and one["prompt_tokens_details"]["cached_tokens"] == 5
