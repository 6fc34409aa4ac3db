"""The composition root: reads argv and the environment, builds the objects, wires them.

Flags keep llama.cpp's meaning: -m model, -n tokens to generate, -c context, -t threads, -b batch.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from potluck import __version__
from potluck.errors import PotluckError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Potluck: pool the computers you already own to run one local LLM.",
    context_settings={"help_option_names": ["-h", "--help"]},
)
err = Console(stderr=True, highlight=False, soft_wrap=True)  # one-line messages stay one line

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


def _at_least(low: float, special: tuple[int, str] | None = None):
    """An option callback: the value (None: not given) must be ≥ low, or special[0], which means
    special[1]; else a one-line usage error with the flag and the number."""

    def check(param: typer.CallbackParam, value: float | None) -> float | None:
        if value is not None and value < low and (special is None or value != special[0]):
            flag = min(param.opts, key=len)
            note = f" (or {special[0]} = {special[1]})" if special else ""
            raise typer.BadParameter(f"{flag} must be ≥ {low:g}{note}, got {value:g}")
        return value

    return check


def _positive(param: typer.CallbackParam, value: float | None) -> float | None:
    """An option callback: a number of seconds that must be more than 0."""
    if value is not None and not value > 0:
        raise typer.BadParameter(f"{min(param.opts, key=len)} must be > 0, got {value:g}")
    return value


def _port(param: typer.CallbackParam, value: int | None) -> int | None:
    """An option callback for a port to listen on: 0 (any free one) to 65535."""
    if value is not None and not 0 <= value <= 65535:
        raise typer.BadParameter(f"port must be 1-65535 (or 0: any free one), got {value}")
    return value


NglOpt = Annotated[
    int,
    typer.Option(
        "-ngl",
        "--n-gpu-layers",
        min=0,
        help="This machine's last N layers on its GPU, the rest on its CPU (llama.cpp's -ngl; "
        "more than its layers puts the output head there too).",
    ),
]
LoraOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--lora",
        help="A LoRA adapter to apply (a GGUF in llama.cpp's format), as FILE or FILE:SCALE "
        "(default scale 1); repeatable.",
    ),
]
NoRepackOpt = Annotated[
    bool,
    typer.Option(
        "--no-repack",
        help="Keep every weight mapped in place (shared page cache; slower matmuls), as "
        "llama.cpp's --repack 0.",
    ),
]
CacheTypeOpt = Annotated[
    str,
    typer.Option(
        "--cache-type",
        "-ctk",
        help="KV cache element type: f16 (default, as llama.cpp) or f32 (exactness checks).",
    ),
]
DeviceOpt = Annotated[
    str | None,
    typer.Option(
        "--device", help="The GPU for -ngl, by ggml's name (Vulkan0, CUDA0, …; default the first)."
    ),
]


def _setup_cache(cache_type: str, no_repack: bool = False) -> None:
    from potluck.model.stage import set_cache_type, set_repack

    set_repack(not no_repack)
    try:
        set_cache_type(cache_type)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _setup_gpu(n_gpu_layers: int, device: str | None, vram: int | None = None) -> None:
    """Stages built in this process put their last n_gpu_layers layers on `device` (at most
    `vram` bytes there); checked now, so that a machine without that GPU says so before any
    load. POTLUCK_GPU_BYTES_PER_S gives the GPU's speed instead of measuring it: for tests on a
    software GPU (Mesa's lavapipe), whose speed is not a GPU's."""
    from potluck.model.stage import GpuConfig, set_gpu

    if device is not None and device.lower() == "cpu":
        n_gpu_layers, device = 0, None
    if n_gpu_layers:
        from potluck.model.ggml_lib import gpu_device

        gpu_device(device)  # BackendError (one line) when this machine's ggml has no such GPU
    elif device is not None:
        raise typer.BadParameter(f"--device {device} needs -ngl N (how many layers go there)")
    speed = os.environ.get("POTLUCK_GPU_BYTES_PER_S")
    set_gpu(GpuConfig(n_gpu_layers, device, vram, float(speed) if speed else None))


ThreadsOpt = Annotated[
    int | None,
    typer.Option(
        "-t",
        "--threads",
        callback=_at_least(1, (0, "all physical cores")),
        help="CPU threads (default, or 0: physical cores).",
    ),
]
BatchOpt = Annotated[
    int,
    typer.Option(
        "-b", "--batch-size", callback=_at_least(1), help="Prompt tokens per forward pass."
    ),
]
PromptBatchOpt = Annotated[
    int | None,
    typer.Option(
        "-b",
        "--batch-size",
        callback=_at_least(1),
        help="Prompt tokens per forward pass (default: 512 on one machine; 128 over a pool, so "
        "that the machines work on a prompt at once).",
    ),
]
PredictCheck = _at_least(0, (-1, "until the end of text or a full context"))


def _physical_cores() -> int:
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def _setup_threads(threads: int | None) -> None:
    from potluck.model.stage import set_threads

    set_threads(threads or _physical_cores())


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
WIRE_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


def _wire_dtype(value: str) -> str:
    if value not in WIRE_DTYPES:
        raise typer.BadParameter(f"give one of {', '.join(WIRE_DTYPES)}, got {value!r}")
    return value


WireOpt = Annotated[
    str,
    typer.Option(
        "--wire-dtype",
        callback=_wire_dtype,
        help="Hidden states between machines: f32 (exact: the pool's output equals one machine's), "
        "f16 or bf16 (half the bytes, for slow links; outputs may differ slightly).",
    ),
]
FailoverOpt = Annotated[
    float,
    typer.Option(
        "--failover-timeout",
        help="Seconds a pool node may stay silent before the head drops it and re-plans on the rest (0 = off: a node silent for 30 s then ends the request).",
    ),
]
SplitOpt = Annotated[
    str | None,
    typer.Option(
        "--tensor-split", "-ts", help="Share of the layers per node, this machine first, e.g. 6,4."
    ),
]


def _pool_name(name: str) -> str:
    from potluck.discovery.mdns import DiscoveryError, check_pool_name

    try:
        return check_pool_name(name)
    except DiscoveryError as exc:
        raise typer.BadParameter(str(exc)) from None


PoolOpt = Annotated[
    str,
    typer.Option(
        "--pool",
        envvar="POTLUCK_POOL",
        callback=_pool_name,
        help="Pool name: a head uses only the workers that announce the same one on mDNS.",
    ),
]
NoMdnsOpt = Annotated[
    bool,
    typer.Option(
        "--no-mdns", help="No mDNS (announcing or browsing): static peers only. Env POTLUCK_MDNS=0."
    ),
]
DEFAULT_POOL = "home"


def _config_dir() -> Path:
    """POTLUCK_CONFIG, else $XDG_CONFIG_HOME/potluck, else ~/.config/potluck (the peers file)."""
    if env := os.environ.get("POTLUCK_CONFIG"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "potluck"


def _mdns_on(no_mdns: bool) -> bool:
    return not no_mdns and os.environ.get("POTLUCK_MDNS", "1").lower() not in ("0", "off", "no")


def _static_peers(peer: list[str] | None, rpc: str | None):
    """--peer / --rpc as typed, then the peers file in the config folder."""
    from potluck.discovery.static import (
        PEERS_FILE,
        PeerAddressError,
        dedupe,
        peers_from_flags,
        read_peers_file,
    )

    try:
        flags = peers_from_flags(peer, rpc)
    except PeerAddressError as exc:
        raise typer.BadParameter(f"peer {exc}") from None
    return dedupe(flags + read_peers_file(_config_dir() / PEERS_FILE))


def _peers(peer: list[str] | None, rpc: str | None, pool: str = DEFAULT_POOL, no_mdns: bool = True):
    """The static peers and, unless no_mdns, an mDNS browse for workers of `pool` that starts now
    (it overlaps loading the model); `_found` ends it."""
    from potluck.discovery.mdns import DEFAULT_BROWSE_S
    from potluck.discovery.pool import PeerFinder

    browse_s = DEFAULT_BROWSE_S if _mdns_on(no_mdns) else None
    return PeerFinder(_static_peers(peer, rpc), pool, browse_s)


def _found(finder, auth_of=None) -> list[str]:
    """End the browse; say which nodes were found and how, and which were left out and why.
    auth_of() gives the pool credentials: announced workers that refuse them are left out."""
    from potluck.discovery.pool import describe_peer, member, reachable
    from potluck.transport.client import NodeClient

    browsing = finder.browsing
    vet = member(lambda a: NodeClient(a, auth_of())) if auth_of is not None else reachable
    found = finder.find(vet)
    if finder.error:
        err.print(f"[yellow]mDNS unavailable:[/] {finder.error}; using static peers only")
    how = f"mDNS {finder.browse_s:g} s" if browsing else "mDNS off"
    if found.peers:
        used = ", ".join(describe_peer(p) for p in found.peers)
        err.print(f"[dim]pool {finder.pool!r} ({how}): {used}[/]")
    elif browsing:
        err.print(f"[dim]pool {finder.pool!r} ({how}): no workers found, this machine alone[/]")
    for p, why in found.skipped:  # one of your peers file's machines is worth a yellow line
        style = "dim" if p.source == "mDNS" else "yellow"
        err.print(f"[{style}]  left out {describe_peer(p)}: {why}[/]")
    return [p.address for p in found.peers]


SecretOpt = Annotated[
    str | None,
    typer.Option(
        "--secret",
        help="The pool secret (default: $POTLUCK_SECRET, else the file `potluck secret --save` "
        "writes). A flag shows in `ps`: prefer the variable or the file.",
    ),
]
TlsOpt = Annotated[
    bool,
    typer.Option("--tls", help="Encrypt the pool's traffic (every machine of the pool needs it)."),
]
HeadMemOpt = Annotated[
    str | None,
    typer.Option(
        "--mem",
        help="Most memory this machine offers for layers over a pool, e.g. 4G; 0 = hold no "
        "layers, only coordinate the workers (default: what is free, less 1 GiB).",
    ),
]


def _head_mem(text: str | None) -> int | None:
    """The head's --mem in bytes (0 allowed: no layers here); None: what is free."""
    return None if text is None else _size(text, "--mem", allow_zero=True)


def _secret(secret: str | None) -> tuple[str | None, str]:
    """The pool secret and where it came from: --secret, else POTLUCK_SECRET, else the file."""
    from potluck.transport.secret import SECRET_FILE, check_secret, read_secret_file

    if secret is not None:
        return check_secret(secret, "--secret"), "--secret"
    if env := os.environ.get("POTLUCK_SECRET"):
        return check_secret(env, "POTLUCK_SECRET"), "POTLUCK_SECRET"
    path = _config_dir() / SECRET_FILE
    found = read_secret_file(path)
    return found, (str(path) if found else "none")


def _auth(secret: str | None, tls: bool, worker: bool = False):
    """How this process proves pool membership (transport/auth.py); a worker with --tls also gets
    its certificate, made once in the config folder."""
    from potluck.transport.auth import PoolAuth
    from potluck.transport.tls import load_or_create_identity

    auth = PoolAuth.from_secret(_secret(secret)[0], tls)
    if worker and tls:
        auth = PoolAuth(auth.key, True, load_or_create_identity(_config_dir()))
    return auth


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
    peers=None,  # a PeerFinder (_peers)
    shares: list[float] | None = None,
    auth_flags: tuple[str | None, bool] = (None, False),  # --secret, --tls (see _auth)
    failover_s: float | None = 5.0,
    balance: str = "prompt",
    wire: str = "f32",
    mem: int | None = None,
    n_seq: int = 1,
    found: list[str] | None = None,
    lora: list[str] | None = None,
):
    """Resolve, load with a progress bar, and print the one-line summary (and the pool's plan).
    lora: --lora FILE[:SCALE] each (over a pool, each node gets its layers' part).
    found: filled with the workers found (all of them, used by the plan or not).
    Over a pool, a node silent for failover_s seconds is dropped and the planner re-plans on the
    nodes left (the generation pauses, then goes on). balance: what the planner evens out between
    stages, "prompt" for one conversation (run, chat) or "decode" for many streams (serve).
    mem: the most memory this machine offers for layers (--mem; 0: none, workers only).
    n_seq: sequences at once (serve's -np): the plan and every node count KV for each."""
    from potluck.engine.generate import load_model
    from potluck.modelfile.lora import parse_lora_arg
    from potluck.modelfile.sources import resolve_model

    _setup_threads(threads)
    path = resolve_model(model)
    loras = [parse_lora_arg(x) for x in lora or []]
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
        assignments, auth, plan = [], None, None
        addresses = _found(peers, lambda: _auth(*auth_flags)) if peers is not None else []
        if found is not None:
            found += addresses
        if mem == 0 and not addresses:
            raise PotluckError(
                "--mem 0 keeps every layer off this machine, and no worker was found: name "
                "them with --peer HOST:PORT (or start `potluck worker` on them)"
            )
        if shares and not addresses:  # a split by hand over no pool: say so, don't ignore it
            raise PotluckError(
                f"--tensor-split {','.join(f'{x:g}' for x in shares)} needs workers, and none "
                "was found: name them with --peer HOST:PORT (or start `potluck worker` on them)"
            )
        if addresses:
            bar.update(task, description=f"{path.name} (asking {len(addresses)} peers, planning)")
            auth = _auth(*auth_flags)
            plan = _plan(path, ctx, addresses, shares, auth, balance, mem, n_seq)
            from potluck.engine.survey import assignments_of

            assignments = assignments_of(plan)
            err.print(f"[dim]{plan.verdict}[/]")
        from potluck.engine.survey import assignments_of

        def replan(alive: list[str]):
            """The plan on the nodes left; a --tensor-split keeps the shares of those left."""
            if shares and len(shares) == len(addresses) + 1:
                kept = [shares[0]] + [
                    x for a, x in zip(addresses, shares[1:], strict=True) if a in alive
                ]
                if any(kept):
                    with contextlib.suppress(
                        PotluckError
                    ):  # e.g. they no longer fit: the planner's choice
                        return assignments_of(
                            _plan(path, ctx, alive, kept, auth, balance, mem, n_seq)
                        )
            return assignments_of(_plan(path, ctx, alive, None, auth, balance, mem, n_seq))

        def on_failover(ev) -> None:
            err.print(
                f"[yellow]{', '.join(ev.gone) or 'a node'} went away ({ev.reason}); re-planned and "
                f"replayed {ev.replayed_tokens} tokens in {ev.recover_s:.1f} s:[/]"
            )
            for line in ev.assignments or ["every layer → this machine (cpu)"]:
                err.print(f"[dim]  {line}[/]")

        began: dict[str, float] = {}

        def on_transfer(node: str, sent: int, total: int) -> None:
            t = began.setdefault(node, time.perf_counter())
            rate = sent / max(time.perf_counter() - t, 1e-3)
            bar.update(
                task,
                description=f"{path.name} (sending {node} its layers: "
                f"{sent / 2**20:.0f}/{total / 2**20:.0f} MiB, {rate / 1e6:.0f} MB/s, "
                f"{(total - sent) / rate:.0f} s left)",
            )

        m = load_model(
            path, ctx, splits or (), on_layer, assignments=assignments, auth=auth,
            failover_s=failover_s, replan=replan, on_failover=on_failover,
            on_transfer=on_transfer, wire_dtype=WIRE_DTYPES[wire], n_seq=n_seq, loras=loras,
        )  # fmt: skip
    err.print(f"[dim]{m.summary()} · loaded in {time.perf_counter() - t0:.1f} s[/]")
    for lp, scale in loras:
        err.print(f"[dim]LoRA adapter {lp.name} · scale {scale:g}[/]")
    err.print(f"[dim]{_backends()}[/]")
    from potluck.planner import format_held

    planned = {st.node: st for st in plan.stages} if plan is not None else {}
    held = getattr(m.pipeline, "held", {})
    for a in getattr(m.pipeline, "assignments", []):
        line = a.describe()
        if (r := held.get(a.node)) is not None:
            line += " · " + format_held(
                r.weight_bytes, r.kv_bytes, r.rss_bytes, planned.get(a.node)
            )
            if r.pulled_bytes:  # it had no copy of the model: a peer sent its layers
                rate = r.pulled_bytes / max(r.pull_seconds, 1e-9) / 1e6
                line += (
                    f" · received {r.pulled_bytes / 2**20:.0f} MiB of its layers from "
                    f"{r.pulled_from} at {rate:.0f} MB/s"
                )
        err.print(f"[dim]  {line}[/]")
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


