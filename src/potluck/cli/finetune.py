"""`potluck finetune`: train a LoRA adapter here and, data parallel, on the pool's workers."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

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
    HeadMemOpt,
    ModelOpt,
    SeedOpt,
    ThreadsOpt,
    _head_mem,
    no_workers_for,
)
from potluck.cli.runtime import compute_of
from potluck.errors import PotluckError


@takes
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
    mem: HeadMemOpt = None,
    *,
    net: PeersFlags,
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
    from potluck.cli.runtime import places
    from potluck.model.archs import hparams_from_metadata, training_refusal
    from potluck.modelfile.chat import ChatTemplate
    from potluck.modelfile.gguf_file import GGUFFile
    from potluck.modelfile.sources import resolve_model
    from potluck.modelfile.tokenizer import Tokenizer
    from potluck.node.probe import usable_memory_bytes
    from potluck.train.data import read_examples
    from potluck.train.loop import (
        CHECKPOINT_SUFFIX,
        StepReport,
        TrainConfig,
        Trainer,
        memory_needed,
        run,
    )
    from potluck.train.model import DEFAULT_TARGETS

    torch.set_num_threads(compute_of(threads).n_threads)
    wanted = tuple(t.strip() for t in targets.split(",") if t.strip())
    if bad := [t for t in wanted if t not in DEFAULT_TARGETS]:
        raise typer.BadParameter(
            f"--targets {', '.join(bad)}: not a matrix of this model family; use some of "
            f"{','.join(DEFAULT_TARGETS)}"
        )
    here = places()
    path = resolve_model(model, here)
    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata, str(path))
    if why := training_refusal(hp):
        raise PotluckError(f"{path}: {why}")
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
    addresses = net.found()
    from potluck.train.pool import PoolTrainer

    if addresses:
        from potluck.transport.client import NodeClient

        auth = net.auth()

        def on_event(text: str) -> None:
            err.print(f"[yellow]{text}[/]")

        trainer: Trainer = PoolTrainer(
            hp, f, examples, config, evals, addresses, lambda a: NodeClient(a, auth),
            _head_mem(mem) != 0, on_event, here.cache,
        )  # fmt: skip
    else:
        if _head_mem(mem) == 0:
            raise no_workers_for("the training")
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

        def on_step(r: StepReport) -> None:
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
