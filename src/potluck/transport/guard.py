"""The gRPC server interceptor that runs before every handler of a node.

1. A node with a pool secret answers only OPEN_METHODS (Hello and the handshake) without a session;
   any other call needs the `potluck-session` metadata of an open session of the same connection.
   A call without one is refused from its metadata alone, before its message is read.
2. Every received message is checked against transport/limits.py's bounds.
3. Calls anyone may make run on their own small thread pool, so strangers cannot occupy the
   threads that serve the pool, and hold at most OPEN_THREADS × MAX_REQUEST_BYTES at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeAlias

import grpc

from potluck.transport.auth import (
    OPEN_METHODS,
    SESSION_METADATA,
    SESSION_PREFIX,
    PoolAuth,
    SessionTable,
)
from potluck.transport.codec import WireError
from potluck.transport.limits import StreamCounter, check_message

OPEN_THREADS = 2
# A handler of any of the node's methods: the guard sees them all, whatever their message types
# (a string: grpc's classes are generic only in its type stubs).
_Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"


class Guard(grpc.ServerInterceptor):
    def __init__(self, auth: PoolAuth, sessions: SessionTable) -> None:
        self.protected = auth.key is not None
        self.sessions = sessions
        self.open_pool = ThreadPoolExecutor(OPEN_THREADS, thread_name_prefix="potluck-open")

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], _Handler | None],
        details: grpc.HandlerCallDetails,
    ) -> _Handler | None:
        method = details.method
        is_open = method in OPEN_METHODS
        if is_open or not self.protected:
            return _wrap(continuation(details), None, self.open_pool if is_open else None)
        token = next(
            (v for k, v in details.invocation_metadata or () if k == SESSION_METADATA), None
        )
        why = self.sessions.check(token) if isinstance(token, str) else "no session"
        if why is not None:
            return self._refuse(f"{why}; this node requires the pool secret")
        sessions = self.sessions

        def session_ok(context: grpc.ServicerContext) -> None:
            why = sessions.check(token, context.peer())  # type: ignore[arg-type]
            if why is not None:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, SESSION_PREFIX + why)

        return _wrap(continuation(details), session_ok, None)

    def _refuse(self, why: str) -> _Handler:
        """A handler that answers UNAUTHENTICATED without reading the request: as a client-stream
        handler it never asks for the message, whatever the method's real shape."""

        def refuse(request_iterator: Iterator[Any], context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, SESSION_PREFIX + why)

        refuse.experimental_thread_pool = self.open_pool  # type: ignore[attr-defined]
        return grpc.stream_unary_rpc_method_handler(refuse)


def _checked(
    request_iterator: Iterator[Any], context: grpc.ServicerContext, handler_thread: int
) -> Iterator[Any]:
    """The request stream with every message checked. On the handler's own thread a bad message
    aborts the call; on another thread (a handler that reads its stream in the background) the
    stream ends and the call's status says why."""
    counter = StreamCounter()
    for m in request_iterator:
        try:
            check_message(m)
            counter.see(m)
        except WireError as exc:
            if threading.get_ident() == handler_thread:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details(str(exc))
            return
        yield m


def _wrap(
    handler: _Handler | None,
    session_ok: Callable[[grpc.ServicerContext], None] | None,
    pool: ThreadPoolExecutor | None,
) -> _Handler | None:
    if handler is None:
        return None
    kind = (
        "stream" if handler.request_streaming else "unary",
        "stream" if handler.response_streaming else "unary",
    )
    inner = getattr(handler, f"{kind[0]}_{kind[1]}")

    def streaming(request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Any:
        if session_ok is not None:
            session_ok(context)
        return inner(_checked(request_iterator, context, threading.get_ident()), context)

    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        if session_ok is not None:
            session_ok(context)
        try:
            check_message(request)
        except WireError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return inner(request, context)

    behavior: Callable[[Any, grpc.ServicerContext], Any] = (
        streaming if handler.request_streaming else unary
    )
    if pool is not None:
        behavior.experimental_thread_pool = pool  # type: ignore[attr-defined]
    make: Callable[..., _Handler] = getattr(grpc, f"{kind[0]}_{kind[1]}_rpc_method_handler")
    return make(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
