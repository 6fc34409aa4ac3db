"""Errors as OpenAI's API returns them: {"error": {"message", "type", "param", "code"}}.

Every error the server answers with goes through `ApiError`, and is mapped onto it once, here:
Potluck's typed errors (`api_error`: a full queue 429, a prompt too long 400, a pool that lost a
node 503, any other 500), Starlette's own (`http_error`: 405, a body it cannot parse), and
pydantic's validation errors (the handlers `add_handlers` puts on the app). A streaming request
that has started gets the same object as one SSE event (`ApiError.sse`).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from potluck.engine.scheduler import QueueFullError, SchedulerClosedError
from potluck.errors import ContextError, NodeError, PoolLostError, PotluckError, UnsupportedError
from potluck.modelfile.chat import ChatTemplateError

log = logging.getLogger(__name__)


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


def pool_unavailable(message: str) -> ApiError:
    """The pool cannot run the request: a node failed or went away (failover off, or no way to
    re-plan on the machines left)."""
    return ApiError(503, message, "server_error", None, "pool_unavailable")


class Disconnected(Exception):
    """The client of a non-streaming request went away (answered 499, which nobody reads)."""


# -- the mapping, once ----------------------------------------------------------------------------
def api_error(exc: BaseException) -> ApiError:
    """Potluck's typed errors → the HTTP answer (mapped once, here)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, QueueFullError):
        return overloaded(str(exc))
    if isinstance(exc, ContextError):
        return bad_request(str(exc), "messages", "context_length_exceeded")
    if isinstance(exc, UnsupportedError | ChatTemplateError):
        return bad_request(str(exc))
    if isinstance(exc, NodeError | PoolLostError):
        return pool_unavailable(str(exc))
    if isinstance(exc, SchedulerClosedError):  # the server is shutting down
        return ApiError(503, str(exc), "server_error")
    if isinstance(exc, PotluckError):
        return server_error(str(exc))
    log.error("unexpected error: %r", exc)
    return server_error(f"internal error: {type(exc).__name__}: {exc}")


def http_error(request: HttpRequest, exc: HTTPException) -> ApiError:
    cause = exc.__cause__
    if exc.status_code == 400 and isinstance(cause, UnicodeDecodeError):
        return bad_request(f"the body is not valid UTF-8 ({cause}): send JSON in UTF-8")
    if exc.status_code == 400 and isinstance(cause, RecursionError):
        return bad_request(f"the body's JSON is nested too deeply to parse ({cause})")
    if exc.status_code == 400 and cause is not None:
        return bad_request(f"the body is not valid JSON: {cause}")
    if exc.status_code == 405:  # (from the static files too, which take every other path)
        path = request.url.path
        routes = [r for r in request.app.routes if isinstance(r, APIRoute)]
        takes = sorted({m for r in routes if r.path_regex.match(path) for m in r.methods or ()})
        if not takes and path.startswith("/v1/"):  # (the web page's files answer every GET)
            return not_found_path(request)
        return ApiError(
            405,
            f"{request.method} {path} is not supported; it takes {', '.join(takes) or 'GET'}",
            headers={"Allow": ", ".join(takes or ["GET", "HEAD"])},
        )
    kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
    return ApiError(exc.status_code, str(exc.detail), kind, headers=dict(exc.headers or {}) or None)


def add_handlers(app: FastAPI) -> None:
    """The app's exception handlers: every error it answers with in OpenAI's shape."""

    @app.exception_handler(ApiError)
    async def _on_api_error(_: HttpRequest, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(Disconnected)
    async def _on_gone(_: HttpRequest, exc: Disconnected) -> Response:
        return Response(status_code=499)  # nobody reads it: the client went away (nginx's code)

    @app.exception_handler(RequestValidationError)
    async def _on_invalid(_: HttpRequest, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        ctx = first.get("ctx", {})
        if first.get("type") == "json_invalid":
            msg = f"the body is not valid JSON: {ctx.get('error', first.get('msg'))}"
            return bad_request(msg).response()
        if not loc and first.get("type") == "missing":
            return bad_request(
                "the body is empty: send a JSON object (Content-Type: application/json)"
            ).response()
        where = ".".join(loc) or "body"
        why = ctx.get("error") if first.get("type") == "value_error" else first.get("msg")
        return bad_request(f"{where}: {why or 'invalid value'}", where).response()

    @app.exception_handler(HTTPException)
    async def _on_http(request: HttpRequest, exc: HTTPException) -> Response:
        """Starlette's and FastAPI's own errors (405, a body it cannot parse) in OpenAI's shape."""
        return http_error(request, exc).response()

    @app.exception_handler(404)
    async def _on_404(request: HttpRequest, _: Exception) -> Response:
        if request.url.path.startswith("/v1/"):
            return not_found_path(request).response()
        return ApiError(
            404, f"no route {request.method} {request.url.path}", "invalid_request_error"
        ).response()


def not_found_path(request: HttpRequest) -> ApiError:
    """404 for a path under /v1/ that this server does not serve (OpenAI's words and shape)."""
    routes = [r for r in request.app.routes if isinstance(r, APIRoute)]
    known = sorted({r.path for r in routes if r.path.startswith("/v1/")})
    return ApiError(
        404,
        f"Invalid URL ({request.method} {request.url.path}): this server serves {', '.join(known)}",
        "invalid_request_error",
        code="unknown_url",
    )
