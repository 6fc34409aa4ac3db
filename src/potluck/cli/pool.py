"""The commands that look at the pool or set it up: `plan` (a dry run), `nodes`, `doctor`,
`secret`."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from potluck.cli.config import PeersFlags, takes
from potluck.cli.console import err
from potluck.cli.options import (
    CtxOpt,
    HeadMemOpt,
    JsonOpt,
    ModelOpt,
    ParallelOpt,
    SplitOpt,
    ThreadsOpt,
    _head_mem,
    _positive,
    _shares,
)
from potluck.cli.peers import _config_dir, _dialer, _mdns_on, _static_peers
from potluck.cli.runtime import _backends_check, compute_of, places


@takes
def plan(
    model: ModelOpt = None,
    ctx: CtxOpt = None,
    tensor_split: SplitOpt = None,
    mem: HeadMemOpt = None,
    parallel: ParallelOpt = 1,
    cache_ram: Annotated[
        int,
        typer.Option(
            "--cache-ram",
            min=0,
            help="MiB of KV for serve's or chat's prefix cache, planned beside -np's (they keep "
            "one full context's worth by default); 0: run's plan, none.",
        ),
    ] = 0,
    batch_plan: Annotated[
        bool,
        typer.Option(
            "--batch", help="Plan a batch job: replicas (data parallel) and items per hour."
        ),
    ] = False,
    item_tokens: Annotated[
        int, typer.Option("--item-tokens", min=1, help="--batch: tokens generated per item.")
    ] = 256,
    *,
    net: PeersFlags,
) -> None:
    """Dry run: who would get which layers, memory per node, predicted tok/s, and whether pooling
    beats the best single machine at all (--batch: the replicas of a batch job)."""
    from potluck.cli.run import model_line
    from potluck.modelfile.sources import resolve_model
    from potluck.planner import PLAN_COLUMNS, format_plan, format_summary
    from potluck.pool.planning import PlanInputs, plan_model, survey_model

    finder = net.finder()
    compute, here = compute_of(), places()
    path = resolve_model(model, here)
    found = net.found(finder)
    auth = net.auth() if found else None
    if batch_plan:
        from potluck.planner.replicas import REPLICA_COLUMNS, format_replicas, plan_replicas

        inputs = PlanInputs(
            path, ctx, auth, mem=_head_mem(mem), n_seq=parallel, compute=compute, cache=here.cache
        )
        nodes, links, fp = survey_model(inputs, found)
        rows, lines = format_replicas(plan_replicas(fp, nodes, links), item_tokens)
        table = Table(*REPLICA_COLUMNS, title=f"{path.name} · batch replicas · context {fp.n_ctx}")
        table.columns[0].no_wrap = True
        for row in rows:
            table.add_row(*row)
        Console().print(table)
        for line in lines:
            print(line)
        return
    from potluck.cli.load import cache_sequences
    from potluck.model.archs import hparams_from_metadata
    from potluck.modelfile.gguf_file import GGUFFile

    # serve's and chat's plan: -np sequences and the prefix cache's KV (as whole sequences)
    meta = GGUFFile(path).metadata
    cached = cache_sequences(hparams_from_metadata(meta), ctx, cache_ram) if cache_ram else 0
    n_seq = parallel + cached
    inputs = PlanInputs(
        path, ctx, auth, mem=_head_mem(mem), n_seq=n_seq, compute=compute, cache=here.cache
    )
    p = plan_model(inputs, found, _shares(tensor_split))
    seqs = f" × {parallel} sequences at once" if parallel > 1 else ""
    seqs += f" + {cached} cached" if cached else ""
    table = Table(*PLAN_COLUMNS, title=f"{path.name} · context {p.n_ctx}{seqs}")
    table.columns[0].no_wrap = True  # a node's address is what the user types: never cut it
    for row in format_plan(p):
        table.add_row(*row)
    Console().print(table)
    print(model_line(path))
    for line in format_summary(p):
        print(line)


@takes
def nodes(
    timeout: Annotated[
        float,
        typer.Option("--timeout", callback=_positive, help="Seconds to wait for each node."),
    ] = 3.0,
    as_json: JsonOpt = False,
    *,
    net: PeersFlags,
) -> None:
    """Every node seen (mDNS, --peer, the peers file): devices, free memory, round trip,
    bandwidth, version, and whether this head can use it (and if not, why)."""
    import json

    from potluck.discovery.mdns import Browser, DiscoveryError
    from potluck.discovery.nodes import (
        NODE_COLUMNS,
        format_row,
        inspect,
        local_report,
        report_json,
    )
    from potluck.discovery.static import MDNS, Peer, dedupe
    from potluck.node.probe import physical_cores, usable_memory_bytes

    static = _static_peers(net.peer, net.rpc)
    adverts = []
    if _mdns_on(net.no_mdns):
        try:  # every pool: a worker of another pool is listed, with the reason it is not used
            adverts = Browser(None, window_s=2.0).results()
        except DiscoveryError as exc:
            err.print(f"[yellow]mDNS unavailable:[/] {exc}; static peers only")
    peers = dedupe([*static, *(Peer(a.address, MDNS, a) for a in adverts)])
    dial = _dialer(net.secret, net.tls)
    threads = compute_of().n_threads  # what this machine computes with by default (-t)
    reports = [local_report(usable_memory_bytes(), physical_cores(), threads)]
    with err.status("measuring") as status:
        for p in peers:
            status.update(f"measuring {p.address}")
            reports.append(inspect(p, net.pool, dial, timeout))
    if as_json:
        print(json.dumps([report_json(r) for r in reports], indent=1))
    else:
        table = Table(*NODE_COLUMNS, title=f"pool {net.pool!r}")
        for r in reports:
            table.add_row(*format_row(r))
        Console(width=max(160, Console().width)).print(table)
    if not peers:
        err.print(
            "no workers found: start `potluck worker -H 0.0.0.0` on another machine (same --pool), "
            "or name one with --peer HOST:PORT"
        )


@takes
def doctor(
    model: Annotated[
        str | None, typer.Option("-m", "--model", help="Check that this model fits the pool.")
    ] = None,
    ctx: CtxOpt = None,
    threads: ThreadsOpt = None,
    load_seconds: Annotated[
        float,
        typer.Option(
            "--load-seconds",
            help="Load every node this long to catch thermal throttling (0: skip).",
        ),
    ] = 60.0,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            callback=_positive,
            help="Seconds to wait for a connection / an answer.",
        ),
    ] = 3.0,
    as_json: JsonOpt = False,
    *,
    net: PeersFlags,
) -> None:
    """Check the pool for what users trip over and say what to do: ports, firewalls, versions,
    the pool secret, memory for the model and its context, threads, slow links, throttling."""
    import dataclasses
    import json

    import psutil

    from potluck.discovery.doctor import FAIL, DoctorConfig, run_doctor
    from potluck.modelfile.sources import resolve_model
    from potluck.node.doctor import load_samples
    from potluck.node.probe import physical_cores
    from potluck.pool.survey import this_machine

    finder = net.finder()
    found = finder.find(lambda peer: "")  # check even those that do not answer
    if finder.error:
        err.print(f"[yellow]mDNS unavailable:[/] {finder.error}; static peers only")
    compute = compute_of(threads)
    cfg = DoctorConfig(
        pool=net.pool,
        threads=threads,
        model=resolve_model(model, places()) if model else None,
        ctx=ctx,
        connect_timeout_s=timeout,
        call_timeout_s=max(timeout, 5.0),
        load_seconds=load_seconds,
    )

    def local_load(seconds: float, interval: float) -> list[tuple[float, float]]:
        return list(load_samples(seconds, interval, compute.n_threads))

    cores = (physical_cores(), psutil.cpu_count(logical=True) or physical_cores())
    with err.status("checking") as status:
        checks = run_doctor(
            list(found.peers) + [p for p, _ in found.skipped], cfg, _dialer(net.secret, net.tls),
            lambda: this_machine(compute=compute), cores,
            local_load, on_progress=status.update, backends=_backends_check(),
        )  # fmt: skip
    if as_json:
        print(json.dumps([dataclasses.asdict(c) for c in checks], indent=1))
    else:
        style = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}
        table = Table("check", "node", "result", "what was found", "what to do", title="doctor")
        for c in checks:
            table.add_row(
                c.check, c.node, f"[{style[c.status]}]{c.status}[/]", c.detail, c.advice or "-"
            )
        Console(width=max(160, Console().width)).print(table)
    if not found.peers and not found.skipped:
        err.print(
            "no workers to check: add --peer HOST:PORT, or start `potluck worker` (same --pool)"
        )
    failed = sum(c.status == FAIL for c in checks)
    if failed:
        err.print(f"[bold red]{failed} check(s) failed[/]")
        raise typer.Exit(1)


def secret_command(
    save: Annotated[
        bool,
        typer.Option(
            "--save", help="Also keep it in the config folder (mode 0600), where potluck finds it."
        ),
    ] = False,
    set_: Annotated[
        str | None,
        typer.Option(
            "--set",
            help="Keep this secret (the pool's, from another machine) instead of a new one; "
            "'-' reads it from stdin, out of the shell's history.",
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace a kept secret.")] = False,
) -> None:
    """Make a new pool secret and print it; every machine of a pool needs the same one."""
    from potluck.transport.secret import SECRET_FILE, check_secret, new_secret, save_secret

    path = _config_dir() / SECRET_FILE
    if set_ is not None:
        value = check_secret(sys.stdin.readline() if set_ == "-" else set_, "--set")
        save_secret(path, value, replace=force)
        err.print(f"kept in {path} (mode 0600); potluck on this machine now uses it")
        return
    value = new_secret()
    if save:
        save_secret(path, value, replace=force)
        err.print(
            f"kept in {path} (mode 0600). On every other machine of the pool run "
            "`potluck secret --set -` and paste it"
        )
    print(value)