def _plan(
    path: Path,
    ctx: int | None,
    peers: list[str],
    shares: list[float] | None,
    auth=None,
    balance: str = "prompt",
    mem: int | None = None,
    n_seq: int = 1,
):
    """Survey the peers, then run the planner for this model and context (this machine offering
    at most `mem` bytes; KV for `n_seq` sequences at once)."""
    from potluck.planner import plan_pool

    if shares and len(shares) != len(peers) + 1:  # the planner says so too, without the names
        shown, n = ",".join(f"{x:g}" for x in shares), len(peers) + 1
        raise PotluckError(
            f"--tensor-split {shown} has {len(shares)} shares but the pool has {n} "
            f"node{'s' * (n > 1)} ({', '.join(['this machine', *peers])}; a worker found twice "
            "counts once): give one share per node, this machine first"
        )
    nodes, links, fp = _survey(path, ctx, peers, auth, mem, n_seq)
    return plan_pool(fp, nodes, links, shares or None, balance)


def _survey(path: Path, ctx: int | None, peers: list[str], auth, mem: int | None, n_seq: int = 1):
    """(nodes, links, the model's footprint): what the planner takes, measured on this model."""
    from potluck.engine.generate import DEFAULT_CTX
    from potluck.engine.survey import survey
    from potluck.modelfile.gguf_file import GGUFFile, layer_matrices
    from potluck.modelfile.hparams import hparams_from_metadata
    from potluck.planner import footprint_from_gguf, held_bytes

    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata, str(path))
    n_ctx = ctx or min(hp.n_ctx_train, DEFAULT_CTX)
    layer = layer_matrices(f.tensors, hp.n_layer // 2)  # every node times its decode through it
    nodes, links = survey(peers, auth=auth, mem_limit=mem, matrices=layer)
    fp = footprint_from_gguf(f.tensors, hp, n_ctx, held=held_bytes, n_seq=n_seq)
    return nodes, links, fp


DEFAULT_PARALLEL = 4  # serve's requests at once (llama.cpp's server: 4 slots)
ParallelOpt = Annotated[
    int,
    typer.Option(
        "-np",
        "--parallel",
        min=1,
        help="Requests generating at once (serve); memory is planned for the KV cache of each "
        "at the full context (-c).",
    ),
]
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


def _stream(m, ids: list[int], n: int, sampler, n_batch: int, chat: bool = False) -> list[int]:
    """Generate up to n tokens (-1: until the end of text or a full context) and print text as it
    comes; timing on stderr, and a line when the context filled (what to do: in a chat, /reset).
    Returns the generated ids."""
    from potluck.engine.generate import generate
    from potluck.modelfile.tokenizer import StreamDecoder

    dec = StreamDecoder(m.tokenizer)
    out: list[int] = []
    t0 = time.perf_counter()
    t_first = None
    limit = m.n_ctx if n == -1 else n  # generate stops at a full context anyway
    for tok in generate(m, ids, limit, sampler, n_batch=n_batch):
        if t_first is None:
            t_first = time.perf_counter()
        out.append(tok)
        if tok in m.tokenizer.eot_ids:
            break
        sys.stdout.write(dec.push(tok))
        sys.stdout.flush()
    sys.stdout.write(dec.flush() + "\n")
    t1 = time.perf_counter()
    ended = bool(out) and out[-1] in m.tokenizer.eot_ids
    if not ended and len(out) < limit and len(ids) + len(out) >= m.n_ctx:
        todo = [*(["/reset to start over"] if chat else []), *filter(None, [_more_ctx(m)])]
        err.print(
            f"stopped after {len(out)} tokens: the context of {m.n_ctx} tokens is full"
            + ("; " + ", or ".join(todo) if todo else "")
        )
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
        int,
        typer.Option(
            "-n",
            "--n-predict",
            callback=PredictCheck,
            help="Tokens to generate at most (-1: until the end of text or a full context).",
        ),
    ] = 128,
    ctx: CtxOpt = None,
    threads: ThreadsOpt = None,
    ngl: NglOpt = 0,
    device: DeviceOpt = None,
    cache_type: CacheTypeOpt = "f16",
    no_repack: NoRepackOpt = False,
    lora: LoraOpt = None,
    batch: PromptBatchOpt = None,
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
    mem: HeadMemOpt = None,
    pool: PoolOpt = DEFAULT_POOL,
    no_mdns: NoMdnsOpt = False,
    secret: SecretOpt = None,
    tls: TlsOpt = False,
    failover_timeout: FailoverOpt = 5.0,
    wire_dtype: WireOpt = "f32",
) -> None:
    """Generate text from a prompt, streaming it to stdout (over the pool's workers: found on
    mDNS, or --peer)."""
    from potluck.engine.generate import prompt_batch
    from potluck.engine.sampling import Sampler

    params = _sampling(temp, top_k, top_p, min_p, repeat_penalty, seed)
    splits = [int(s) for s in split.split(",")] if split else None
    finder = _peers(peer, rpc, pool, no_mdns or splits is not None)  # --split: in-process check
    _setup_cache(cache_type, no_repack)
    _setup_gpu(ngl, device)
    m = _load(
        model, ctx, threads, splits, finder, _shares(tensor_split), (secret, tls),
        _failover(failover_timeout), wire=wire_dtype, mem=_head_mem(mem), lora=lora,
    )  # fmt: skip
    if raw:
        ids = m.tokenizer.encode(prompt)
    else:
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        ids = m.tokenizer.encode(m.chat.render(msgs))
    _stream(m, ids, n_predict, Sampler(params), prompt_batch(m, batch))


