"""Option groups: the flags that several commands share, declared once, read into one frozen
config each when the command starts.

A group is a frozen dataclass whose fields are flags (`Annotated[type, typer.Option(...)]`, with
their defaults). A command names a group as the type of one of its parameters and is wrapped by
`@takes`: the group's flags then appear in its `--help` after its own, and the command receives
one instance, checked in `__post_init__` (a one-line usage error that names the flag).

    @takes
    def run(prompt: ..., *, flags: ModelFlags, net: PoolFlags, sampling: SamplingFlags) -> None

run, chat and serve share ModelFlags and PoolFlags; run and chat share SamplingFlags; the other
commands that find workers (plan, nodes, doctor, batch, bench, finetune) take PeersFlags, the
part of PoolFlags they all need.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, TypeVar

import typer

from potluck.cli.options import (
    DEFAULT_POOL,
    CacheTypeOpt,
    CpuMoeOpt,
    CtxOpt,
    DeviceOpt,
    DraftMaxOpt,
    FailoverOpt,
    GrammarFileOpt,
    GrammarOpt,
    HeadMemOpt,
    JsonSchemaOpt,
    LoraOpt,
    MinPOpt,
    ModelDraftOpt,
    ModelOpt,
    NCpuMoeOpt,
    NglOpt,
    NoMdnsOpt,
    NoRepackOpt,
    PeerOpt,
    PoolOpt,
    PromptBatchOpt,
    RepeatOpt,
    RpcOpt,
    SecretOpt,
    SeedOpt,
    SpecTypeOpt,
    SplitOpt,
    TempOpt,
    ThreadsOpt,
    TlsOpt,
    TopKOpt,
    TopPOpt,
    WireOpt,
    _failover,
    _head_mem,
    _sampling,
    _shares,
    cpu_moe_layers,
)
from potluck.engine.spec import DEFAULT_DRAFT_MAX, SpecConfig

if typing.TYPE_CHECKING:
    from potluck.discovery.pool import PeerFinder
    from potluck.model.stage import Compute
    from potluck.sampling import SamplingParams
    from potluck.transport.auth import PoolAuth


@dataclass(frozen=True)
class ModelFlags:
    """Which model, and how this machine computes it."""

    PANEL: ClassVar[str] = "The model"

    model: ModelOpt = None
    ctx: CtxOpt = None
    threads: ThreadsOpt = None
    ngl: NglOpt = 0
    device: DeviceOpt = None
    cache_type: CacheTypeOpt = "f16"
    no_repack: NoRepackOpt = False
    lora: LoraOpt = None
    batch: PromptBatchOpt = None
    cpu_moe: CpuMoeOpt = False
    n_cpu_moe: NCpuMoeOpt = 0

    def compute(self) -> Compute:
        """This machine's compute settings from these flags (threads: physical cores by default;
        the GPU checked now)."""
        from potluck.cli.runtime import compute_of

        return compute_of(
            self.threads, self.cache_type, self.no_repack, self.ngl, self.device,
            n_cpu_moe=cpu_moe_layers(self.cpu_moe, self.n_cpu_moe),
        )  # fmt: skip


@dataclass(frozen=True)
class PeersFlags:
    """Which workers, and how this machine proves it belongs to their pool."""

    PANEL: ClassVar[str] = "The pool"

    peer: PeerOpt = None
    rpc: RpcOpt = None
    pool: PoolOpt = DEFAULT_POOL
    no_mdns: NoMdnsOpt = False
    secret: SecretOpt = None
    tls: TlsOpt = False

    def auth(self) -> PoolAuth:
        from potluck.cli.peers import _auth

        return _auth(self.secret, self.tls)

    def finder(self, no_mdns: bool = False, keep_asking: bool = False) -> PeerFinder:
        """The static peers and (unless --no-mdns or no_mdns) an mDNS browse that starts now.
        keep_asking: a --peer that does not answer is left out and asked again (serve, batch),
        instead of failing the command (cli/peers.py's `_peers`)."""
        from potluck.cli.peers import _peers

        return _peers(self.peer, self.rpc, self.pool, self.no_mdns or no_mdns, keep_asking)

    def found(self, finder: PeerFinder | None = None) -> list[str]:
        """The workers of the pool that answer and admit this machine (said on stderr)."""
        from potluck.cli.peers import _found

        return _found(finder or self.finder(), self.auth)


@dataclass(frozen=True)
class PoolFlags(PeersFlags):
    """The pool's flags for a command that runs a model over it: also how its layers are shared
    and carried (run, chat, serve)."""

    tensor_split: SplitOpt = None
    mem: HeadMemOpt = None
    failover_timeout: FailoverOpt = 5.0
    wire_dtype: WireOpt = "f32"

    def __post_init__(self) -> None:  # checked now, before anything is found or loaded
        _failover(self.failover_timeout)
        self.shares()
        self.mem_bytes()

    def shares(self) -> list[float]:
        """--tensor-split as numbers ([] when not given)."""
        return _shares(self.tensor_split)

    def mem_bytes(self) -> int | None:
        """--mem in bytes (0: no layers on this machine); None: what is free."""
        return _head_mem(self.mem)


@dataclass(frozen=True)
class SamplingFlags:
    """How the next token is picked (run, chat; serve takes these per request)."""

    PANEL: ClassVar[str] = "Sampling"

    temp: TempOpt = 0.8
    top_k: TopKOpt = 40
    top_p: TopPOpt = 0.95
    min_p: MinPOpt = 0.05
    repeat_penalty: RepeatOpt = 1.0
    seed: SeedOpt = None
    grammar: GrammarOpt = None
    grammar_file: GrammarFileOpt = None
    json_schema: JsonSchemaOpt = None

    def __post_init__(self) -> None:
        self.params()

    def params(self) -> SamplingParams:
        return _sampling(
            self.temp, self.top_k, self.top_p, self.min_p, self.repeat_penalty, self.seed,
            self.grammar, self.grammar_file, self.json_schema,
        )  # fmt: skip


@dataclass(frozen=True)
class SpecFlags:
    """Speculative decoding (run, chat, serve): llama.cpp's flags."""

    PANEL: ClassVar[str] = "Speculative decoding"

    spec_type: SpecTypeOpt = "none"
    model_draft: ModelDraftOpt = None
    spec_draft_n_max: DraftMaxOpt = DEFAULT_DRAFT_MAX

    def __post_init__(self) -> None:
        self.config()

    def config(self) -> SpecConfig:
        kind = self.spec_type
        if self.model_draft is not None and kind == "none":
            kind = "draft-simple"  # -md alone: drafts from that model, as llama.cpp
        if kind == "draft-simple" and self.model_draft is None:
            raise typer.BadParameter("--spec-type draft-simple needs a draft model: -md FILE")
        if kind == "ngram-simple" and self.model_draft is not None:
            raise typer.BadParameter(
                "-md is the draft model of --spec-type draft-simple; ngram-simple drafts "
                "without one (give one of them)"
            )
        try:
            return SpecConfig(kind, n_max=self.spec_draft_n_max)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None


GROUPS = (ModelFlags, PeersFlags, PoolFlags, SamplingFlags, SpecFlags)


def _in_panel(flag: Any, panel: str) -> Any:
    """The flag's declaration, listed under `panel` in --help."""
    kind, *meta = typing.get_args(flag)
    info = copy.copy(meta[0])
    info.rich_help_panel = panel
    return Annotated[kind, info, *meta[1:]]


F = TypeVar("F", bound=Callable[..., Any])


def takes(command: F) -> F:
    """The command with each parameter typed as a group replaced by that group's flags (keyword
    options after the command's own), and called with one instance of the group."""
    hints = typing.get_type_hints(command, include_extras=True)
    own = inspect.signature(command).parameters.values()
    groups = {p.name: hints[p.name] for p in own if hints.get(p.name) in GROUPS}
    params = [p.replace(annotation=hints[p.name]) for p in own if p.name not in groups]
    for group in groups.values():
        flags = typing.get_type_hints(group, include_extras=True)
        for f in dataclasses.fields(group):
            params.append(
                inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                  annotation=_in_panel(flags[f.name], group.PANEL))
            )  # fmt: skip
    names = [p.name for p in params]
    clash = {n for n in names if names.count(n) > 1}
    assert not clash, f"{command.__name__}: flags declared twice: {clash}"

    @functools.wraps(command)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        for name, group in groups.items():
            kwargs[name] = group(**{f.name: kwargs.pop(f.name) for f in dataclasses.fields(group)})
        return command(*args, **kwargs)

    signature = inspect.Signature(params)
    wrapped.__signature__ = signature  # type: ignore[attr-defined]  # what typer reads
    wrapped.__annotations__ = {p.name: p.annotation for p in params}
    return typing.cast(F, wrapped)
