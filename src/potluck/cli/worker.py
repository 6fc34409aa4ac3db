"""`potluck worker`: serve layers to the pool's heads."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from potluck import __version__
from potluck.cli.console import err
from potluck.cli.options import (
    DEFAULT_POOL,
    CacheTypeOpt,
    CpuMoeOpt,
    DeviceOpt,
    NCpuMoeOpt,
    NglOpt,
    NoMdnsOpt,
    NoRepackOpt,
    PoolOpt,
    SecretOpt,
    ThreadsOpt,
    TlsOpt,
    _port,
    _size,
    cpu_moe_layers,
)
from potluck.cli.peers import _announce, _auth, _secret
from potluck.cli.runtime import _backends, compute_of, places
from potluck.errors import PotluckError
from potluck.hosts import is_loopback


def worker(
    host: Annotated[str, typer.Option("-H", "--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[
        int,
        typer.Option("-p", "--port", callback=_port, help="Port to listen on (0: any free one)."),
    ] = 50052,
    threads: ThreadsOpt = None,
    model_dir: Annotated[
        list[Path] | None,
        typer.Option("--model-dir", help="Extra folder with GGUF files this machine already has."),
    ] = None,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="Listen on a network address WITHOUT a pool secret: anyone who can reach the "
            "port can use this machine. Only for a network you trust.",
        ),
    ] = False,
    pool: PoolOpt = DEFAULT_POOL,
    no_mdns: NoMdnsOpt = False,
    secret: SecretOpt = None,
    tls: TlsOpt = False,
    mem: Annotated[
        str | None,
        typer.Option(
            "--mem",
            help="Most memory this worker offers the pool, e.g. 4G or 512M (default: what is free, less 1 GiB).",
        ),
    ] = None,
    vram: Annotated[
        str | None,
        typer.Option(
            "--vram", help="Most GPU memory this worker offers, e.g. 6G (default: what is free)."
        ),
    ] = None,
    ngl: NglOpt = 0,
    cpu_moe: CpuMoeOpt = False,
    n_cpu_moe: NCpuMoeOpt = 0,
    device: DeviceOpt = None,
    cache_type: CacheTypeOpt = "f16",
    no_repack: NoRepackOpt = False,
    idle_timeout: Annotated[
        float,
        typer.Option(
            "--idle-timeout", help="Free a plan's layers after this many seconds without its head."
        ),
    ] = 120.0,
    data_port: Annotated[
        int | None,
        typer.Option(
            "--data-port",
            callback=_port,
            help="TCP port for hidden states (the fast lane next to gRPC; default: port + 1, or "
            "any free port if that is taken). Open it in the firewall too.",
        ),
    ] = None,
    no_data_port: Annotated[
        bool,
        typer.Option(
            "--no-data-port",
            help="Send hidden states over the gRPC port only (slower).",
        ),
    ] = False,
    spin_ms: Annotated[
        float,
        typer.Option(
            "--spin-ms",
            help="Poll for the next hidden states this long (ms) before sleeping: the core stays "
            "awake between tokens (faster, as llama.cpp's --poll); 0 = sleep at once.",
        ),
    ] = 20.0,
) -> None:
    """Serve layers to a pool: wait for a head (`potluck run --peer THIS_HOST:PORT`)."""
    import logging

    from potluck.node.weights import LocalModels
    from potluck.node.worker import serve

    # the worker's own events (weights received, plans freed) as plain lines on stderr
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("grpc").setLevel(logging.WARNING)

    if idle_timeout <= 0:
        raise typer.BadParameter(f"--idle-timeout must be positive, got {idle_timeout}")
    if not 0 <= spin_ms <= 1000:
        raise typer.BadParameter(f"--spin-ms must be in [0, 1000], got {spin_ms:g}")
    mem_limit = _size(mem, "--mem") if mem else None
    vram_limit = _size(vram, "--vram") if vram else None
    compute = compute_of(
        threads, cache_type, no_repack, ngl, device, vram_limit,
        cpu_moe_layers(cpu_moe, n_cpu_moe),
    )  # fmt: skip

    value, source = _secret(secret)
    if value is None and not is_loopback(host) and not insecure:
        raise PotluckError(
            f"refusing to listen on {host} without a pool secret: anyone who can reach port "
            f"{port} could use this machine and see what it computes; make one with `potluck "
            "secret --save` and give every machine of the pool the same one (`potluck secret "
            "--set -`), or pass --secret / POTLUCK_SECRET (--insecure accepts the risk on a "
            "network you trust)"
        )
    auth = _auth(secret, tls, worker=True)
    server, bound = serve(
        host, port, settings=compute, models=LocalModels(places(), tuple(model_dir or ())),
        auth=auth, mem_limit=mem_limit, idle_s=idle_timeout,
        data_port=None if no_data_port else (-1 if data_port is None else data_port),
        spin_s=spin_ms / 1000,
    )  # fmt: skip
    advertiser = _announce(host, bound, pool, no_mdns)
    guard = f"pool secret from {source}" if value else "no pool secret"
    if auth.identity is not None:
        guard += f" · TLS, certificate sha256 {auth.identity.sha256.hex()[:16]}…"
    if value is None and not is_loopback(host):
        err.print(
            f"[bold yellow]warning:[/] no pool secret: anyone who can reach {host}:{bound} can use this machine"
        )
    lanes = f"data port {server.data_port}" if server.data_port else "no data port"
    err.print(
        f"potluck worker {__version__} listening on {host}:{bound} · {lanes} · "
        f"{compute.n_threads} threads · {guard} · Ctrl-C to stop"
    )
    err.print(f"[dim]{_backends()}[/]")
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        server.stop(grace=1.0)
    finally:
        if advertiser is not None:
            advertiser.close()  # goodbye packets: heads drop this worker at once
