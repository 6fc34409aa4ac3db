"""The composition root: reads argv and the environment, builds the objects, wires them.

One module per concern: `options` (the shared flags and their checks), `runtime` (threads,
cache, GPU), `peers` (config folder, pool secret, static peers, mDNS), `load` (a model, over the pool
when there is one), and the commands: `run` (run, chat, perplexity, models), `pool` (plan,
nodes, doctor, secret), `worker`, `batch`, `finetune`, `serve`, `bench`. This file makes the
typer app, registers the commands in the order `potluck --help` lists them, and holds `main`.
"""

from __future__ import annotations

import contextlib
import os
import sys

import typer

from potluck import __version__
from potluck.cli import batch, bench, finetune, pool, run, serve, worker
from potluck.cli.console import err
from potluck.cli.options import _failover
from potluck.errors import PotluckError

__all__ = ["_failover", "app", "main"]  # _failover: tests check the CLI's --failover-timeout 0

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Potluck: pool the computers you already own to run one local LLM.",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def version() -> None:
    """Print Potluck's version."""
    print(__version__)


# the order `potluck --help` lists them in
app.command()(run.run)
app.command()(run.chat)
app.command()(run.perplexity)
app.command()(run.models)
app.command()(pool.plan)
app.command()(pool.nodes)
app.command()(pool.doctor)
app.command()(worker.worker)
app.command()(batch.batch)
app.command()(finetune.finetune)
app.command()(serve.serve)
app.command("secret")(pool.secret_command)
app.command()(bench.bench)
app.command()(version)


def main() -> None:
    code: int = 0
    try:
        from potluck.model.ggml_lib import toolkit_dll_folders, use_library

        toolkit_dll_folders(os.environ)  # Windows: where a GPU build's runtime DLLs are
        if where := os.environ.get("POTLUCK_GGML"):  # another build of ggml (model/ggml_lib.py)
            use_library(where)
        app()
    except PotluckError as exc:
        err.print(f"[bold red]error:[/] {exc}")
        code = 1
    except SystemExit as exc:  # typer ends every command this way
        if isinstance(exc.code, str):
            err.print(exc.code)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    # The pools this command used free their stages on the workers now (os._exit skips atexit):
    # a head that is done must not hold a worker's memory until its idle timeout.
    if (failover := sys.modules.get("potluck.pool.failover")) is not None:
        with contextlib.suppress(Exception):  # best effort: the command's work is done
            failover._close_live()
    # Workaround: end the process without interpreter teardown. gRPC's C++ core aborts
    # ("terminate called without an active exception", SIGABRT) when Python finalizes while its
    # background threads (stream readers, heartbeats of a pool that failed over) still exist;
    # a command that has finished has nothing left to clean up but its output.
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
