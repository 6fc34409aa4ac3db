"""The OpenAI-compatible HTTP server: what it answers, where each part of it lives, and running
it on a socket (`serve`, `bind`, `uvicorn_server`).

Endpoints: POST /v1/chat/completions, POST /v1/completions (both streaming or not; tools,
structured outputs, reasoning), POST /v1/responses (+ GET / DELETE /v1/responses/{id}),
POST /v1/messages and /v1/messages/count_tokens (Anthropic's), POST /v1/embeddings, GET /v1/models, GET /health, GET /metrics (Prometheus), GET /api/pool (the
dashboard), and the files of api/static/ at /. With an API key set, everything but /health and
the static files needs `Authorization: Bearer KEY`. With a batch folder, OpenAI's Files and Batches API too (batches.py).

The modules of api/, one concern each:
  app.py          `create_app`: the routes, the key check, the error handlers and the web page
  state.py        `Api`, what the routes share (checks, submitting a request's choices, text
                  pieces from the scheduler's events, logprobs); `ServerConfig`, `model_id_of`
  job.py          `Job`, `Choice`, `Piece`: one request's choices on the scheduler
  chat.py         `ChatTurn` → `prepare`: a chat turn's prompt, grammar and answer parser, for every
                  chat-like route; tools.py (tool formats, rendering, the forced-call grammar),
                  reply.py (an answer → reasoning, content, tool calls)
  responses.py    POST /v1/responses; messages.py: POST /v1/messages (Anthropic's)
  completions.py  POST /v1/chat/completions and /v1/completions and their bodies; sse.py: their
                  streaming form
  embeddings.py   POST /v1/embeddings and its body; the models it serves (the chat model's
                  `Embedder`, engine/embed.py, and those beside it: `serve_beside`)
  info.py         GET /health, /v1/models, /api/pool, /metrics
  errors.py       `ApiError` (OpenAI's error JSON) and the one mapping of every error onto it
  text.py, metrics.py, pool.py: detokenizing with stop strings, /metrics, /api/pool's figures;
                  batches.py, batch_store.py, batch.py: batch jobs
`create_app`, `ServerConfig` and `model_id_of` are importable from here too (cli/serve.py and
cli/batch.py import them from here).

GET /api/pool returns exactly:
  {"model": {"name", "arch", "quant", "n_layer", "n_ctx"},
   "nodes": [{"name", "address" ("local" or "host:port"), "device", "layers": [start, stop],
              "memory_used_bytes", "memory_total_bytes", "compute_ms" (or null), "hop_ms" (or null),
              "tokens_per_s" (or null), "status" ("ok" or "unreachable")}],
   "tokens_per_s", "requests_active", "requests_queued", "requests_total",
   "prefix_cache": {"hits", "misses", "cached_tokens", "entries", "bytes"},
   "batches": [{"id", "status", "total", "completed", "failed"}] (running ones and the last done)}
"""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from potluck.api.app import create_app
from potluck.api.state import ServerConfig, model_id_of
from potluck.errors import PotluckError
from potluck.hosts import is_loopback

__all__ = [
    "ServerConfig",
    "bind",
    "create_app",
    "is_loopback",
    "model_id_of",
    "serve",
    "uvicorn_server",
]


def bind(host: str, port: int) -> tuple[socket.socket, str]:
    """A listening socket on host:port (0: any free port) and its URL."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PotluckError(
            f"cannot listen on {host}:{port}: {exc.strerror}; pick another --port"
        ) from None
    sock.listen(2048)
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    return sock, f"http://{shown}:{sock.getsockname()[1]}"


def uvicorn_server(app: FastAPI) -> Any:
    """A uvicorn.Server for the app; run it with `.run(sockets=[sock])`, stop it with
    `.should_exit = True` (or Ctrl-C when it runs on the main thread)."""
    import uvicorn

    config = uvicorn.Config(
        app, log_level="warning", access_log=False, timeout_graceful_shutdown=3, lifespan="on"
    )
    return uvicorn.Server(config)


def serve(app: FastAPI, host: str, port: int, on_listen: Callable[[str], None]) -> None:
    """Run the app with uvicorn until Ctrl-C. `on_listen` gets the URL (with the real port when
    port is 0) once the socket accepts connections."""
    sock, url = bind(host, port)
    server = uvicorn_server(app)
    # uvicorn shuts down gracefully on SIGINT and SIGTERM, then raises the signal again under the
    # handler it found: the default ones would kill the process (SIGTERM) or interrupt whatever
    # runs next (SIGINT) before the caller lets its pool go, and workers would hold its stages
    # until their idle timeout. Under ours the run returns. (Ours also stops a server that has
    # not installed its own handlers yet: a signal right after `on_listen`, which is therefore
    # called only once ours are in place: a supervisor that stops the server as soon as it said
    # it listens would otherwise meet the default handler, and the workers keep its stages.)

    def stop(signum: int, frame: object) -> None:
        server.should_exit = True

    stops = (signal.SIGINT, signal.SIGTERM)
    main_thread = threading.current_thread() is threading.main_thread()
    old = {sig: signal.signal(sig, stop) for sig in stops} if main_thread else {}
    try:
        on_listen(url)
        server.run(sockets=[sock])
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
