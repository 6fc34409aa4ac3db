"""The composition root: reads argv and the environment, builds the objects, wires them.

Flags keep llama.cpp's meaning: -m model, -n tokens to generate, -c context, -t threads, -b batch.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from potluck import __version__
from potluck.errors import PotluckError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Potluck: pool the computers you already own to run one local LLM.",
    context_settings={"help_option_names": ["-h", "--help"]},
)
err = Console(stderr=True, highlight=False)

ModelOpt = Annotated[
    str | None,
    typer.Option(
        "-m",
        "--model",
        help="GGUF path or a model name from `potluck models` (default: SmolLM2-135M-Instruct).",
    ),
]
CtxOpt = Annotated[
    int | None,
    typer.Option(
        "-c", "--ctx-size", help="Context length in tokens (default: min(model's, 4096))."
    ),
]
ThreadsOpt = Annotated[
    int | None, typer.Option("-t", "--threads", help="CPU threads (default: physical cores).")
]
BatchOpt = Annotated[
    int, typer.Option("-b", "--batch-size", help="Prompt tokens per forward pass.")
]


def _physical_cores() -> int:
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def _setup_threads(threads: int | None) -> None:
    import torch

    torch.set_num_threads(threads or _physical_cores())


PeerOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--peer", help="A worker's host:port (repeatable); this machine takes the first layers."
    ),
]
RpcOpt = Annotated[
    str | None,
    typer.Option("--rpc", help="Workers as llama.cpp users type them: host:port,host:port."),
]
SplitOpt = Annotated[
    str | None,
    typer.Option(
        "--tensor-split", "-ts", help="Share of the layers per node, this machine first, e.g. 6,4."
    ),
]


def _peers(peer: list[str] | None, rpc: str | None) -> list[str]:
    peers = list(peer or []) + [p.strip() for p in (rpc or "").split(",") if p.strip()]
    for p in peers:
        host, _, port = p.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise typer.BadParameter(f"peer {p!r} is not host:port (e.g. 192.168.1.20:50052)")
    return peers


def _shares(text: str | None) -> list[float]:
    try:
        return [float(x) for x in text.split(",")] if text else []
    except ValueError:
        raise typer.BadParameter(
            f"--tensor-split {text!r} is not a list of numbers like 6,4"
        ) from None


def _load(
    model: str | None,
    ctx: int | None,
    threads: int | None,
    splits: list[int] | None = None,
    peers: list[str] | None = None,
    shares: list[float] | None = None,
):
    """Resolve, load with a progress bar, and print the one-line summary (and the pool's plan)."""
    from potluck.engine.generate import load_model
    from potluck.modelfile.sources import resolve_model

    _setup_threads(threads)
    path = resolve_model(model)
    t0 = time.perf_counter()
    with Progress(
        TextColumn("[bold]loading[/] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as bar:
        task = bar.add_task(path.name, total=None)

        def on_layer(i: int) -> None:
            bar.update(task, completed=i + 1)

        from potluck.modelfile.gguf_file import GGUFFile
        from potluck.modelfile.hparams import hparams_from_metadata

        bar.update(task, total=hparams_from_metadata(GGUFFile(path).metadata, str(path)).n_layer)
        assignments = []
        if peers:
            bar.update(task, description=f"{path.name} (asking {len(peers)} peers, planning)")
            plan = _plan(path, ctx, peers, shares)
            from potluck.engine.survey import assignments_of

            assignments = assignments_of(plan)
            err.print(f"[dim]{plan.verdict}[/]")
        m = load_model(path, ctx, splits or (), on_layer, assignments=assignments)
    err.print(f"[dim]{m.summary()} · loaded in {time.perf_counter() - t0:.1f} s[/]")
    for a in getattr(m.pipeline, "assignments", []):
        err.print(f"[dim]  {a.describe()}[/]")
    return m


def _sampling(
    temp: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float, seed: int | None
):
    from potluck.engine.sampling import SamplingParams

    try:
        return SamplingParams(
            temperature=temp,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
            seed=seed,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _plan(path: Path, ctx: int | None, peers: list[str], shares: list[float] | None):
    """Survey the peers, then run the planner for this model and context."""
    from potluck.engine.generate import DEFAULT_CTX
    from potluck.engine.survey import survey
    from potluck.modelfile.gguf_file import GGUFFile
    from potluck.modelfile.hparams import hparams_from_metadata
    from potluck.planner import footprint_from_gguf, plan_pool

    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata, str(path))
    n_ctx = ctx or min(hp.n_ctx_train, DEFAULT_CTX)
    nodes, links = survey(peers)
    from potluck.kernels.qlinear import held_bytes

    fp = footprint_from_gguf(f.tensors, hp, n_ctx, held=held_bytes)
    return plan_pool(fp, nodes, links, shares or None)


TempOpt = Annotated[float, typer.Option("--temp", help="Temperature; 0 = greedy.")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens (0 = all).")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass.")]
MinPOpt = Annotated[
    float, typer.Option("--min-p", help="Drop tokens below min-p × the top probability.")
]
RepeatOpt = Annotated[
    float, typer.Option("--repeat-penalty", help="Penalty on recent tokens (1.0 = off).")
]
SeedOpt = Annotated[
    int | None, typer.Option("-s", "--seed", help="Random seed for reproducible sampling.")
]


def _stream(m, ids: list[int], n: int, sampler, n_batch: int) -> list[int]:
    """Generate and print text as it comes; timing on stderr. Returns the generated ids."""
    from potluck.engine.generate import generate
    from potluck.modelfile.tokenizer import StreamDecoder

    dec = StreamDecoder(m.tokenizer)
    out: list[int] = []
    t0 = time.perf_counter()
    t_first = None
    for tok in generate(m, ids, n, sampler, n_batch=n_batch):
        if t_first is None:
            t_first = time.perf_counter()
        out.append(tok)
        if tok in m.tokenizer.eot_ids:
            break
        sys.stdout.write(dec.push(tok))
        sys.stdout.flush()
    sys.stdout.write(dec.flush() + "\n")
    t1 = time.perf_counter()
    if t_first is not None:
        gen_n = max(len(out) - 1, 0)
        rate = f"{gen_n / (t1 - t_first):.1f} tok/s" if gen_n and t1 > t_first else "-"
        err.print(
            f"[dim]prompt {len(ids)} tokens in {t_first - t0:.2f} s ({len(ids) / (t_first - t0):.1f} tok/s) · "
            f"generated {len(out)} tokens, {rate}[/]"
        )
    return out


@app.command()
def run(
    prompt: Annotated[str, typer.Argument(help="The prompt.")],
    model: ModelOpt = None,
    n_predict: Annotated[
        int, typer.Option("-n", "--n-predict", help="Tokens to generate at most.")
    ] = 128,
    ctx: CtxOpt = None,
    threads: ThreadsOpt = None,
    batch: BatchOpt = 512,
    temp: TempOpt = 0.8,
    top_k: TopKOpt = 40,
    top_p: TopPOpt = 0.95,
    min_p: MinPOpt = 0.05,
    repeat_penalty: RepeatOpt = 1.0,
    seed: SeedOpt = None,
    raw: Annotated[
        bool,
        typer.Option("--raw", help="Feed the prompt as plain text, without the chat template."),
    ] = False,
    system: Annotated[
        str | None, typer.Option("--system", help="System prompt (chat mode).")
    ] = None,
    split: Annotated[
        str | None,
        typer.Option(
            "--split",
            help="Run as in-process stages split at these layers, e.g. 10,20 (checks the pipeline).",
        ),
    ] = None,
    peer: PeerOpt = None,
    rpc: RpcOpt = None,
    tensor_split: SplitOpt = None,
) -> None:
    """Generate text from a prompt, streaming it to stdout (over a pool with --peer)."""
    from potluck.engine.sampling import Sampler

    params = _sampling(temp, top_k, top_p, min_p, repeat_penalty, seed)
    splits = [int(s) for s in split.split(",")] if split else None
    m = _load(model, ctx, threads, splits, _peers(peer, rpc), _shares(tensor_split))
    if raw:
        ids = m.tokenizer.encode(prompt)
    else:
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        ids = m.tokenizer.encode(m.chat.render(msgs))
    _stream(m, ids, n_predict, Sampler(params), batch)


@app.command()
def chat(
    model: ModelOpt = None,
    n_predict: Annotated[
        int, typer.Option("-n", "--n-predict", help="Tokens per answer at most.")
    ] = 512,
    ctx: CtxOpt = None,
    threads: ThreadsOpt = None,
    batch: BatchOpt = 512,
    temp: TempOpt = 0.8,
    top_k: TopKOpt = 40,
    top_p: TopPOpt = 0.95,
    min_p: MinPOpt = 0.05,
    repeat_penalty: RepeatOpt = 1.0,
    seed: SeedOpt = None,
    system: Annotated[str | None, typer.Option("--system", help="System prompt.")] = None,
    peer: PeerOpt = None,
    rpc: RpcOpt = None,
    tensor_split: SplitOpt = None,
) -> None:
    """Chat interactively with the model's chat template. Ctrl-D or /exit to leave."""
    from potluck.engine.sampling import Sampler

    params = _sampling(temp, top_k, top_p, min_p, repeat_penalty, seed)
    m = _load(model, ctx, threads, None, _peers(peer, rpc), _shares(tensor_split))
    sampler = Sampler(params)
    msgs: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    err.print("[dim]type a message; /exit or Ctrl-D to quit, /reset to start over[/]")
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            sys.stdout.write("\n")
            return
        if line.strip() == "/exit":
            return
        if line.strip() == "/reset":
            msgs = msgs[:1] if system else []
            continue
        if not line.strip():
            continue
        msgs.append({"role": "user", "content": line})
        ids = m.tokenizer.encode(m.chat.render(msgs))
        try:
            out = _stream(m, ids, n_predict, sampler, batch)
        except PotluckError as exc:  # e.g. the conversation outgrew the context: say so, keep going
            err.print(f"[red]error:[/] {exc}")
            msgs.pop()
            continue
        reply = m.tokenizer.decode([t for t in out if t not in m.tokenizer.eot_ids])
        msgs.append({"role": "assistant", "content": reply})


@app.command()
def perplexity(
    file: Annotated[
        Path, typer.Option("-f", "--file", help="Text file to score.", exists=True, dir_okay=False)
    ],
    model: ModelOpt = None,
    ctx: Annotated[int, typer.Option("-c", "--ctx-size", help="Chunk length in tokens.")] = 256,
    threads: ThreadsOpt = None,
    batch: BatchOpt = 512,
) -> None:
    """Perplexity over a text file, computed as llama-perplexity does (second half of each chunk)."""
    from potluck.engine.perplexity import perplexity as compute

    m = _load(model, ctx, threads)
    text = file.read_text(encoding="utf-8", errors="replace")

    def on_chunk(i: int, n: int, ppl: float) -> None:
        err.print(f"[dim][{i}/{n}] running ppl {ppl:.4f}[/]")

    res = compute(m, text, ctx, batch, on_chunk)
    print(
        f"perplexity: {res.ppl:.4f} over {res.n_chunks} chunks of {ctx} tokens ({res.n_scored} tokens scored)"
    )


@app.command()
def models() -> None:
    """List the GGUF models found in Potluck's cache and the Ollama, LM Studio and HF caches."""
    from potluck.modelfile.sources import find_models, search_roots

    found = find_models()
    if not found:
        roots = ", ".join(str(r) for r, _ in search_roots())
        err.print(
            f"no models found in {roots}; `potluck run` fetches the default model on first use"
        )
        return
    table = Table("name", "source", "size", "path")
    for f in found:
        table.add_row(f.name, f.source, f"{f.size_bytes / 2**20:.1f} MiB", str(f.path))
    Console().print(table)


@app.command()
def plan(
    model: ModelOpt = None,
    peer: PeerOpt = None,
    rpc: RpcOpt = None,
    ctx: CtxOpt = None,
    tensor_split: SplitOpt = None,
) -> None:
    """Dry run: who would get which layers, memory per node, predicted tok/s, and whether pooling
    beats the best single machine at all."""
    from potluck.modelfile.sources import resolve_model
    from potluck.planner import PLAN_COLUMNS, format_plan, format_summary

    _setup_threads(None)
    path = resolve_model(model)
    p = _plan(path, ctx, _peers(peer, rpc), _shares(tensor_split))
    table = Table(*PLAN_COLUMNS, title=f"{path.name} · context {p.n_ctx}")
    for row in format_plan(p):
        table.add_row(*row)
    Console().print(table)
    for line in format_summary(p):
        print(line)


@app.command()
def worker(
    host: Annotated[str, typer.Option("-H", "--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("-p", "--port", help="Port to listen on.")] = 50052,
    threads: ThreadsOpt = None,
    model_dir: Annotated[
        list[Path] | None,
        typer.Option("--model-dir", help="Extra folder with GGUF files this machine already has."),
    ] = None,
    insecure: Annotated[
        bool, typer.Option("--insecure", help="Allow a non-loopback address without a pool secret.")
    ] = False,
) -> None:
    """Serve layers to a pool: wait for a head (`potluck run --peer THIS_HOST:PORT`)."""
    import ipaddress
    import socket

    from potluck.node.worker import serve

    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        loopback = False
    if not loopback and not insecure:
        raise PotluckError(
            f"refusing to listen on {host}: pool secrets are not implemented yet, so anyone on the "
            "network could use this worker; pass --insecure to accept that on a trusted network"
        )
    _setup_threads(threads)
    server, bound = serve(
        host, port, threads=threads or _physical_cores(), model_dirs=tuple(model_dir or ())
    )
    err.print(
        f"potluck worker {__version__} listening on {host}:{bound} · {_physical_cores()} cores · Ctrl-C to stop"
    )
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        server.stop(grace=1.0)


@app.command()
def serve(
    model: ModelOpt = None,
    ctx: CtxOpt = None,
    threads: ThreadsOpt = None,
    batch: BatchOpt = 512,
    peer: PeerOpt = None,
    rpc: RpcOpt = None,
    tensor_split: SplitOpt = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on (0: any free one).")] = 8080,
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
    parallel: Annotated[
        int, typer.Option("-np", "--parallel", help="Requests generating at once.")
    ] = 16,
) -> None:
    """Serve the model (over a pool with --peer) as an OpenAI-compatible API with a web page."""
    from potluck.api.server import ServerConfig, create_app, is_loopback, model_id_of
    from potluck.api.server import serve as run_server
    from potluck.engine.scheduler import Scheduler, SchedulerConfig

    key = api_key or os.environ.get("POTLUCK_API_KEY") or None
    if not is_loopback(host) and key is None and not no_api_key:
        raise PotluckError(
            f"refusing to listen on {host} without an API key: anyone on the network could use "
            "the model; pass --api-key KEY (or set POTLUCK_API_KEY), or --no-api-key to accept that"
        )
    try:
        sched_config = SchedulerConfig(n_batch=batch, max_queue=max_queue, max_active=parallel)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    m = _load(model, ctx, threads, None, _peers(peer, rpc), _shares(tensor_split))
    scheduler = Scheduler(m, sched_config)
    app_ = create_app(m, scheduler, ServerConfig(model_id=model_id_of(m), api_key=key))

    def on_listen(url: str) -> None:
        auth = "API key required" if key else "no API key"
        err.print(
            f"potluck serve {__version__} listening on {url} · model {model_id_of(m)} · {auth} · "
            "Ctrl-C to stop",
            soft_wrap=True,
        )

    try:
        run_server(app_, host, port, on_listen)
    finally:
        scheduler.close()


@app.command()
def version() -> None:
    """Print Potluck's version."""
    print(__version__)


def main() -> None:
    try:
        app()
    except PotluckError as exc:
        err.print(f"[bold red]error:[/] {exc}")
        sys.exit(1)


if __name__ == "__main__":
    main()
