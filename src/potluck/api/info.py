"""The GET routes that describe the server: /health (no key needed), /v1/models and
/v1/models/{id} (the model, its adapters as `BASE+ADAPTER` and the embedding models served
beside it: embeddings.py), /api/pool (the dashboard's JSON,
its contract in server.py's docstring; with the batches running and the last done) and /metrics
(Prometheus)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, params
from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from potluck.api.batch_store import batch_progress
from potluck.api.state import Api


def add_info_routes(app: FastAPI, api: Api, guarded: list[params.Depends]) -> None:
    """The routes on `app` (guarded: the API key check, for all but /health)."""
    config, scheduler = api.config, api.scheduler

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": config.model_id,
            "requests_active": scheduler.active,
            "requests_queued": scheduler.queued,
        }

    def beside() -> dict[str, int]:
        """The embedding models served beside the chat model: id → context."""
        served = getattr(app.state, "embeddings", None)
        return {} if served is None else {i: e.model.n_ctx for i, e in served.beside}

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict[str, Any]:
        ids = [config.model_id, *api.adapter_ids]
        cards = [_model_card(api, i, api.model.n_ctx) for i in ids]
        cards += [_model_card(api, i, n_ctx) for i, n_ctx in beside().items()]
        return {"object": "list", "data": cards}

    @app.get("/v1/models/{name}", dependencies=guarded)
    async def model_card(name: str) -> dict[str, Any]:
        if name in (embedding := beside()):
            return _model_card(api, name, embedding[name])
        api.check_model(name)
        return _model_card(
            api, name if name in api.adapter_ids else config.model_id, api.model.n_ctx
        )

    @app.get("/api/pool", dependencies=guarded)
    async def pool() -> dict[str, Any]:
        snap = api.pool.snapshot()
        store = getattr(app.state, "batches", None)
        snap["batches"] = [] if store is None else batch_progress(store)
        return snap

    @app.get("/metrics", dependencies=guarded)
    async def metrics(request: HttpRequest) -> Response:
        body, content_type = api.metrics.render(request.headers.get("accept"))
        return Response(body, media_type=content_type)


def _model_card(api: Api, model_id: str, n_ctx: int) -> dict[str, Any]:
    return {
        "id": model_id,
        "object": "model",
        "created": api.created,
        "owned_by": "potluck",
        "context_length": n_ctx,
    }
