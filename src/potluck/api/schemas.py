"""Request bodies of the OpenAI-compatible endpoints, as pydantic models.

Fields follow OpenAI's API reference; a few llama.cpp / vLLM extensions (`top_k`, `min_p`,
`repeat_penalty`) are accepted too. Unknown fields are ignored, as OpenAI's own server does for
fields a model does not use.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from potluck.sampling import (
    MAX_LOGPROBS,
    REPEAT_PENALTY_MAX,
    REPEAT_PENALTY_MIN,
)

MAX_STOPS = 4  # stop sequences per request (OpenAI's limit)
MAX_N = 16  # choices per request
# Seeds: OpenAI's are int64, the sampler's generator (numpy PCG64) and the wire's SamplingConfig.seed are uint64; a
# negative seed is its uint64 twin (seed mod 2**64), as the sampler reads it (seed % 2**64).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
TOP_K_ALL = 2**31 - 1  # a top_k past the vocabulary keeps every token; the wire's top_k is int32


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # JSON's NaN / Infinity: 400

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # extensions (llama.cpp server / vLLM names)
    top_k: int = Field(default=40, ge=0)
    min_p: float = Field(default=0.05, ge=0.0, le=1.0)
    repeat_penalty: float = Field(default=1.0, ge=REPEAT_PENALTY_MIN, le=REPEAT_PENALTY_MAX)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and not SEED_MIN <= v <= SEED_MAX:
            raise ValueError(
                f"{v} is out of range: give an integer from {SEED_MIN} to {SEED_MAX} "
                f"(64 bits, signed or unsigned)"
            )
        return v

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def seed_of(self, j: int) -> int | None:
        """Choice j's seed: seed + j, as a uint64 (wrapping past 2**64 - 1)."""
        return None if self.seed is None else (self.seed + j) % 2**64


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ... go to the template as given
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprob_k(self) -> int | None:
        """None: no logprobs; k: logprobs with k alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    """(Without max_tokens: 16, OpenAI's default here, or what is left of the context.)"""

    # a text, several texts, token ids, or several lists of token ids
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    def limit(self) -> int | None:
        return self.max_tokens

    def logprob_k(self) -> int | None:
        return self.logprobs
