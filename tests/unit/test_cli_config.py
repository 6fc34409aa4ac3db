"""The CLI's option groups (cli/config.py): declared once, the same flags on every command that
takes them, read into one frozen config per group, checked before anything runs."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import typer
from typer.testing import CliRunner

from potluck.cli import app
from potluck.cli.batch import batch
from potluck.cli.bench import bench
from potluck.cli.config import ModelFlags, PeersFlags, PoolFlags, SamplingFlags, takes
from potluck.cli.finetune import finetune
from potluck.cli.pool import doctor, nodes, plan
from potluck.cli.run import chat, run
from potluck.cli.serve import serve


def _flags(group: type) -> set[str]:
    return {f.name for f in dataclasses.fields(group)}


@pytest.mark.parametrize(
    ("command", "groups"),
    [(run, (ModelFlags, PoolFlags, SamplingFlags)), (chat, (ModelFlags, PoolFlags, SamplingFlags)),
     (serve, (ModelFlags, PoolFlags)), *[(c, (PeersFlags,)) for c in (plan, nodes, doctor, batch,
     bench, finetune)]],
)  # fmt: skip
def test_each_command_offers_every_flag_of_its_groups(command, groups) -> None:
    params = inspect.signature(command).parameters
    for group in groups:
        assert _flags(group) <= params.keys(), (command.__name__, group.__name__)
        for name in _flags(group):  # keyword options, listed under the group's panel in --help
            assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
            info = params[name].annotation.__metadata__[0]
            assert info.rich_help_panel == group.PANEL


def test_a_command_receives_one_frozen_config_per_group() -> None:
    got: list[object] = []

    @takes
    def cmd(word: str = "x", *, flags: ModelFlags, net: PoolFlags) -> None:
        got.extend([word, flags, net])

    probe = typer.Typer()
    probe.command()(cmd)
    probe.command("other")(lambda: None)  # two commands: typer then takes the name
    r = CliRunner().invoke(
        probe, ["cmd", "--word", "y", "-c", "256", "--peer", "h:1", "-ts", "1,2"]
    )
    assert r.exit_code == 0, r.output
    word, flags, net = got
    assert word == "y" and flags == ModelFlags(ctx=256) and net.peer == ["h:1"]
    assert net.shares() == [1.0, 2.0] and net.mem_bytes() is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        flags.ctx = 512  # type: ignore[misc]


@pytest.mark.parametrize(
    ("argv", "says"),
    [(["--failover-timeout", "-1"], "--failover-timeout must be 0 (off) or positive"),
     (["-ts", "a,b"], "--tensor-split 'a,b' is not a list of numbers"),
     (["--mem", "lots"], "--mem 'lots': give a size like 4G"),
     (["--top-p", "2"], "top_p")],
)  # fmt: skip
def test_a_bad_flag_of_a_group_is_a_usage_error_before_anything_loads(argv, says) -> None:
    r = CliRunner().invoke(app, ["run", "hi", "-m", "/nonexistent.gguf", *argv])
    assert r.exit_code == 2, r.output
    assert says in " ".join(r.output.split()), r.output


def test_a_flag_declared_twice_is_refused() -> None:
    def cmd(ctx: int = 0, *, flags: ModelFlags) -> None: ...

    with pytest.raises(AssertionError, match="declared twice"):
        takes(cmd)