@app.command()
def chat(
    model: ModelOpt = None,
    n_predict: Annotated[
        int,
        typer.Option(
            "-n",
            "--n-predict",
            callback=PredictCheck,
            help="Tokens per answer at most (-1: until the end of text or a full context).",
        ),
    ] = 512,
    ctx: CtxOpt = None,
    threads: ThreadsOpt = None,
    ngl: NglOpt = 0,
    device: DeviceOpt = None,
    cache_type: CacheTypeOpt = "f16",
    no_repack: NoRepackOpt = False,
    lora: LoraOpt = None,
    batch: PromptBatchOpt = None,
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
    mem: HeadMemOpt = None,
    pool: PoolOpt = DEFAULT_POOL,
    no_mdns: NoMdnsOpt = False,
    secret: SecretOpt = None,
    tls: TlsOpt = False,
    failover_timeout: FailoverOpt = 5.0,
    wire_dtype: WireOpt = "f32",
) -> None:
    """Chat interactively with the model's chat template. Ctrl-D or /exit to leave."""
    from potluck.engine.generate import prompt_batch
    from potluck.engine.sampling import Sampler

    params = _sampling(temp, top_k, top_p, min_p, repeat_penalty, seed)
    finder = _peers(peer, rpc, pool, no_mdns)
    _setup_cache(cache_type, no_repack)
    _setup_gpu(ngl, device)
    m = _load(
        model, ctx, threads, None, finder, _shares(tensor_split), (secret, tls),
        _failover(failover_timeout), wire=wire_dtype, mem=_head_mem(mem), lora=lora,
    )  # fmt: skip
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
        if len(ids) >= m.n_ctx:
            err.print(f"[red]error:[/] {_too_long(len(ids), m, len(msgs) > 1 + bool(system))}")
            msgs.pop()
            continue
        try:
            out = _stream(m, ids, n_predict, sampler, prompt_batch(m, batch), chat=True)
        except PotluckError as exc:  # e.g. a pool node that failed for good: say so, keep going
            err.print(f"[red]error:[/] {exc}")
            msgs.pop()
            continue
        reply = m.tokenizer.decode([t for t in out if t not in m.tokenizer.eot_ids])
        msgs.append({"role": "assistant", "content": reply})


