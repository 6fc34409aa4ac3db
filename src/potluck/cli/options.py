"""The command line's shared flags: their declarations (`...Opt`, as typer's `Annotated`
types) and the checks that turn what was typed into values, each failing with a one-line
usage error that names the flag.

Flags keep llama.cpp's meaning: -m model, -n tokens to generate, -c context, -t threads, -b batch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from potluck.errors import PotluckError

if TYPE_CHECKING:
    from potluck.sampling import SamplingParams

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


def _at_least(
    low: float, special: tuple[int, str] | None = None
) -> Callable[[typer.CallbackParam, float | None], float | None]:
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


CpuMoeOpt = Annotated[
    bool,
    typer.Option(
        "--cpu-moe",
        help="A mixture of experts: every layer's routed experts stay in RAM, its attention, KV "
        "cache and shared expert go to the GPU (-ngl) (llama.cpp's --cpu-moe).",
    ),
]
EVERY_LAYER = 1 << 30  # --cpu-moe as a layer count: more than any model has


def cpu_moe_layers(cpu_moe: bool, n_cpu_moe: int) -> int:
    """--cpu-moe / --n-cpu-moe N as one count: the first N layers keep their experts in RAM."""
    return EVERY_LAYER if cpu_moe else n_cpu_moe


NCpuMoeOpt = Annotated[
    int,
    typer.Option(
        "--n-cpu-moe",
        min=0,
        help="As --cpu-moe for the first N layers only (llama.cpp's --n-cpu-moe).",
    ),
]


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


def _failover(seconds: float) -> float:
    """0 = no re-plan, but a node silent for OFF_TIMEOUT_S still ends the request (never a hang)."""
    if not seconds >= 0:
        raise typer.BadParameter(f"--failover-timeout must be 0 (off) or positive, got {seconds}")
    return seconds


SplitOpt = Annotated[
    str | None,
    typer.Option(
        "--tensor-split", "-ts", help="Share of the layers per node, this machine first, e.g. 6,4."
    ),
]


def _shares(text: str | None) -> list[float]:
    try:
        return [float(x) for x in text.split(",")] if text else []
    except ValueError:
        raise typer.BadParameter(
            f"--tensor-split {text!r} is not a list of numbers like 6,4"
        ) from None


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


CacheRamOpt = Annotated[
    int | None,
    typer.Option(
        "--cache-ram",
        min=0,
        help="MiB of KV cache kept for finished conversations, so that a request that begins "
        "with one (the next turn of a chat) computes only what is new (0: off; default: one "
        "full context's worth). Planned like -np's caches.",
    ),
]


SpecTypeOpt = Annotated[
    str,
    typer.Option(
        "--spec-type",
        help="Speculative decoding: none; ngram-simple (drafts what followed the last few "
        "tokens earlier on: quoting, editing, code); draft-simple (a small model, -md). The "
        "output is the same; a step checks several tokens at once.",
    ),
]

ModelDraftOpt = Annotated[
    str | None,
    typer.Option(
        "-md",
        "--model-draft",
        help="A small model with the same vocabulary that drafts for --spec-type draft-simple "
        "(run on this machine).",
    ),
]

EmbeddingModelOpt = Annotated[
    str | None,
    typer.Option(
        "--embedding-model",
        help="An embedding model (GGUF path or a name from `potluck models`) served beside the "
        "model on /v1/embeddings, run on this machine.",
    ),
]

DraftMaxOpt = Annotated[
    int,
    typer.Option("--spec-draft-n-max", min=1, help="Drafted tokens per step at most."),
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


GrammarOpt = Annotated[
    str | None,
    typer.Option("--grammar", help="Constrain the answer to a GBNF grammar (llama.cpp's)."),
]


GrammarFileOpt = Annotated[
    Path | None,
    typer.Option("--grammar-file", help="Constrain the answer to the GBNF grammar in this file."),
]


JsonSchemaOpt = Annotated[
    str | None,
    typer.Option(
        "-j",
        "--json-schema",
        help="Constrain the answer to JSON that validates against this schema.",
    ),
]


def _sampling(
    temp: float,
    top_k: int,
    top_p: float,
    min_p: float,
    repeat_penalty: float,
    seed: int | None,
    grammar: str | None = None,
    grammar_file: Path | None = None,
    json_schema: str | None = None,
) -> SamplingParams:
    from potluck.sampling import SamplingParams

    try:
        return SamplingParams(
            temperature=temp,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
            seed=seed,
            grammar=_grammar(grammar, grammar_file, json_schema),
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _grammar(text: str | None, path: Path | None, schema: str | None) -> str | None:
    """llguidance's grammar for --grammar / --grammar-file / --json-schema (one of them)."""
    from potluck.grammar import GrammarError, gbnf_grammar, json_schema_grammar

    given = [name for name, v in (("--grammar", text), ("--grammar-file", path),
                                  ("--json-schema", schema)) if v is not None]  # fmt: skip
    if len(given) > 1:
        raise typer.BadParameter(f"{' and '.join(given)} both constrain the answer: give one")
    try:
        if path is not None:
            try:
                text = path.read_text(encoding="utf-8")
            except OSError as exc:
                raise typer.BadParameter(f"--grammar-file {path}: {exc.strerror}") from None
        if text is not None:
            return gbnf_grammar(text)
        if schema is not None:
            try:
                return json_schema_grammar(json.loads(schema))
            except json.JSONDecodeError as exc:
                raise typer.BadParameter(f"--json-schema is not JSON: {exc}") from None
    except GrammarError as exc:
        raise typer.BadParameter(f"{given[0]}: {exc}") from None
    return None


JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def no_workers_for(what: str) -> PotluckError:
    """--mem 0 (nothing on this machine) with no worker found (or none that answers, the ones
    left out said above): `what` would run nowhere."""
    return PotluckError(
        f"--mem 0 keeps {what} off this machine, and no worker was found that answers: name "
        "them with --peer HOST:PORT (or start `potluck worker` on them)"
    )
