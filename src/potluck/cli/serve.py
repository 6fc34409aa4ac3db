"""`potluck serve`: the OpenAI-compatible API (and the web page) over the model, with batch
replicas on the workers its plan leaves idle."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from potluck import __version__
from potluck.cli.batch import _recruit, _say
from potluck.cli.config import ModelFlags, PoolFlags, SpecFlags, takes
from potluck.cli.console import err
from potluck.cli.load import _drafter, _load
from potluck.cli.options import (
    DEFAULT_PARALLEL,
    CacheRamOpt,
    EmbeddingModelOpt,
    ParallelOpt,
    _port,
)
from potluck.cli.runtime import places
from potluck.errors import PotluckError

if TYPE_CHECKING:
    from fastapi import FastAPI

    from potluck.engine.generate import Model
    from potluck.model.stage import Compute


@takes
def serve(
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", callback=_port, help="Port to listen on (0: any free one).")
    ] = 8080,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            help="Clients must send 'Authorization: Bearer KEY' (default: $POTLUCK_API_KEY).",
        ),
    ] = None,
    no_api_key: Annotated[
        bool,
        typer.Option("--no-api-key", help="Allow a non-loopback address without an API key."),
    ] = False,
    max_queue: Annotated[
        int, typer.Option("--max-queue", help="Requests that may wait; more get HTTP 429.")
    ] = 64,
    batch_dir: Annotated[
        Path | None,
        typer.Option(
            "--batch-dir",
            help="Where the batch API keeps its database and files (default: the cache's batches/).",
        ),
    ] = None,
    parallel: ParallelOpt = DEFAULT_PARALLEL,
    cache_ram: CacheRamOpt = None,
    embedding_model: EmbeddingModelOpt = None,
    *,
    flags: ModelFlags,
    net: PoolFlags,
    speculative: SpecFlags,
) -> None:
    """Serve the model (over a pool with --peer) as an OpenAI-compatible API with a web page."""
    import dataclasses

    from potluck.api.embeddings import serve_beside
    from potluck.api.server import ServerConfig, create_app, is_loopback, model_id_of
    from potluck.api.server import serve as run_server
    from potluck.engine.generate import DEFAULT_N_BATCH, prompt_batch
    from potluck.engine.prefix import budget_bytes
    from potluck.engine.scheduler import Scheduler, SchedulerConfig
    from potluck.engine.spec import NO_SPEC

    key = api_key or os.environ.get("POTLUCK_API_KEY") or None
    if not is_loopback(host) and key is None and not no_api_key:
        raise PotluckError(
            f"refusing to listen on {host} without an API key: anyone on the network could use "
            "the model; pass --api-key KEY (or set POTLUCK_API_KEY), or --no-api-key to accept that"
        )
    try:
        sched_config = SchedulerConfig(  # checked now; n_batch settled once the pool is known
            n_batch=flags.batch or DEFAULT_N_BATCH, max_queue=max_queue, max_active=parallel
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    here = places()
    embedder = _embedding_model(embedding_model, flags.compute()) if embedding_model else None
    workers: list[str] = []
    # a --peer that does not answer yet is left out, not fatal: the server starts on the rest and
    # takes it in as a batch replica once it answers (the Recruiter below)
    finder = net.finder(keep_asking=True)
    # many streams at once: stages even in decode time
    m = _load(
        flags, net, balance="decode", n_seq=parallel, found=workers, finder=finder,
        cache_ram=cache_ram,
    )  # fmt: skip
    cache_bytes = budget_bytes(cache_ram, m.n_ctx, m.kv_bytes_per_token, m.state_bytes)
    sched_config = dataclasses.replace(
        sched_config,
        n_batch=prompt_batch(m, flags.batch),
        cache_bytes=cache_bytes,
        spec=speculative.config(),
    )
    scheduler = Scheduler(m, sched_config, _drafter(speculative, m, flags.compute()))
    # workers the plan leaves idle run batch jobs, each with the whole model, where they can
    used = {a.node for a in m.pipeline.assignments}
    idle = [a for a in workers if a not in used]
    ctx = flags.ctx
    from potluck.pool.replicas import Recruiter, ReplicaSpec, idle_replicas

    auth = net.auth()
    spec = ReplicaSpec(m.path, ctx, auth, parallel, cache=here.cache)
    extra, reload = idle_replicas(spec, idle, _say) if idle else ([], None)
    extra_schedulers: list[Scheduler] = []

    def replica_app(r: Model) -> FastAPI:
        # (a replica's memory was planned for -np sequences: no prefix cache beside them; it
        # serves batch jobs' many streams: no drafts)
        config = dataclasses.replace(
            sched_config, n_batch=prompt_batch(r), cache_bytes=0, spec=NO_SPEC
        )
        extra_schedulers.append(Scheduler(r, config))
        return create_app(r, extra_schedulers[-1], ServerConfig(model_id=model_id_of(r)))

    extra_apps = [(label, replica_app(r)) for label, r in extra]
    # ... and so do workers that come back, or are started after the server
    recruits = Recruiter(spec, finder, workers, replica_app, extra, _say)
    recruits.add(extra, reload)

    batches = batch_dir or here.cache / "batches"
    config = ServerConfig(model_id=model_id_of(m), api_key=key, batch_dir=batches)
    app_ = create_app(m, scheduler, config, extra_apps, _recruit(recruits))
    if embedder is not None:
        serve_beside(app_, embedder)

    def on_listen(url: str) -> None:
        auth = "API key required" if key else "no API key"
        err.print(
            f"potluck serve {__version__} listening on {url} · model {model_id_of(m)} · {auth} · "
            "Ctrl-C to stop",
            soft_wrap=True,
        )

    try:
        run_server(app_, host, port, on_listen)
    finally:  # Ctrl-C or SIGTERM: uvicorn stopped gracefully and run_server returned
        for sch in (scheduler, *extra_schedulers):
            sch.close()
        for model_ in (m, *(r for _, r in extra)):
            model_.close()  # the workers free this head's stages now
        if embedder is not None:
            embedder.close()


def _embedding_model(name: str, compute: Compute) -> Model:
    """--embedding-model, loaded on this machine (its pooling checked now: a file that cannot
    make embeddings is refused before the pool is planned)."""
    from potluck.engine.embed import POOLINGS, Embedder
    from potluck.engine.generate import load_model
    from potluck.modelfile.sources import resolve_model

    model = load_model(resolve_model(name, places()), compute=compute)
    embedder = Embedder(model)
    if embedder.refusal is not None:
        model.close()
        raise PotluckError(f"--embedding-model: {embedder.refusal}")
    pooling = POOLINGS[embedder.pooling]
    err.print(f"[dim]embedding model: {model.summary()} · {pooling} pooling[/]", soft_wrap=True)
    return model