def _more_ctx(m) -> str:
    """What raising -c can still give ('' when the context is already the model's longest)."""
    if m.n_ctx >= m.hp.n_ctx_train:
        return ""
    return f"raise -c (the model allows up to {m.hp.n_ctx_train})"


def _too_long(n_tokens: int, m, history: bool) -> str:
    """Why a chat turn cannot be answered: the conversation, or this message alone, fills the
    context."""
    more = f", or {_more_ctx(m)}" if _more_ctx(m) else ""
    if history:
        return (
            f"the conversation is {n_tokens} tokens, the context {m.n_ctx}: /reset to start over"
            + more
        )
    return f"this message is {n_tokens} tokens, the context {m.n_ctx}: shorten it" + more


@app.command()
def perplexity(
    file: Annotated[
        Path, typer.Option("-f", "--file", help="Text file to score.", exists=True, dir_okay=False)
    ],
    model: ModelOpt = None,
    ctx: Annotated[int, typer.Option("-c", "--ctx-size", help="Chunk length in tokens.")] = 256,
    threads: ThreadsOpt = None,
    ngl: NglOpt = 0,
    device: DeviceOpt = None,
    cache_type: CacheTypeOpt = "f16",
    no_repack: NoRepackOpt = False,
    lora: LoraOpt = None,
    batch: BatchOpt = 512,
) -> None:
    """Perplexity over a text file, computed as llama-perplexity does (second half of each chunk)."""
    from potluck.engine.perplexity import perplexity as compute

    _setup_cache(cache_type, no_repack)
    _setup_gpu(ngl, device)
    m = _load(model, ctx, threads, lora=lora)
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
    mem: HeadMemOpt = None,
    parallel: ParallelOpt = 1,
    batch_plan: Annotated[
        bool,
        typer.Option(
            "--batch", help="Plan a batch job: replicas (data parallel) and items per hour."
        ),
    ] = False,
    item_tokens: Annotated[
        int, typer.Option("--item-tokens", min=1, help="--batch: tokens generated per item.")
    ] = 256,
    pool: PoolOpt = DEFAULT_POOL,
    no_mdns: NoMdnsOpt = False,
    secret: SecretOpt = None,
    tls: TlsOpt = False,
) -> None:
    """Dry run: who would get which layers, memory per node, predicted tok/s, and whether pooling
    beats the best single machine at all (--batch: the replicas of a batch job)."""
    from potluck.modelfile.sources import resolve_model
    from potluck.planner import PLAN_COLUMNS, format_plan, format_summary

    finder = _peers(peer, rpc, pool, no_mdns)
    _setup_threads(None)
    path = resolve_model(model)
    found = _found(finder, lambda: _auth(secret, tls))
    if batch_plan:
        from potluck.planner.replicas import REPLICA_COLUMNS, format_replicas, plan_replicas

        auth = _auth(secret, tls) if found else None
        nodes, links, fp = _survey(path, ctx, found, auth, _head_mem(mem), parallel)
        rows, lines = format_replicas(plan_replicas(fp, nodes, links), item_tokens)
        table = Table(*REPLICA_COLUMNS, title=f"{path.name} · batch replicas · context {fp.n_ctx}")
        table.columns[0].no_wrap = True
        for row in rows:
            table.add_row(*row)
        Console().print(table)
        for line in lines:
            print(line)
        return
    p = _plan(
        path, ctx, found, _shares(tensor_split), _auth(secret, tls) if found else None,
        mem=_head_mem(mem), n_seq=parallel,
    )  # fmt: skip
    seqs = f" × {parallel} sequences at once" if parallel > 1 else ""
    table = Table(*PLAN_COLUMNS, title=f"{path.name} · context {p.n_ctx}{seqs}")
    table.columns[0].no_wrap = True  # a node's address is what the user types: never cut it
    for row in format_plan(p):
        table.add_row(*row)
    Console().print(table)
    for line in format_summary(p):
        print(line)


JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _dialer(secret: str | None, tls: bool):
    """address -> a client with the pool's credentials, for `potluck nodes` / `doctor`."""
    from potluck.transport.client import NodeClient

    auth = _auth(secret, tls)
    return lambda address: NodeClient(address, auth)


