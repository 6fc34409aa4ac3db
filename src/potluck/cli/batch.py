"""`potluck batch` and the batch replicas it runs on (also `serve`'s, on the workers its plan
leaves idle): loaded at the start, and recruited while a job runs."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)

from potluck.cli.config import PeersFlags, takes
from potluck.cli.console import err
from potluck.cli.options import (
    DEFAULT_PARALLEL,
    CtxOpt,
    HeadMemOpt,
    ModelOpt,
    ParallelOpt,
    ThreadsOpt,
    _head_mem,
    no_workers_for,
)
from potluck.cli.runtime import compute_of, places
from potluck.errors import PotluckError

if TYPE_CHECKING:
    from fastapi import FastAPI

    from potluck.api.batch import Progress as BatchProgress
    from potluck.api.batch import Recruit
    from potluck.discovery.pool import PeerFinder
    from potluck.engine.generate import Model
    from potluck.pool.replicas import Recruiter, Reload, ReplicaSpec


@takes
def batch(
    input_file: Annotated[
        Path, typer.Argument(help="OpenAI Batch API input: one request per line (JSONL).")
    ],
    output: Annotated[
        Path, typer.Option("-o", "--output", help="Results, one line per request (JSONL).")
    ],
    errors_file: Annotated[
        Path | None,
        typer.Option(
            "--errors", help="Lines that failed, with the reason (default: OUTPUT.errors.jsonl)."
        ),
    ] = None,
    model: ModelOpt = None,
    ctx: CtxOpt = None,
    threads: ThreadsOpt = None,
    parallel: ParallelOpt = DEFAULT_PARALLEL,
    mem: HeadMemOpt = None,
    *,
    net: PeersFlags,
) -> None:
    """Run a file of OpenAI batch requests (chat or text completions, embeddings) and write
    OpenAI's output lines; with workers, every machine that holds the model runs requests of its
    own (replicas; embeddings need the model on this machine alone). Killed or stopped, the same
    command again continues where it ended."""
    import asyncio

    from potluck.api.batch import Journal, read_input, run_batch, write_bad_lines
    from potluck.api.server import ServerConfig, create_app, model_id_of
    from potluck.engine.generate import prompt_batch
    from potluck.engine.scheduler import Scheduler, SchedulerConfig

    if not input_file.is_file():
        raise PotluckError(f"batch input {input_file} does not exist or is not a file")
    errors_path = errors_file or output.with_name(
        output.name.removesuffix(".jsonl") + ".errors.jsonl"
    )
    items, bad = read_input(input_file)
    journal = Journal(output, errors_path)
    already = sum(journal.is_done(it) for it in items)
    if already:
        err.print(f"[dim]resuming: {already} of {len(items)} requests are done in {output}[/]")
    if n_bad := write_bad_lines(bad, journal):
        err.print(f"[yellow]{n_bad} lines cannot run: reasons in {errors_path}[/]")
    if already == len(items):
        err.print(f"every request is done: {output}")
        return
    from potluck.modelfile.sources import resolve_model
    from potluck.pool.replicas import Recruiter, ReplicaSpec

    compute, here = compute_of(threads), places()
    spec = ReplicaSpec(resolve_model(model, here), ctx, net.auth(), parallel, compute, here.cache)
    finder = net.finder(keep_asking=True)  # a --peer down is left out, and joins once it answers
    workers: list[str] = []
    replicas, reload = _replicas(spec, finder, net, _head_mem(mem), workers)
    schedulers: list[Scheduler] = []

    def app_of(m: Model) -> FastAPI:
        config = SchedulerConfig(n_batch=prompt_batch(m), max_active=parallel, max_queue=len(items))
        schedulers.append(Scheduler(m, config))
        return create_app(m, schedulers[-1], ServerConfig(model_id=model_id_of(m), api_key=None))

    apps = [(label, app_of(m)) for label, m in replicas]
    recruits = Recruiter(spec, finder, workers, app_of, replicas, _say)
    recruits.add(replicas, reload)

    bar = Progress(
        TextColumn("[bold]batch[/]"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), console=err,
    )  # fmt: skip
    lost: list[str] = []
    back: list[str] = []
    joined: list[str] = []
    try:
        with bar:
            task = bar.add_task("batch", total=len(items) - already, rate="")

            def on_progress(p: BatchProgress) -> None:
                dt = max(time.perf_counter() - p.t0, 1e-9)
                failed = f", {p.failed} failed" if p.failed else ""
                each = (
                    " (" + ", ".join(f"{k}: {v}" for k, v in p.by_replica.items()) + ")"
                    if len(replicas) > 1
                    else ""
                )
                bar.update(
                    task,
                    completed=p.done + p.failed,
                    rate=f"{p.tokens / dt:.1f} tok/s{failed}{each}",
                )
                for label in p.lost[len(lost) :]:
                    lost.append(label)
                    err.print(f"[yellow]replica {label} failed: its requests go to the others[/]")
                for label in p.back[len(back) :]:
                    back.append(label)
                    err.print(f"[green]replica {label} is back and takes requests again[/]")
                for label in p.joined[len(joined) :]:
                    joined.append(label)
                    err.print(f"[green]replica {label} joins: a worker found since the start[/]")

            done = asyncio.run(
                run_batch(apps, items, journal, parallel, on_progress, recruit=_recruit(recruits))
            )
    finally:
        for sch in schedulers:
            sch.close()
        for _, m in replicas:
            m.close()
    err.print(
        f"{done.done} requests done, {done.failed} failed, {done.tokens} tokens in "
        f"{time.perf_counter() - done.t0:.1f} s: {output}"
        + (f" (errors: {errors_path})" if done.failed or bad else "")
    )


def _say(text: str, notable: bool = False) -> None:
    """pool/replicas.py's lines for the user."""
    err.print(f"[yellow]{text}[/]" if notable else f"[dim]{text}[/]")


def _recruit(recruiter: Recruiter[FastAPI]) -> Recruit:
    from potluck.api.batch import Recruit

    return Recruit(recruiter.revive, recruiter.join)


def _replicas(
    spec: ReplicaSpec, finder: PeerFinder, net: PeersFlags, mem: int | None, found: list[str]
) -> tuple[list[tuple[str, Model]], Reload | None]:
    """The batch job's replicas, loaded: ([(label, Model)], reload). Alone: this machine. With
    workers: pool/replicas.batch_replicas (reload(label): a failed single-machine replica loaded
    again if its machine answers, else None; blocking)."""
    from potluck.engine.generate import load_model
    from potluck.pool.replicas import batch_replicas

    addresses = net.found(finder)
    found.extend(addresses)
    if not addresses:
        if mem == 0:
            raise no_workers_for("the model")
        m = load_model(spec.path, spec.n_ctx, n_seq=spec.n_seq, compute=spec.compute)
        err.print(f"[dim]{m.summary()}[/]")
        return [("this machine", m)], lambda label: None
    return batch_replicas(spec, addresses, mem, _say)
