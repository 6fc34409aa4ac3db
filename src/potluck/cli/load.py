"""Loading a model for a command: over the pool's workers when some are found (survey, plan,
failover re-plans), with a progress bar and the summary lines on stderr."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from potluck.cli.config import ModelFlags, PoolFlags
from potluck.cli.console import err
from potluck.cli.options import WIRE_DTYPES, no_workers_for
from potluck.cli.runtime import _backends, places
from potluck.errors import PotluckError, UnsupportedError

if TYPE_CHECKING:
    from potluck.cli.config import SpecFlags
    from potluck.discovery.pool import PeerFinder
    from potluck.engine.generate import Model
    from potluck.engine.spec import Drafter
    from potluck.model.stage import Compute
    from potluck.modelfile.hparams import HParams
    from potluck.pool.failover import FailoverEvent


def cache_sequences(hp: HParams, ctx: int | None, cache_ram: int | None) -> int:
    """The prefix cache's budget (--cache-ram; None: one context) as full-context sequences, which
    the plan and every node count beside -np's."""
    from potluck.engine.generate import DEFAULT_CTX
    from potluck.engine.prefix import budget_bytes, planned_sequences

    n_ctx, per_token = ctx or min(hp.n_ctx_train, DEFAULT_CTX), hp.kv_bytes_per_token()
    state = hp.state_bytes()
    budget = budget_bytes(cache_ram, n_ctx, per_token, state)
    return planned_sequences(budget, n_ctx, per_token, state)


def _drafter(spec: SpecFlags, m: Model, compute: Compute) -> Drafter | None:
    """The drafter `spec` asks for (engine/spec.py): prompt lookup, or a draft model loaded on
    this machine (checked to share the model's vocabulary); None without speculative decoding."""
    from potluck.engine.spec import ModelDrafter, NgramDrafter, check_draft_vocab, draft_refusal
    from potluck.modelfile.sources import resolve_model
    from potluck.pool.build import load_model

    kind = spec.config().kind
    if kind == "ngram-simple":
        return NgramDrafter()
    if kind != "draft-simple":
        return None
    path = resolve_model(spec.model_draft, places())
    draft = load_model(path, m.n_ctx, compute=compute)
    if draft.hp.is_hybrid:  # (its own sequence is rewound to any earlier position)
        draft.close()
        raise UnsupportedError(draft_refusal(path.name, draft.hp.arch))
    check_draft_vocab(m, draft)
    err.print(f"[dim]draft model: {draft.summary()}[/]")
    return ModelDrafter(draft)


def _load(
    flags: ModelFlags,
    net: PoolFlags | None = None,
    *,
    splits: list[int] | None = None,
    no_mdns: bool = False,
    balance: str = "prompt",
    n_seq: int = 1,
    found: list[str] | None = None,
    finder: PeerFinder | None = None,
    cache_ram: int | None = 0,
) -> Model:
    """Set up this machine's compute (threads, cache, GPU), find the pool's workers (net; None:
    this machine alone), plan, load with a progress bar, and print the one-line summary and the
    plan. splits: in-process stages split at these layers (run --split; finds no workers).
    found: filled with the workers found (all of them, used by the plan or not). finder: the
    browse to use (serve keeps it to recruit workers later); default: net's, started here.
    Over a pool, a node silent for --failover-timeout seconds is dropped and the planner re-plans
    on the nodes left (the generation pauses, then goes on). balance: what the planner evens out
    between stages, "prompt" for one conversation (run, chat) or "decode" for many streams
    (serve). n_seq: sequences at once (serve's -np): the plan and every node count KV for each.
    cache_ram: the prefix cache's --cache-ram (MiB; None: one context), planned as as many more
    full-context sequences (engine/prefix.py)."""
    from potluck.modelfile.lora import parse_lora_arg
    from potluck.modelfile.sources import resolve_model
    from potluck.pool.build import load_model
    from potluck.pool.planning import PlanInputs, plan_model, replanner
    from potluck.pool.survey import assignments_of

    compute, here = flags.compute(), places()
    ctx = flags.ctx
    peers = finder
    if peers is None and net is not None:
        peers = net.finder(no_mdns or splits is not None)
    shares = net.shares() if net is not None else []
    mem = net.mem_bytes() if net is not None else None
    failover_s = net.failover_timeout if net is not None else 5.0  # checked by PoolFlags
    wire = net.wire_dtype if net is not None else "f32"
    path = resolve_model(flags.model, here)
    loras = [parse_lora_arg(x) for x in flags.lora or []]
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

        from potluck.model.archs import hparams_from_metadata
        from potluck.modelfile.gguf_file import GGUFFile

        hp = hparams_from_metadata(GGUFFile(path).metadata, str(path))
        bar.update(task, total=hp.n_layer)
        n_seq += cache_sequences(hp, ctx, cache_ram)
        assignments, auth, plan = [], None, None
        addresses = net.found(peers) if net is not None and peers is not None else []
        if found is not None:
            found += addresses
        if mem == 0 and not addresses:
            raise no_workers_for("every layer")
        if shares and not addresses:  # a split by hand over no pool: say so, don't ignore it
            raise PotluckError(
                f"--tensor-split {','.join(f'{x:g}' for x in shares)} needs workers, and none "
                "was found: name them with --peer HOST:PORT (or start `potluck worker` on them)"
            )
        replan = None
        if addresses:
            bar.update(task, description=f"{path.name} (asking {len(addresses)} peers, planning)")
            assert net is not None  # the workers come from its finder
            auth = net.auth()
            inputs = PlanInputs(path, ctx, auth, balance, mem, n_seq, compute, here.cache)
            plan = plan_model(inputs, addresses, shares)
            assignments = assignments_of(plan)
            err.print(f"[dim]{plan.verdict}[/]")
            replan = replanner(inputs, addresses, shares)

        def on_failover(ev: FailoverEvent) -> None:
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
            compute=compute, cache=here.cache,
        )  # fmt: skip
    err.print(f"[dim]{m.summary()} · loaded in {time.perf_counter() - t0:.1f} s[/]")
    for lp, scale in loras:
        err.print(f"[dim]LoRA adapter {lp.name} · scale {scale:g}[/]")
    err.print(f"[dim]{_backends()}[/]")
    from potluck.planner import format_held

    planned = {st.node: st for st in plan.stages} if plan is not None else {}
    held = m.pipeline.held
    for a in m.pipeline.assignments:
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
