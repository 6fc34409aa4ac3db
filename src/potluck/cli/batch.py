"""`potluck batch` and the batch replicas it runs on (also `serve`'s, on the workers its plan
leaves idle): loaded at the start, and recruited while a job runs."""

from __future__ import annotations

import time
from collections.abc import Callable
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
from potluck.cli.peers import _auth, _found
from potluck.cli.runtime import _setup_threads
from potluck.errors import PotluckError

if TYPE_CHECKING:
    from fastapi import FastAPI

    from potluck.api.batch import Progress as BatchProgress
    from potluck.api.batch import Recruit
    from potluck.discovery.pool import PeerFinder
    from potluck.engine.generate import Model

AuthFlags = tuple[str | None, bool]  # --secret, --tls (cli/peers._auth)
Reload = Callable[[str], "Model | None"]  # a failed replica loaded again (pool/replicas.py)


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
    """Run a file of OpenAI batch requests (chat or text completions) and write OpenAI's output
    lines; with workers, every machine that holds the model runs requests of its own (replicas).
    Killed or stopped, the same command again continues where it ended."""
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
    finder = net.finder()
    workers: list[str] = []
    replicas, reload = _replicas(
        model, ctx, threads, finder, net.auth_flags(), _head_mem(mem), parallel, workers
    )  # fmt: skip
    schedulers: list[Scheduler] = []

    def app_of(m: Model) -> FastAPI:
        config = SchedulerConfig(n_batch=prompt_batch(m), max_active=parallel, max_queue=len(items))
        schedulers.append(Scheduler(m, config))
        return create_app(m, schedulers[-1], ServerConfig(model_id=model_id_of(m), api_key=None))

    apps = [(label, app_of(m)) for label, m in replicas]
    path = replicas[0][1].path
    recruits = _Recruits(path, ctx, finder, workers, net.auth_flags(), parallel, app_of, replicas)
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
                run_batch(apps, items, journal, parallel, on_progress, recruit=recruits.recruit())
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


def _idle_replicas(
    path: Path, ctx: int | None, idle: list[str], auth_flags: AuthFlags, n_seq: int
) -> tuple[list[tuple[str, Model]], Reload | None]:
    """Batch replicas for `serve` on the workers its plan leaves idle (each that can hold the
    whole model): ([(label, Model)], reload) as `_replicas`; none when none can."""
    from potluck.planner import THIS_MACHINE
    from potluck.planner.errors import NotEnoughMemoryError
    from potluck.planner.replicas import plan_replicas
    from potluck.pool.planning import PlanInputs, survey_model
    from potluck.pool.replicas import load_replicas, reloader

    auth = _auth(*auth_flags)
    # this machine serves: it offers no memory for a replica
    nodes, links, fp = survey_model(PlanInputs(path, ctx, auth, mem=0, n_seq=n_seq), idle)
    try:
        plan = plan_replicas(fp, nodes, links)
    except NotEnoughMemoryError as exc:
        err.print(f"[dim]no batch replicas on the idle workers: {exc}[/]")
        return [], None
    usable = [r for r in plan.replicas if r.plan is None and r.nodes[0] != THIS_MACHINE]
    for r in usable:
        err.print(f"[dim]batch replica {r.label}: the whole model, for batch jobs[/]")
    names = [n.name for n in nodes]
    reload = reloader(path, ctx, usable, names, links, auth, n_seq)
    return load_replicas(path, ctx, usable, names, links, auth, n_seq), reload


