"""The app: `create_app` puts together one loaded model's routes (completions.py, info.py, and
batches.py's when a batch folder is set), the API key check, the error handlers (errors.py), the
answers counter (metrics.py) and the web page of api/static/ at /."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI
from starlette.staticfiles import StaticFiles

from potluck import __version__
from potluck.api import errors
from potluck.api.batch import Recruit
from potluck.api.completions import add_completion_routes
from potluck.api.embeddings import add_embedding_routes
from potluck.api.info import add_info_routes
from potluck.api.messages import add_message_routes
from potluck.api.metrics import StatusCounter
from potluck.api.responses import add_response_routes
from potluck.api.state import Api, ServerConfig
from potluck.engine.generate import Model
from potluck.engine.scheduler import Scheduler

STATIC_DIR = Path(__file__).parent / "static"


def create_app(
    model: Model,
    scheduler: Scheduler,
    config: ServerConfig,
    batch_replicas: Sequence[tuple[str, Any]] = (),
    batch_recruit: Recruit | None = None,
) -> FastAPI:
    """The app for one loaded model and its running scheduler (the CLI builds both: cli/serve.py).
    batch_replicas: more (label, app) for batch jobs (whole-model replicas on idle workers);
    batch_recruit: such replicas again once their worker is back, and on workers found later."""
    api = Api(model, scheduler, config)
    app = FastAPI(
        title="Potluck",
        version=__version__,
        description="OpenAI-compatible API over a pool of home computers.",
        docs_url="/docs",
        redoc_url=None,
    )
    app.state.api = api
    app.add_middleware(StatusCounter, metrics=api.metrics)
    guarded = [Depends(api.auth)]
    posted = [Depends(api.auth), Depends(api.json_body)]

    errors.add_handlers(app)

    if config.batch_dir is not None:  # the Files and Batches API (api/batches.py)
        from potluck.api.batch_store import BatchStore
        from potluck.api.batches import LANES_BEHIND_CHATS, BatchRunner, add_batch_routes

        store = BatchStore(config.batch_dir)
        lanes = max(1, scheduler.config.max_active - LANES_BEHIND_CHATS)
        key = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        replicas = [("this server", app), *batch_replicas]
        runner = BatchRunner(store, replicas, lanes, key, batch_recruit)
        app.state.batches = store
        app.router.on_startup.append(runner.start)
        app.router.on_shutdown.append(runner.stop)
        add_batch_routes(app, store, runner, guarded)

    add_info_routes(app, api, guarded)
    add_completion_routes(app, api, posted)
    add_response_routes(app, api, posted, guarded)
    add_embedding_routes(app, api, posted)
    add_message_routes(app, api)  # Anthropic's Messages API (its own key check and errors)

    if STATIC_DIR.is_dir():
        app.mount("/", StaticFiles(directory=STATIC_DIR, html=True), name="static")
    return app
