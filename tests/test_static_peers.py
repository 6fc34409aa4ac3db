"""Static peers: --peer / --rpc as typed and the peers file, with errors that name the line."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from potluck.discovery.static import (
    CONFIG,
    STATIC,
    PeerAddressError,
    parse_address,
    peers_from_flags,
    read_peers_file,
    split_address,
)
from workers import Spawn
from workers import spawn_worker as spawn_worker


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("192.168.1.20:50052", "192.168.1.20:50052"),
        ("  desk.local:50060 ", "desk.local:50060"),
        ("[fd00::7]:50052", "[fd00::7]:50052"),
        ("[::1]:1", "[::1]:1"),
    ],
)
def test_parse_address(text: str, want: str) -> None:
    assert parse_address(text) == want


@pytest.mark.parametrize(
    ("text", "default", "want"),
    [("mini-pc.local", 50052, "mini-pc.local:50052"), ("fd00::7", 50052, "[fd00::7]:50052")],
)
def test_default_port(text: str, default: int, want: str) -> None:
    assert parse_address(text, default) == want


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("desk", "has no port"),
        ("desk:", "empty port"),
        (":50052", "no host"),
        ("desk:port", "not a number in 1-65535"),
        ("desk:0", "not a number in 1-65535"),
        ("desk:70000", "not a number in 1-65535"),
        ("[fd00::7:50052", "is not [IPv6 address]:port"),
        ("[nonsense]:50052", "is not an IPv6 address"),
        ("two words:1", "is not host:port"),
        ("", "is not host:port"),
        ("http://127.0.0.1:50052", "is a URL: give HOST:PORT without http:// (e.g. 127.0.0.1:"),
        ("127.0.0.1:50052:1", "has 2 colons: give HOST:PORT with one"),
        ("desk:50052:1", "has 2 colons: give HOST:PORT with one"),
        ("fd00::7:50052", "put an IPv6 address in brackets before its port (e.g. [fd00::7]:"),
        ("fd00::zz", "'fd00::zz' is not an IPv6 address"),
    ],
)
def test_bad_addresses_say_why(text: str, says: str) -> None:
    with pytest.raises(PeerAddressError, match=re.escape(says)):
        parse_address(text)


def test_flags_in_order() -> None:
    peers = peers_from_flags(["a:1", "b:2"], "c:3, d:4")
    assert [p.address for p in peers] == ["a:1", "b:2", "c:3", "d:4"]
    assert {p.source for p in peers} == {STATIC}
    assert split_address("[fd00::7]:9") == ("fd00::7", 9)


@pytest.mark.parametrize(
    ("peer", "rpc"), [(["a:1", "b:2"], "c:3, a:1"), (["b:2", "a:1", " a:1 "], None)]
)
def test_a_peer_typed_twice_is_an_error(peer: list[str], rpc: str | None) -> None:
    """Most likely a typo for another worker: merging it would hide that (and leave a
    --tensor-split one node short)."""
    with pytest.raises(PeerAddressError, match="a:1 given twice: name each worker once"):
        peers_from_flags(peer, rpc)


def test_peers_file(tmp_path: Path) -> None:
    f = tmp_path / "peers"
    f.write_text(
        "# the study\n"
        "192.168.1.20:50052\n"
        "\n"
        "   mini-pc.local      # default port\n"
        "[fd00::7]:50060  # v6\n"
        "192.168.1.20:50052\n"  # a repeat is kept once
    )
    peers = read_peers_file(f)
    assert [p.address for p in peers] == [
        "192.168.1.20:50052",
        "mini-pc.local:50052",
        "[fd00::7]:50060",
    ]
    assert {p.source for p in peers} == {CONFIG}
    assert read_peers_file(tmp_path / "absent") == []


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("desk:notaport", "line 3: 'desk:notaport': port 'notaport' is not a number in 1-65535"),
        ("desk:99999", "line 3: 'desk:99999': port '99999'"),
        ("[fd00::7", "line 3: '\\[fd00::7' is not \\[IPv6 address\\]:port"),
        ("a b:1", "line 3: 'a b:1' is not host:port"),
    ],
)
def test_peers_file_errors_name_the_line(tmp_path: Path, line: str, says: str) -> None:
    f = tmp_path / "peers"
    f.write_text(f"# ok\n10.0.0.2:50052\n{line}   # comment\n10.0.0.3\n")
    with pytest.raises(PeerAddressError, match=f"peers file {f} {says}"):
        read_peers_file(f)


def test_unreadable_peers_file(tmp_path: Path) -> None:
    f = tmp_path / "peers"
    f.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(PeerAddressError, match="cannot read the peers file"):
        read_peers_file(f)


def _potluck(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "potluck.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "POTLUCK_MDNS": "0", **env},  # nothing leaves this machine
    )


def test_cli_reports_the_bad_line(tmp_path: Path, smollm2_path: Path) -> None:
    """A bad peers file stops the command with one line naming the file and the line."""
    (tmp_path / "peers").write_text("10.0.0.2:50052\n\n10.0.0.3:http\n")
    r = _potluck("plan", "-m", str(smollm2_path), env={"POTLUCK_CONFIG": str(tmp_path)})
    assert r.returncode == 1
    said = " ".join(r.stderr.split())  # rich wraps long lines at 80 columns when not a terminal
    want = f"error: peers file {tmp_path / 'peers'} line 3: '10.0.0.3:http': port 'http' is not"
    assert want in said, r.stderr


def test_cli_bad_peer_flag(smollm2_path: Path) -> None:
    r = _potluck("plan", "-m", str(smollm2_path), "--peer", "desk:0", env={})
    assert r.returncode == 2  # a usage error, as typer reports bad options
    assert "desk:0" in r.stderr and "1-65535" in r.stderr, r.stderr


def test_cli_bad_pool_name(smollm2_path: Path) -> None:
    r = _potluck("plan", "-m", str(smollm2_path), "--pool", "my pool!", env={})
    assert r.returncode == 2
    assert "pool name 'my pool!'" in r.stderr, r.stderr


def test_cli_peer_typed_twice(smollm2_path: Path) -> None:
    r = _potluck("plan", "-m", str(smollm2_path), "--peer", "desk:1", "--rpc", "desk:1", env={})
    assert r.returncode == 2
    assert "peer desk:1 given twice" in " ".join(r.stderr.replace("│", " ").split()), r.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_tensor_split_names_the_nodes(
    spawn_worker: Spawn, tmp_path: Path, smollm2_path: Path
) -> None:
    """A worker both in the peers file and typed counts once: a --tensor-split with a share for
    each is one too long, and the error lists the nodes it counted."""
    worker = spawn_worker("--no-mdns", env={"POTLUCK_CONFIG": str(tmp_path)})
    address = worker.address
    (tmp_path / "peers").write_text(f"{address}\n")
    r = _potluck(
        "plan", "-m", str(smollm2_path), "--peer", address, "--tensor-split", "0,1,1",
        env={"POTLUCK_CONFIG": str(tmp_path)},
    )  # fmt: skip
    worker.stop(timeout=30)
    assert r.returncode == 1, r.stderr
    said = " ".join(r.stderr.split())
    want = (
        f"error: --tensor-split 0,1,1 has 3 shares but the pool has 2 nodes (this machine, "
        f"{address}; a worker found twice counts once): give one share per node"
    )
    assert want in said, r.stderr


def test_a_dead_machine_in_the_peers_file_is_left_out(
    spawn_worker: Spawn, tmp_path: Path, smollm2_path: Path
) -> None:
    """The peers file is a standing list: a laptop on it that is closed is left out with a line
    that says so, and the command goes on with the machines that answer. (A peer typed with
    --peer still fails loudly here and in run: test_pool's test_unreachable_peer; serve and batch
    leave it out too and ask it again: test_batch_api's test_serve_starts_while_a_peer_is_down...)"""
    dead = _free_port()  # nothing listens there
    worker = spawn_worker("--no-mdns", env={"POTLUCK_CONFIG": str(tmp_path)})
    port = worker.port
    (tmp_path / "peers").write_text(f"127.0.0.1:{dead}\n127.0.0.1:{port}\n")
    r = _potluck("plan", "-m", str(smollm2_path), env={"POTLUCK_CONFIG": str(tmp_path)})
    worker.stop(timeout=30)
    said = " ".join(r.stderr.split())
    assert r.returncode == 0, r.stderr
    assert f"left out 127.0.0.1:{dead} (peers file): it is in the peers file but does not" in said
    assert f"127.0.0.1:{port} (peers file)" in said and "best single machine" in r.stdout + said
