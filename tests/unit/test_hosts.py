"""One loopback check (potluck/hosts.py) for every place that lets loopback go without a secret
or an API key: IPv4 and IPv6 loopback alike, anything else (every interface included) not."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from potluck.hosts import is_loopback


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "::1%lo", "::ffff:127.0.0.1", "localhost"]
)
def test_loopback_addresses(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize(
    "host", ["0.0.0.0", "::", "[::]", "10.0.0.2", "192.168.1.20", "fd00::7", "::ffff:10.0.0.2",
             "no-such-host.invalid", ""],
)  # fmt: skip
def test_other_addresses(host: str) -> None:
    assert not is_loopback(host)


def test_every_command_asks_the_same_check() -> None:
    import potluck.api.server
    import potluck.cli.worker
    import potluck.discovery.pool

    for module in (potluck.api.server, potluck.cli.worker, potluck.discovery.pool):
        assert module.is_loopback is is_loopback, module.__name__


def test_serve_on_ipv6_loopback_needs_no_api_key(tmp_path: object) -> None:
    """`serve --host ::1` passes the API-key check (it used to demand a key) and goes on to the
    model, which does not exist here: that error, not the key's, ends it."""
    env = {k: v for k, v in os.environ.items() if k != "POTLUCK_API_KEY"}
    r = subprocess.run(
        [sys.executable, "-m", "potluck.cli", "serve", "--host", "::1", "--port", "0",
         "-m", f"{tmp_path}/absent.gguf"],
        capture_output=True, text=True, timeout=60, env={**env, "COLUMNS": "300"},
    )  # fmt: skip
    assert r.returncode == 1
    assert "API key" not in r.stderr and "absent.gguf" in r.stderr, r.stderr