class _Recruits:
    """Batch replicas a running job gains (api.batch.Recruit): a failed one whose worker is back,
    loaded again; each worker found since the start (a peers-file or mDNS worker started later)
    that can hold the whole model, loaded as a replica of its own. make_app(model) -> ASGI app;
    `replicas` ([(label, Model)]) gets each model loaded, for closing."""

    def __init__(
        self, path: Path, ctx: int | None, finder: PeerFinder, known: list[str],
        auth_flags: AuthFlags, n_seq: int, make_app: Callable[[Model], FastAPI],
        replicas: list[tuple[str, Model]],
    ) -> None:  # fmt: skip
        self.path, self.ctx, self.finder, self.n_seq = path, ctx, finder, n_seq
        self.known: set[str] = set(known)  # workers used or tried already
        self.auth_flags, self.make_app, self.replicas = auth_flags, make_app, replicas
        self.reloads: dict[str, Reload] = {}  # label -> reload(label) (pool/replicas.py)

    def add(self, loaded: list[tuple[str, Model]], reload: Reload | None) -> None:
        for label, _ in loaded:
            if reload is not None:
                self.reloads[label] = reload

    def recruit(self) -> Recruit:
        from potluck.api.batch import Recruit

        return Recruit(self.revive, self.join)

    async def revive(self, label: str) -> FastAPI | None:
        import asyncio

        reload = self.reloads.get(label)
        m = await asyncio.to_thread(reload, label) if reload is not None else None
        if m is None:
            return None
        self.replicas.append((label, m))
        return self.make_app(m)

    async def join(self) -> list[tuple[str, FastAPI]]:
        import asyncio

        new = await asyncio.to_thread(self._newcomers)
        if not new:
            return []
        self.known.update(new)
        try:
            loaded, reload = await asyncio.to_thread(
                _idle_replicas, self.path, self.ctx, new, self.auth_flags, self.n_seq
            )
        except PotluckError as exc:
            err.print(f"[yellow]worker {', '.join(new)} found, but not used: {exc}[/]")
            return []
        self.add(loaded, reload)
        self.replicas.extend(loaded)
        return [(label, self.make_app(m)) for label, m in loaded]

    def _newcomers(self) -> list[str]:
        from potluck.discovery.pool import member
        from potluck.transport.client import NodeClient

        auth = _auth(*self.auth_flags)
        admit = member(lambda a: NodeClient(a, auth))
        found = self.finder.again(lambda p: "" if p.address in self.known else admit(p))
        return [p.address for p in found.peers if p.address not in self.known]


def _replicas(
    model: str | None, ctx: int | None, threads: int | None, finder: PeerFinder,
    auth_flags: AuthFlags, mem: int | None, n_seq: int, found: list[str],
) -> tuple[list[tuple[str, Model]], Reload | None]:  # fmt: skip
    """The batch job's replicas, loaded: ([(label, Model)], reload). Alone: this machine. With
    workers: each machine that holds the whole model is a replica, the others one pipeline
    (planner). reload(label): a failed single-machine replica loaded again if its machine
    answers, else None (blocking)."""
    from potluck.engine.generate import load_model
    from potluck.modelfile.sources import resolve_model
    from potluck.planner.replicas import plan_replicas
    from potluck.pool.planning import PlanInputs, survey_model
    from potluck.pool.replicas import load_replicas, reloader

    _setup_threads(threads)
    path = resolve_model(model)
    addresses = _found(finder, lambda: _auth(*auth_flags))
    found.extend(addresses)
    if not addresses:
        if mem == 0:
            raise no_workers_for("the model")
        m = load_model(path, ctx, n_seq=n_seq)
        err.print(f"[dim]{m.summary()}[/]")
        return [("this machine", m)], lambda label: None
    auth = _auth(*auth_flags)
    nodes, links, fp = survey_model(PlanInputs(path, ctx, auth, mem=mem, n_seq=n_seq), addresses)
    plan = plan_replicas(fp, nodes, links)
    for r in plan.replicas:
        how = "a pipeline" if r.plan is not None else "the whole model"
        err.print(f"[dim]replica {r.label}: {how}, {r.tokens_per_s:.1f} tok/s per stream[/]")
    for node, why in plan.left_out:
        err.print(f"[dim]  left out {node}: {why}[/]")
    names = [n.name for n in nodes]
    reload = reloader(path, ctx, plan.replicas, names, links, auth, n_seq)
    return load_replicas(path, ctx, plan.replicas, names, links, auth, n_seq), reload
