"""`potluck bench`: the model measured on the best single machine and on the pool, side by side."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from potluck.cli.config import PeersFlags, SpecFlags, takes
from potluck.cli.console import err
from potluck.cli.options import (
    WIRE_DTYPES,
    CtxOpt,
    HeadMemOpt,
    ModelOpt,
    SplitOpt,
    ThreadsOpt,
    WireOpt,
    _at_least,
    _head_mem,
    _shares,
)
from potluck.cli.runtime import compute_of, places
from potluck.errors import PotluckError


@takes
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
    tensor_split: SplitOpt = None,
    mem: HeadMemOpt = None,
    wire_dtype: WireOpt = "f32",
    json_out: Annotated[
        bool,
        typer.Option("--json", help="Print the predicted and measured figures as JSON."),
    ] = False,
    *,
    net: PeersFlags,
    speculative: SpecFlags,
) -> None:
    """Measure the model on the best single machine and on the pool, side by side: tokens/s,
    compute per stage and time on each link, and whether pooling is worth it (measured). With
    --spec-type, each is measured again with drafts: the drafts kept and the speedup."""
    from potluck.cli.load import _drafter
    from potluck.engine.contract import LOCAL, Assignment
    from potluck.engine.measure import bench_report, measure, measured_verdict
    from potluck.modelfile.sources import resolve_model
    from potluck.pool.build import load_model
    from potluck.pool.planning import PlanInputs, plan_to_compare
    from potluck.pool.survey import THIS_MACHINE, assignments_of

    compute, here = compute_of(threads), places()
    path = resolve_model(model, here)
    addresses = net.found()
    if not addresses:
        raise PotluckError(
            "no workers to compare with: start `potluck worker` on another machine of the pool, "
            "or name one with --peer HOST:PORT"
        )
    auth = net.auth()
    shares = _shares(tensor_split)
    head_mem = _head_mem(mem)
    inputs = PlanInputs(
        path, ctx, auth, mem=head_mem, compute=compute, cache=here.cache,
        attended=n_prompt + n_predict // 2,  # the decode steps measured attend to this many on average
    )  # fmt: skip
    plan_ = plan_to_compare(inputs, addresses, shares)
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
    drafts = []  # the same runs with speculative decoding (--spec-type)
    for label, assignments in runs:
        err.print(
            f"[dim]measuring {label}: " + "; ".join(a.describe() for a in assignments) + "[/]"
        )
        m = load_model(
            path, ctx, assignments=assignments, auth=auth, failover_s=0,
            wire_dtype=WIRE_DTYPES[wire_dtype], compute=compute, cache=here.cache,
        )  # fmt: skip
        try:
            results.append(measure(m, label, n_predict, n_prompt))
            if speculative.config().on:
                drafter = _drafter(speculative, m, compute)
                drafted = measure(
                    m, label, n_predict, n_prompt, spec=speculative.config(), drafter=drafter
                )
                plain = results[-1]
                speedup = drafted.decode_tokens_per_s / plain.decode_tokens_per_s
                rate = drafted.kept / max(1, drafted.drafted)
                err.print(
                    f"[dim]{label}: drafts kept {drafted.kept} of {drafted.drafted} "
                    f"({rate:.0%}); decode ×{speedup:.2f} with them[/]"
                )
                drafts.append(drafted)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        finally:
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
    kind = speculative.config().kind
    for r in [*results, *drafts]:
        table.add_row(
            (r.label if r.label == "pool" else f"{r.label} alone")
            + (f" + {kind} (kept {r.kept}/{r.drafted})" if r in drafts else ""),
            f"{r.decode_tokens_per_s:.1f}", f"{r.prompt_tokens_per_s:.1f}",
            " + ".join(f"{x:.2f}" for x in r.stage_ms), " + ".join(f"{x:.2f}" for x in r.hop_ms) or "–",
        )  # fmt: skip
    Console(highlight=False).print(table)
    names = [a.describe() for a in pool_plan]
    print(f"predicted: {plan_.verdict}")
    if len(results) == 2:
        print(measured_verdict(results[0], results[1], names))