@app.command()
def nodes(
    peer: PeerOpt = None,
    rpc: RpcOpt = None,
    pool: PoolOpt = DEFAULT_POOL,
    no_mdns: NoMdnsOpt = False,
    timeout: Annotated[
        float,
        typer.Option("--timeout", callback=_positive, help="Seconds to wait for each node."),
    ] = 3.0,
    as_json: JsonOpt = False,
    secret: SecretOpt = None,
    tls: TlsOpt = False,
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
    from potluck.node.probe import default_threads, physical_cores, usable_memory_bytes

    static = _static_peers(peer, rpc)
    adverts = []
    if _mdns_on(no_mdns):
        try:  # every pool: a worker of another pool is listed, with the reason it is not used
            adverts = Browser(None, window_s=2.0).results()
        except DiscoveryError as exc:
            err.print(f"[yellow]mDNS unavailable:[/] {exc}; static peers only")
    peers = dedupe([*static, *(Peer(a.address, MDNS, a) for a in adverts)])
    dial = _dialer(secret, tls)
    reports = [local_report(usable_memory_bytes(), physical_cores(), default_threads())]
    with err.status("measuring") as status:
        for p in peers:
            status.update(f"measuring {p.address}")
            reports.append(inspect(p, pool, dial, timeout))
    if as_json:
        print(json.dumps([report_json(r) for r in reports], indent=1))
    else:
        table = Table(*NODE_COLUMNS, title=f"pool {pool!r}")
        for r in reports:
            table.add_row(*format_row(r))
        Console(width=max(160, Console().width)).print(table)
    if not peers:
        err.print(
            "no workers found: start `potluck worker -H 0.0.0.0` on another machine (same --pool), "
            "or name one with --peer HOST:PORT"
        )


@app.command()
def doctor(
    peer: PeerOpt = None,
    rpc: RpcOpt = None,
    pool: PoolOpt = DEFAULT_POOL,
    no_mdns: NoMdnsOpt = False,
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
    secret: SecretOpt = None,
    tls: TlsOpt = False,
) -> None:
    """Check the pool for what users trip over and say what to do: ports, firewalls, versions,
    the pool secret, memory for the model and its context, threads, slow links, throttling."""
    import dataclasses
    import json

    import psutil

    from potluck.discovery.doctor import FAIL, DoctorConfig, run_doctor
    from potluck.engine.survey import this_machine
    from potluck.modelfile.sources import resolve_model
    from potluck.node.doctor import load_samples
    from potluck.node.probe import physical_cores

    finder = _peers(peer, rpc, pool, no_mdns)
    found = finder.find(lambda peer: "")  # check even those that do not answer
    if finder.error:
        err.print(f"[yellow]mDNS unavailable:[/] {finder.error}; static peers only")
    _setup_threads(threads)
    cfg = DoctorConfig(
        pool=pool,
        threads=threads,
        model=resolve_model(model) if model else None,
        ctx=ctx,
        connect_timeout_s=timeout,
        call_timeout_s=max(timeout, 5.0),
        load_seconds=load_seconds,
    )

    def local_load(seconds: float, interval: float) -> list[tuple[float, float]]:
        return list(load_samples(seconds, interval))

    cores = (physical_cores(), psutil.cpu_count(logical=True) or physical_cores())
    with err.status("checking") as status:
        checks = run_doctor(
            list(found.peers) + [p for p, _ in found.skipped], cfg, _dialer(secret, tls),
            this_machine, cores,
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


@app.command()
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
    _setup_cache(cache_type, no_repack)
    _setup_gpu(ngl, device, vram_limit)

    value, source = _secret(secret)
    if value is None and not _loopback_only(host) and not insecure:
        raise PotluckError(
            f"refusing to listen on {host} without a pool secret: anyone who can reach port "
            f"{port} could use this machine and see what it computes; make one with `potluck "
            "secret --save` and give every machine of the pool the same one (`potluck secret "
            "--set -`), or pass --secret / POTLUCK_SECRET (--insecure accepts the risk on a "
            "network you trust)"
        )
    auth = _auth(secret, tls, worker=True)
    _setup_threads(threads)
    server, bound = serve(
        host, port, threads=threads or _physical_cores(), model_dirs=tuple(model_dir or ()),
        auth=auth, mem_limit=mem_limit, idle_s=idle_timeout,
        data_port=None if no_data_port else (-1 if data_port is None else data_port),
        spin_s=spin_ms / 1000,
    )  # fmt: skip
    advertiser = _announce(host, bound, pool, no_mdns)
    guard = f"pool secret from {source}" if value else "no pool secret"
    if auth.identity is not None:
        guard += f" · TLS, certificate sha256 {auth.identity.sha256.hex()[:16]}…"
    if value is None and not _loopback_only(host):
        err.print(
            f"[bold yellow]warning:[/] no pool secret: anyone who can reach {host}:{bound} can use this machine"
        )
    lanes = f"data port {server.data_port}" if server.data_port else "no data port"
    err.print(
        f"potluck worker {__version__} listening on {host}:{bound} · {lanes} · "
        f"{_physical_cores()} cores · {guard} · Ctrl-C to stop"
    )
    err.print(f"[dim]{_backends()}[/]")
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        server.stop(grace=1.0)
    finally:
        if advertiser is not None:
            advertiser.close()  # goodbye packets: heads drop this worker at once


def _backends() -> str:
    """One line: the devices and CPU features of this machine's ggml."""
    from potluck.model.ggml_lib import build_advice, describe

    advice = build_advice()
    return describe() + (f"\n[yellow]note:[/] {advice}" if advice else "")


def _backends_check() -> tuple[str, str | None]:
    from potluck.model.ggml_lib import build_advice, describe

    return describe(), build_advice()


def _failover(seconds: float) -> float:
    """0 = no re-plan, but a node silent for OFF_TIMEOUT_S still ends the request (never a hang)."""
    if not seconds >= 0:
        raise typer.BadParameter(f"--failover-timeout must be 0 (off) or positive, got {seconds}")
    return seconds


def _size(text: str, flag: str, allow_zero: bool = False) -> int:
    """'4G', '512M', '1.5GiB', '800000000' -> bytes (binary units, as free(1) and llama.cpp)."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if m is None:
        raise typer.BadParameter(f"{flag} {text!r}: give a size like 4G, 512M or 1.5GiB")
    scale = 1024 ** "_KMGT".index(m.group(2).upper() or "_") if m.group(2) else 1
    size = int(float(m.group(1)) * scale)
    if size < 1 and not allow_zero:
        raise typer.BadParameter(f"{flag} {text!r} is 0 bytes: give a size like 4G, 512M or 1.5GiB")
    return size


def _announce(host: str, port: int, pool: str, no_mdns: bool):
    """Announce the worker on mDNS (see discovery/mdns.py for where); None when off or it cannot
    (said on stderr: heads can still use --peer). SIGTERM (systemd, docker stop) then ends the
    worker like Ctrl-C, so it says goodbye."""
    import signal

    from potluck.discovery.mdns import Advertiser, DiscoveryError, announce_scope, worker_advert
    from potluck.node.probe import physical_cores, usable_memory_bytes
    from potluck.transport.codec import PROTOCOL_VERSION

    if not _mdns_on(no_mdns):
        return None

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        addresses, interfaces = announce_scope(host)
        advert = worker_advert(
            port, pool, addresses, PROTOCOL_VERSION, __version__, physical_cores(),
            usable_memory_bytes(),
        )  # fmt: skip
        advertiser = Advertiser(advert, interfaces)
        a = advertiser.start()
    except DiscoveryError as exc:
        err.print(f"[yellow]not announced on mDNS:[/] {exc}; heads can still use --peer")
        return None
    where = "this machine only" if host.startswith("127.") else ", ".join(a.addresses)
    err.print(f"announced on mDNS as {a.instance!r} in pool {pool!r} ({where})")
    return advertiser


@app.command()
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
    peer: PeerOpt = None,
    rpc: RpcOpt = None,
    mem: HeadMemOpt = None,
    pool: PoolOpt = DEFAULT_POOL,
    no_mdns: NoMdnsOpt = False,
    secret: SecretOpt = None,
    tls: TlsOpt = False,
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
    finder = _peers(peer, rpc, pool, no_mdns)
    workers: list[str] = []
    replicas, reload = _replicas(
        model, ctx, threads, finder, (secret, tls), _head_mem(mem), parallel, workers
    )  # fmt: skip
    schedulers: list = []

    def app_of(m):
        config = SchedulerConfig(n_batch=prompt_batch(m), max_active=parallel, max_queue=len(items))
        schedulers.append(Scheduler(m, config))
        return create_app(m, schedulers[-1], ServerConfig(model_id=model_id_of(m), api_key=None))

    apps = [(label, app_of(m)) for label, m in replicas]
    path = replicas[0][1].path
    recruits = _Recruits(path, ctx, finder, workers, (secret, tls), parallel, app_of, replicas)
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

            def on_progress(p) -> None:
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


def _idle_replicas(path: Path, ctx, idle: list[str], auth_flags, n_seq: int):
    """Batch replicas for `serve` on the workers its plan leaves idle (each that can hold the
    whole model): ([(label, Model)], reload) as `_replicas`; none when none can."""
    from potluck.engine.replicas import load_replicas, reloader
    from potluck.planner import THIS_MACHINE
    from potluck.planner.errors import NotEnoughMemoryError
    from potluck.planner.replicas import plan_replicas

    auth = _auth(*auth_flags)
    nodes, links, fp = _survey(path, ctx, idle, auth, 0, n_seq)  # this machine: serving
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

    def __init__(self, path, ctx, finder, known, auth_flags, n_seq, make_app, replicas) -> None:
        self.path, self.ctx, self.finder, self.n_seq = path, ctx, finder, n_seq
        self.known: set[str] = set(known)  # workers used or tried already
        self.auth_flags, self.make_app, self.replicas = auth_flags, make_app, replicas
        self.reloads: dict[str, Callable] = {}  # label -> reload(label) (engine.replicas)

    def add(self, loaded, reload) -> None:
        for label, _ in loaded:
            if reload is not None:
                self.reloads[label] = reload

    def recruit(self):
        from potluck.api.batch import Recruit

        return Recruit(self.revive, self.join)

    async def revive(self, label: str):
        import asyncio

        reload = self.reloads.get(label)
        m = await asyncio.to_thread(reload, label) if reload is not None else None
        if m is None:
            return None
        self.replicas.append((label, m))
        return self.make_app(m)

    async def join(self) -> list:
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


def _replicas(model, ctx, threads, finder, auth_flags, mem, n_seq, found: list[str]):
    """The batch job's replicas, loaded: ([(label, Model)], reload). Alone: this machine. With
    workers: each machine that holds the whole model is a replica, the others one pipeline
    (planner). reload(label): a failed single-machine replica loaded again if its machine
    answers, else None (blocking)."""
    from potluck.engine.generate import load_model
    from potluck.engine.replicas import load_replicas, reloader
    from potluck.modelfile.sources import resolve_model
    from potluck.planner.replicas import plan_replicas

    _setup_threads(threads)
    path = resolve_model(model)
    addresses = _found(finder, lambda: _auth(*auth_flags))
    found.extend(addresses)
    if not addresses:
        if mem == 0:
            raise PotluckError(
                "--mem 0 keeps the model off this machine, and no worker was found: name them "
                "with --peer HOST:PORT (or start `potluck worker` on them)"
            )
        m = load_model(path, ctx, n_seq=n_seq)
        err.print(f"[dim]{m.summary()}[/]")
        return [("this machine", m)], lambda label: None
    auth = _auth(*auth_flags)
    nodes, links, fp = _survey(path, ctx, addresses, auth, mem, n_seq)
    plan = plan_replicas(fp, nodes, links)
    for r in plan.replicas:
        how = "a pipeline" if r.plan is not None else "the whole model"
        err.print(f"[dim]replica {r.label}: {how}, {r.tokens_per_s:.1f} tok/s per stream[/]")
    for node, why in plan.left_out:
        err.print(f"[dim]  left out {node}: {why}[/]")
    names = [n.name for n in nodes]
    reload = reloader(path, ctx, plan.replicas, names, links, auth, n_seq)
    return load_replicas(path, ctx, plan.replicas, names, links, auth, n_seq), reload


@app.command()
def finetune(
    data: Annotated[
        Path, typer.Option("--data", help='Training lines (JSONL): chats or {"text": ...}.')
    ],
    output: Annotated[Path, typer.Option("-o", "--output", help="The adapter to write (GGUF).")],
    model: ModelOpt = None,
    eval_data: Annotated[
        Path | None,
        typer.Option("--eval", help="Held-out lines (JSONL): their loss after each epoch."),
    ] = None,
    rank: Annotated[int, typer.Option("--rank", min=1, help="LoRA rank r.")] = 8,
    alpha: Annotated[float, typer.Option("--alpha", help="LoRA alpha (scale alpha / r).")] = 16.0,
    targets: Annotated[
        str,
        typer.Option(
            "--targets",
            help="Matrices to adapt, by GGUF name: attn_q,attn_k,attn_v,attn_output,ffn_gate,"
            "ffn_up,ffn_down (the default: all of them).",
        ),
    ] = "attn_q,attn_k,attn_v,attn_output,ffn_gate,ffn_up,ffn_down",
    lr: Annotated[float, typer.Option("--lr", help="AdamW learning rate.")] = 2e-4,
    epochs: Annotated[int, typer.Option("--epochs", min=1, help="Passes over the data.")] = 1,
    batch: Annotated[int, typer.Option("--batch", min=1, help="Examples per step.")] = 4,
    ctx: Annotated[int, typer.Option("--ctx", min=2, help="Longest example, in tokens.")] = 512,
    seed: SeedOpt = None,
    checkpoint_every: Annotated[
        int, typer.Option("--checkpoint-every", min=1, help="Steps between checkpoints.")
    ] = 50,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from OUTPUT.ckpt (bit-for-bit).")
    ] = False,
    recompute: Annotated[
        bool | None,
        typer.Option(
            "--recompute/--no-recompute",
            help="Compute each layer again in the backward pass instead of keeping its "
            "activations (less memory, ≈ 1/3 more compute); default: when the step would "
            "take over half the free memory.",
        ),
    ] = None,
    threads: ThreadsOpt = None,
    peer: PeerOpt = None,
    rpc: RpcOpt = None,
    mem: HeadMemOpt = None,
    pool: PoolOpt = DEFAULT_POOL,
    no_mdns: NoMdnsOpt = False,
    secret: SecretOpt = None,
    tls: TlsOpt = False,
) -> None:
    """Train a LoRA adapter (needs PyTorch: pip install potluck[train]), on this machine and,
    data parallel, on the pool's workers (each takes a share of every batch); the adapter is a
    GGUF that --lora (and llama.cpp's --lora) applies."""
    import dataclasses

    try:
        import torch
    except ImportError:
        raise PotluckError(
            "potluck finetune needs PyTorch: pip install 'potluck[train]' (for the CPU build: "
            "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu)"
        ) from None
    from potluck.modelfile.chat import ChatTemplate
    from potluck.modelfile.gguf_file import GGUFFile
    from potluck.modelfile.hparams import hparams_from_metadata
    from potluck.modelfile.sources import resolve_model
    from potluck.modelfile.tokenizer import Tokenizer
    from potluck.node.probe import usable_memory_bytes
    from potluck.train.data import read_examples
    from potluck.train.loop import CHECKPOINT_SUFFIX, TrainConfig, Trainer, memory_needed, run
    from potluck.train.model import DEFAULT_TARGETS

    torch.set_num_threads(threads or _physical_cores())
    wanted = tuple(t.strip() for t in targets.split(",") if t.strip())
    if bad := [t for t in wanted if t not in DEFAULT_TARGETS]:
        raise typer.BadParameter(
            f"--targets {', '.join(bad)}: not a matrix of this model family; use some of "
            f"{','.join(DEFAULT_TARGETS)}"
        )
    path = resolve_model(model)
    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata, str(path))
    if ctx > hp.n_ctx_train:
        raise PotluckError(
            f"--ctx {ctx} is longer than the model was trained for ({hp.n_ctx_train}); use "
            f"--ctx {hp.n_ctx_train} or less"
        )
    tok, chat = Tokenizer(f.metadata), ChatTemplate.from_metadata(f.metadata, hp.arch)
    examples, skipped = read_examples(data, tok, chat, ctx)
    evals = read_examples(eval_data, tok, chat, ctx)[0] if eval_data is not None else []
    for line, why in skipped[:5]:
        err.print(f"[yellow]{data} line {line} skipped: {why}[/]")
    if len(skipped) > 5:
        err.print(f"[yellow]... and {len(skipped) - 5} more lines skipped[/]")
    config = TrainConfig(
        rank=rank, alpha=alpha, targets=wanted, lr=lr, epochs=epochs, batch=batch, ctx=ctx,
        seed=seed if seed is not None else 0, checkpoint_every=checkpoint_every,
    )  # fmt: skip
    longest = max(len(e.ids) for e in [*examples, *evals])
    free = usable_memory_bytes()
    if recompute is None:  # keep every activation only where that takes under half the memory
        recompute = memory_needed(hp, f, config, longest, len(examples)) > free // 2
    config = dataclasses.replace(config, recompute=recompute)
    need = memory_needed(hp, f, config, longest, len(examples))
    if need > free:
        raise PotluckError(
            f"training needs about {need / 2**30:.1f} GiB for --batch {min(batch, len(examples))} "
            f"× {longest} tokens "
            f"(the longest example{', with --recompute' if recompute else ''}), this machine has "
            f"{free / 2**30:.1f} GiB free: lower --batch or shorten the examples"
        )
    finder = _peers(peer, rpc, pool, no_mdns)
    addresses = _found(finder, lambda: _auth(secret, tls))
    from potluck.train.pool import PoolTrainer

    if addresses:
        from potluck.transport.client import NodeClient

        auth = _auth(secret, tls)

        def on_event(text: str) -> None:
            err.print(f"[yellow]{text}[/]")

        trainer: Trainer = PoolTrainer(
            hp, f, examples, config, evals, addresses, lambda a: NodeClient(a, auth),
            _head_mem(mem) != 0, on_event,
        )  # fmt: skip
    else:
        if _head_mem(mem) == 0:
            raise PotluckError(
                "--mem 0 keeps the training off this machine, and no worker was found: name "
                "them with --peer HOST:PORT (or start `potluck worker` on them)"
            )
        trainer = Trainer(hp, f, examples, config, evals)
    ckpt = output.with_name(output.name + CHECKPOINT_SUFFIX)
    if ckpt.exists() and not resume:
        raise PotluckError(
            f"{ckpt} holds an unfinished run: --resume to continue it, or delete it to start over"
        )
    if resume:
        if not ckpt.exists():
            raise PotluckError(f"--resume: there is no checkpoint {ckpt} to continue from")
        trainer.load(ckpt)
        err.print(f"[dim]resuming at step {trainer.step} of {trainer.total} from {ckpt}[/]")
    if isinstance(trainer, PoolTrainer):
        trainer.start()
        who = ", ".join([*(["this machine"] if trainer.head_share else []), *trainer.alive])
        err.print(f"[dim]data parallel over {who}: each takes a share of every batch[/]")
    n_learned = sum(e.n_learned for e in examples)
    params = sum(p.numel() for p in trainer.model.parameters())
    err.print(
        f"[dim]{path.name}: {len(examples)} examples ({n_learned} tokens to learn), "
        f"{trainer.total} steps of {batch}; LoRA rank {rank} on {','.join(wanted)}: "
        f"{params / 1e6:.2f} M parameters{'; layers recomputed in backward' if recompute else ''}[/]"
    )
    bar = Progress(
        TextColumn("[bold]finetune[/]"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=err,
    )  # fmt: skip
    with bar:
        task = bar.add_task("train", total=trainer.total, completed=trainer.step, info="")
        last_eval: list[float] = []
        done = [0, 0, 0.0]  # steps, tokens, seconds (this run's)

        def on_step(r) -> None:
            done[:] = [done[0] + 1, done[1] + r.tokens, done[2] + r.seconds]
            if r.eval_loss is not None:
                last_eval.append(r.eval_loss)
            ev = f" · eval {last_eval[-1]:.3f}" if last_eval else ""
            bar.update(
                task, completed=r.step,
                info=f"epoch {r.epoch + 1} · loss {r.loss:.3f}{ev} · {r.tokens / r.seconds:.0f} tok/s",
            )  # fmt: skip

        run(trainer, output, on_step)
    final = f", eval loss {last_eval[-1]:.3f}" if last_eval else ""
    err.print(
        f"adapter written: {output} (rank {rank}, alpha {alpha:g}{final}) · {done[0]} steps, "
        f"{done[1]} tokens in {done[2]:.1f} s ({done[1] / max(done[2], 1e-9):.0f} tok/s)"
    )


@app.command()
def serve(
    model: ModelOpt = None,
    ctx: CtxOpt = None,
    threads: ThreadsOpt = None,
    ngl: NglOpt = 0,
    device: DeviceOpt = None,
    cache_type: CacheTypeOpt = "f16",
    no_repack: NoRepackOpt = False,
    lora: LoraOpt = None,
    batch: PromptBatchOpt = None,
    peer: PeerOpt = None,
    rpc: RpcOpt = None,
    tensor_split: SplitOpt = None,
    mem: HeadMemOpt = None,
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
    pool: PoolOpt = DEFAULT_POOL,
    no_mdns: NoMdnsOpt = False,
    secret: SecretOpt = None,
    tls: TlsOpt = False,
    wire_dtype: WireOpt = "f32",
) -> None:
    """Serve the model (over a pool with --peer) as an OpenAI-compatible API with a web page."""
    import dataclasses

    from potluck.api.server import ServerConfig, create_app, is_loopback, model_id_of
    from potluck.api.server import serve as run_server
    from potluck.engine.generate import DEFAULT_N_BATCH, prompt_batch
    from potluck.engine.scheduler import Scheduler, SchedulerConfig

    key = api_key or os.environ.get("POTLUCK_API_KEY") or None
    if not is_loopback(host) and key is None and not no_api_key:
        raise PotluckError(
            f"refusing to listen on {host} without an API key: anyone on the network could use "
            "the model; pass --api-key KEY (or set POTLUCK_API_KEY), or --no-api-key to accept that"
        )
    try:
        sched_config = SchedulerConfig(  # checked now; n_batch settled once the pool is known
            n_batch=batch or DEFAULT_N_BATCH, max_queue=max_queue, max_active=parallel
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    finder = _peers(peer, rpc, pool, no_mdns)
    # many streams at once: stages even in decode time
    _setup_cache(cache_type, no_repack)
    _setup_gpu(ngl, device)
    workers: list[str] = []
    m = _load(
        model, ctx, threads, None, finder, _shares(tensor_split), (secret, tls),
        balance="decode", wire=wire_dtype, mem=_head_mem(mem), n_seq=parallel, found=workers,
        lora=lora,
    )  # fmt: skip
    sched_config = dataclasses.replace(sched_config, n_batch=prompt_batch(m, batch))
    scheduler = Scheduler(m, sched_config)
    # workers the plan leaves idle run batch jobs, each with the whole model, where they can
    used = {a.node for a in getattr(m.pipeline, "assignments", [])}
    idle = [a for a in workers if a not in used]
    extra, reload = (
        _idle_replicas(m.path, ctx, idle, (secret, tls), parallel) if idle else ([], None)
    )
    extra_schedulers: list = []

    def replica_app(r):
        config = dataclasses.replace(sched_config, n_batch=prompt_batch(r))
        extra_schedulers.append(Scheduler(r, config))
        return create_app(r, extra_schedulers[-1], ServerConfig(model_id=model_id_of(r)))

    extra_apps = [(label, replica_app(r)) for label, r in extra]
    # ... and so do workers that come back, or are started after the server
    recruits = _Recruits(m.path, ctx, finder, workers, (secret, tls), parallel, replica_app, extra)
    recruits.add(extra, reload)

    from potluck.modelfile.sources import cache_dir

    batches = batch_dir or cache_dir() / "batches"
    config = ServerConfig(model_id=model_id_of(m), api_key=key, batch_dir=batches)
    app_ = create_app(m, scheduler, config, extra_apps, recruits.recruit())

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


def _loopback_only(host: str) -> bool:
    """Whether every address `host` names is a loopback one (unresolvable: no)."""
    import ipaddress
    import socket

    try:
        infos = socket.getaddrinfo(host, None)
        return bool(infos) and all(
            ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos
        )
    except (OSError, ValueError):
        return False


@app.command("secret")
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


@app.command()
def bench(
    model: ModelOpt = None,
    ctx: CtxOpt = None,
    threads: ThreadsOpt = None,
    n_predict: Annotated[
        int, typer.Option("-n", "--n-predict", callback=_at_least(1), help="Tokens to decode.")
    ] = 32,
    n_prompt: Annotated[
        int,
        typer.Option("-p", "--n-prompt", callback=_at_least(1), help="Prompt tokens to process."),
    ] = 128,
    peer: PeerOpt = None,
    rpc: RpcOpt = None,
    tensor_split: SplitOpt = None,
    mem: HeadMemOpt = None,
    pool: PoolOpt = DEFAULT_POOL,
    no_mdns: NoMdnsOpt = False,
    secret: SecretOpt = None,
    tls: TlsOpt = False,
    wire_dtype: WireOpt = "f32",
    json_out: Annotated[
        bool,
        typer.Option("--json", help="Print the predicted and measured figures as JSON."),
    ] = False,
) -> None:
    """Measure the model on the best single machine and on the pool, side by side: tokens/s,
    compute per stage and time on each link, and whether pooling is worth it (measured)."""
    from potluck.engine.generate import load_model
    from potluck.engine.measure import bench_report, measure, measured_verdict
    from potluck.engine.pipeline import LOCAL, Assignment
    from potluck.engine.survey import THIS_MACHINE, assignments_of
    from potluck.modelfile.sources import resolve_model

    _setup_threads(threads)
    path = resolve_model(model)
    addresses = _found(_peers(peer, rpc, pool, no_mdns))
    if not addresses:
        raise PotluckError(
            "no workers to compare with: start `potluck worker` on another machine of the pool, "
            "or name one with --peer HOST:PORT"
        )
    auth = _auth(secret, tls)
    shares = _shares(tensor_split)
    head_mem = _head_mem(mem)
    plan_ = _plan(path, ctx, addresses, shares, auth, mem=head_mem)
    pool_plan = assignments_of(plan_)
    if len(pool_plan) == 1:  # the planner would use one machine: show what an even pool does
        even = [0.0 if head_mem == 0 else 1.0] + [1.0] * len(addresses)
        plan_ = _plan(path, ctx, addresses, even, auth, mem=head_mem)
        pool_plan = assignments_of(plan_)
    runs = []
    best = plan_.best_single
    if best is None:
        err.print("[dim]no single machine can hold the model: measuring the pool only[/]")
    else:
        node = LOCAL if best.node == THIS_MACHINE else best.node
        runs.append((best.node, [Assignment(node, 0, plan_.n_layer)]))
    runs.append(("pool", pool_plan))
    results = []
    for label, assignments in runs:
        err.print(
            f"[dim]measuring {label}: " + "; ".join(a.describe() for a in assignments) + "[/]"
        )
        m = load_model(
            path, ctx, assignments=assignments, auth=auth, failover_s=0,
            wire_dtype=WIRE_DTYPES[wire_dtype],
        )  # fmt: skip
        try:
            results.append(measure(m, label, n_predict, n_prompt))
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        finally:
            if hasattr(m.pipeline, "close"):
                m.pipeline.close()
    if json_out:
        print(json.dumps(bench_report(plan_, results, path.name, n_prompt, n_predict), indent=1))
        return
    table = Table(title=f"potluck bench · {path.name} · -p {n_prompt} -n {n_predict}")
    for col in (
        "run",
        "decode tok/s",
        "prompt tok/s",
        "compute ms/token per stage",
        "link ms/token per hop",
    ):
        table.add_column(col, justify="left" if col == "run" else "right")
    for r in results:
        table.add_row(
            r.label if r.label == "pool" else f"{r.label} alone",
            f"{r.decode_tokens_per_s:.1f}", f"{r.prompt_tokens_per_s:.1f}",
            " + ".join(f"{x:.2f}" for x in r.stage_ms), " + ".join(f"{x:.2f}" for x in r.hop_ms) or "–",
        )  # fmt: skip
    Console(highlight=False).print(table)
    names = [a.describe() for a in pool_plan]
    print(f"predicted: {plan_.verdict}")
    if len(results) == 2:
        print(measured_verdict(results[0], results[1], names))


@app.command()
def version() -> None:
    """Print Potluck's version."""
    print(__version__)


def main() -> None:
    code: int = 0
    try:
        if where := os.environ.get("POTLUCK_GGML"):  # another build of ggml (model/ggml_lib.py)
            from potluck.model.ggml_lib import use_library

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
    if (failover := sys.modules.get("potluck.engine.failover")) is not None:
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


if __name__ == "__main__":
    main()
