"""Errors as OpenAI's API returns them: {"error": {"message", "type", "param", "code"}}.

Every error the server answers with goes through `ApiError`; the handlers in server.py map
pydantic validation errors, malformed JSON and Potluck's typed errors onto it once.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse


class ApiError(Exception):
    """An error answer: HTTP status + OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        """The same error as one SSE event, for failures after a stream has started."""
        return f"data: {json.dumps(self.body())}\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def unauthorized(message: str) -> ApiError:
    return ApiError(
        401,
        message,
        "invalid_request_error",
        None,
        "invalid_api_key",
        {"WWW-Authenticate": "Bearer"},
    )


def model_not_found(name: str, served: str) -> ApiError:
    return ApiError(
        404,
        f"The model '{name}' does not exist; this server serves '{served}' (see GET /v1/models)",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def overloaded(message: str) -> ApiError:
    return ApiError(429, message, "rate_limit_error", None, "queue_full", {"Retry-After": "1"})


def context_too_long(n_ctx: int, n_prompt: int, n_completion: int, what: str) -> ApiError:
    """`what`: "messages" (chat) or "prompt" (completions)."""
    return ApiError(
        400,
        f"This model's maximum context length is {n_ctx} tokens. However, you requested "
        f"{n_prompt + n_completion} tokens ({n_prompt} in the {what}, {n_completion} in the "
        f"completion). Please reduce the length of the {what} or completion, or restart the "
        f"server with a larger -c.",
        "invalid_request_error",
        what,
        "context_length_exceeded",
    )


def server_error(message: str) -> ApiError:
    return ApiError(500, message, "server_error", None, None)
