"""The commands that use a model in this terminal: `run` (one prompt), `chat`, `perplexity`;
and `models` (what is on this machine)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from potluck.cli.config import ModelFlags, PoolFlags, SamplingFlags, SpecFlags, takes
from potluck.cli.console import err
from potluck.cli.load import _drafter, _load
from potluck.cli.options import (
    BatchOpt,
    CacheRamOpt,
    CacheTypeOpt,
    CpuMoeOpt,
    DeviceOpt,
    LoraOpt,
    ModelOpt,
    NCpuMoeOpt,
    NglOpt,
    NoRepackOpt,
    PredictCheck,
    ThreadsOpt,
)
from potluck.errors import PotluckError

if TYPE_CHECKING:
    from potluck.engine.generate import Model
    from potluck.engine.scheduler import Scheduler
    from potluck.sampling import Sampler, SamplingParams


def _sampler(m: Model, params: SamplingParams) -> Sampler:
    """The run's sampler: its settings and seed (with a grammar: over the model's vocabulary;
    the scheduler makes the one that samples)."""
    from potluck.grammar import Vocabulary
    from potluck.sampling import Sampler

    return Sampler(params, Vocabulary.of(m.tokenizer) if params.grammar is not None else None)


def _stream(
    m: Model, ids: list[int], n: int, sampler: Sampler, sched: Scheduler, chat: bool = False
) -> list[int]:
    """Generate up to n tokens (-1: until the end of text or a full context) through `sched` (a
    chat's keeps the conversation cached between turns) and print text as it comes; timing on
    stderr (with the prefix reused and the drafts kept), and a line when the context filled
    (what to do: in a chat, /reset). Returns the generated ids."""
    import dataclasses

    from potluck.engine.generate import check_prompt
    from potluck.engine.scheduler import Finished, Request, TokenEvent
    from potluck.modelfile.tokenizer import StreamDecoder

    dec = StreamDecoder(m.tokenizer)
    out: list[int] = []
    t0 = time.perf_counter()
    t_first = None
    check_prompt(m, ids)
    asked = m.n_ctx if n == -1 else n
    limit = min(asked, m.n_ctx - len(ids))  # up to a full context
    params = dataclasses.replace(sampler.params, seed=sampler.seed)
    req = Request(tuple(ids), params, limit, frozenset(m.tokenizer.eot_ids))
    cached = 0
    drafted, kept = sched.stats.drafted, sched.stats.draft_kept

    def events() -> Iterator[int]:
        nonlocal cached
        for ev in sched.run_one(req):
            if isinstance(ev, TokenEvent):
                yield ev.token
            elif isinstance(ev, Finished):
                cached = ev.n_cached

    for tok in events():
        if t_first is None:
            t_first = time.perf_counter()
        out.append(tok)
        if tok in m.tokenizer.eot_ids:
            continue  # (the last token: both sources end after it)
        sys.stdout.write(dec.push(tok))
        sys.stdout.flush()
    sys.stdout.write(dec.flush() + "\n")
    t1 = time.perf_counter()
    ended = bool(out) and out[-1] in m.tokenizer.eot_ids
    if not ended and len(out) < asked and len(ids) + len(out) >= m.n_ctx:
        todo = [*(["/reset to start over"] if chat else []), *filter(None, [_more_ctx(m)])]
        err.print(
            f"stopped after {len(out)} tokens: the context of {m.n_ctx} tokens is full"
            + ("; " + ", or ".join(todo) if todo else "")
        )
    if t_first is not None:
        gen_n = max(len(out) - 1, 0)
        rate = f"{gen_n / (t1 - t_first):.1f} tok/s" if gen_n and t1 > t_first else "-"
        new = len(ids) - cached
        reused = f" ({cached} reused from the last turn, {new} computed)" if cached else ""
        drafted, kept = sched.stats.drafted - drafted, sched.stats.draft_kept - kept
        drafts = f" · drafts kept {kept} of {drafted}" if sched.drafter is not None else ""
        err.print(
            f"[dim]prompt {len(ids)} tokens{reused} in {t_first - t0:.2f} s "
            f"({new / (t_first - t0):.1f} tok/s) · generated {len(out)} tokens, {rate}{drafts}[/]"
        )
    return out


@takes
def run(
    prompt: Annotated[str, typer.Argument(help="The prompt.")],
    n_predict: Annotated[
        int,
        typer.Option(
            "-n",
            "--n-predict",
            callback=PredictCheck,
            help="Tokens to generate at most (-1: until the end of text or a full context).",
        ),
    ] = 128,
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
    *,
    flags: ModelFlags,
    net: PoolFlags,
    sampling: SamplingFlags,
    speculative: SpecFlags,
) -> None:
    """Generate text from a prompt, streaming it to stdout (over the pool's workers: found on
    mDNS, or --peer)."""
    from potluck.engine.generate import prompt_batch
    from potluck.engine.scheduler import Scheduler, SchedulerConfig

    params = sampling.params()
    splits = [int(s) for s in split.split(",")] if split else None
    m = _load(flags, net, splits=splits)
    config = SchedulerConfig(
        n_batch=prompt_batch(m, flags.batch), max_active=1, spec=speculative.config()
    )
    # the one decode loop, turned in this thread (no hand-over per token)
    sched = Scheduler(m, config, _drafter(speculative, m, flags.compute()), inline=True)
    if raw:
        ids = m.tokenizer.encode(prompt)
    else:
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        ids = m.tokenizer.encode(m.chat.render(msgs))
    try:
        _stream(m, ids, n_predict, _sampler(m, params), sched)
    finally:
        sched.close()


@takes
def chat(
    n_predict: Annotated[
        int,
        typer.Option(
            "-n",
            "--n-predict",
            callback=PredictCheck,
            help="Tokens per answer at most (-1: until the end of text or a full context).",
        ),
    ] = 512,
    system: Annotated[str | None, typer.Option("--system", help="System prompt.")] = None,
    cache_ram: CacheRamOpt = None,
    *,
    flags: ModelFlags,
    net: PoolFlags,
    sampling: SamplingFlags,
    speculative: SpecFlags,
) -> None:
    """Chat interactively with the model's chat template. Ctrl-D or /exit to leave."""
    from potluck.engine.generate import prompt_batch
    from potluck.engine.prefix import budget_bytes
    from potluck.engine.scheduler import Scheduler, SchedulerConfig

    params = sampling.params()
    m = _load(flags, net, cache_ram=cache_ram)
    sampler = _sampler(m, params)
    # one request at a time; the turn before stays cached, so a turn computes only what is new
    budget = budget_bytes(cache_ram, m.n_ctx, m.kv_bytes_per_token, m.state_bytes)
    config = SchedulerConfig(
        n_batch=prompt_batch(m, flags.batch),
        max_active=1,
        cache_bytes=budget,
        spec=speculative.config(),
    )
    sched = Scheduler(m, config, _drafter(speculative, m, flags.compute()))
    msgs: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    err.print("[dim]type a message; /exit or Ctrl-D to quit, /reset to start over[/]")
    try:
        _converse(m, sched, sampler, msgs, system, n_predict)
    finally:
        sched.close()


def _converse(
    m: Model,
    sched: Scheduler,
    sampler: Sampler,
    msgs: list[dict[str, str]],
    system: str | None,
    n_predict: int,
) -> None:
    """The chat's loop: read a line, answer it (or /reset, /exit)."""
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
            out = _stream(m, ids, n_predict, sampler, sched, chat=True)
        except PotluckError as exc:  # e.g. a pool node that failed for good: say so, keep going
            err.print(f"[red]error:[/] {exc}")
            msgs.pop()
            continue
        reply = m.tokenizer.decode([t for t in out if t not in m.tokenizer.eot_ids])
        msgs.append({"role": "assistant", "content": reply})


def _more_ctx(m: Model) -> str:
    """What raising -c can still give ('' when the context is already the model's longest)."""
    if m.n_ctx >= m.hp.n_ctx_train:
        return ""
    return f"raise -c (the model allows up to {m.hp.n_ctx_train})"


def _too_long(n_tokens: int, m: Model, history: bool) -> str:
    """Why a chat turn cannot be answered: the conversation, or this message alone, fills the
    context."""
    more = f", or {_more_ctx(m)}" if _more_ctx(m) else ""
    if history:
        return (
            f"the conversation is {n_tokens} tokens, the context {m.n_ctx}: /reset to start over"
            + more
        )
    return f"this message is {n_tokens} tokens, the context {m.n_ctx}: shorten it" + more


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
    cpu_moe: CpuMoeOpt = False,
    n_cpu_moe: NCpuMoeOpt = 0,
) -> None:
    """Perplexity over a text file, computed as llama-perplexity does (second half of each chunk)."""
    from potluck.engine.perplexity import perplexity as compute

    flags = ModelFlags(
        model, ctx, threads, ngl, device, cache_type, no_repack, lora,
        cpu_moe=cpu_moe, n_cpu_moe=n_cpu_moe,
    )  # fmt: skip
    m = _load(flags)
    text = file.read_text(encoding="utf-8", errors="replace")

    def on_chunk(i: int, n: int, ppl: float) -> None:
        err.print(f"[dim][{i}/{n}] running ppl {ppl:.4f}[/]")

    res = compute(m, text, ctx, batch, on_chunk)
    print(
        f"perplexity: {res.ppl:.4f} over {res.n_chunks} chunks of {ctx} tokens ({res.n_scored} tokens scored)"
    )


def models() -> None:
    """List the GGUF models found in Potluck's cache and the Ollama, LM Studio and HF caches."""
    from potluck.cli.runtime import places
    from potluck.modelfile.sources import find_models, search_roots

    here = places()
    found = find_models(here)
    if not found:
        roots = ", ".join(str(r) for r, _ in search_roots(here))
        err.print(
            f"no models found in {roots}; `potluck run` fetches the default model on first use"
        )
        return
    table = Table("name", "source", "size", "model", "path")
    for f in found:
        table.add_row(f.name, f.source, f"{f.size_bytes / 2**20:.1f} MiB", model_line(f.path),
                      str(f.path))  # fmt: skip
    Console().print(table)


def model_line(path: Path) -> str:
    """What the file holds (architecture, layers, parameters; experts), or why it cannot say."""
    from potluck.errors import PotluckError
    from potluck.model.archs import describe, hparams_from_metadata
    from potluck.modelfile.gguf_file import GGUFFile

    try:
        f = GGUFFile(path)
        return describe(hparams_from_metadata(f.metadata, str(path)), f.tensors)
    except PotluckError as exc:  # (a listing goes on: an unsupported file says so in its row)
        return str(exc).removeprefix(f"{path}: ")
