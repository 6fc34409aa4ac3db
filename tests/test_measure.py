"""`potluck bench`'s measurements and its measured verdict."""

from __future__ import annotations

from pathlib import Path

import pytest

from potluck.engine.measure import Measured, measure, measured_verdict
from potluck.pool.build import load_model
from workers import Spawn
from workers import spawn_worker as spawn_worker


def _m(label: str, tok_s: float, stage: tuple[float, ...], hop: tuple[float, ...] = ()) -> Measured:
    return Measured(label, tok_s, 100.0, stage, hop)


def test_verdict_worth_it() -> None:
    v = measured_verdict(_m("this machine", 10, (100,)), _m("pool", 13, (40, 35), (1, 1)), [])
    assert v.endswith("pooling is worth it") and "(1.30×)" in v


def test_verdict_blames_the_network() -> None:
    v = measured_verdict(_m("this machine", 100, (10,)), _m("pool", 50, (5, 5), (6, 4)), [])
    assert "use this machine alone" in v and "the network: 10.0 of every 20.0 ms" in v


def test_verdict_blames_the_slowest_stage() -> None:
    single = _m("10.0.0.2:50052", 100, (10,))
    pool = _m("pool", 70, (2.5, 11.0), (0.5, 0.3))
    v = measured_verdict(single, pool, ["this machine", "10.0.0.3:50052"])
    assert "use 10.0.0.2:50052 alone" in v
    assert "the slowest stage: 10.0.0.3:50052 needs 11.0 ms per token" in v


def test_measure_local_and_pool(spawn_worker: Spawn, smollm2_path: Path) -> None:
    worker = spawn_worker()
    single = measure(load_model(smollm2_path, n_ctx=128), "this machine", 8, 16)
    pool = measure(load_model(smollm2_path, n_ctx=128, peers=[worker.address]), "pool", 8, 16)
    worker.stop()
    assert single.decode_tokens_per_s > 0 and single.prompt_tokens_per_s > 0
    assert len(single.stage_ms) == 1 and single.hop_ms == ()
    assert len(pool.stage_ms) == 2 and len(pool.hop_ms) == 1  # this machine → the worker
    assert all(ms > 0 for ms in pool.stage_ms) and all(ms >= 0 for ms in pool.hop_ms)
    with pytest.raises(ValueError, match="needs 130 positions but the context is 128"):
        measure(load_model(smollm2_path, n_ctx=128), "x", 1, 128)


def test_bench_command(spawn_worker: Spawn, smollm2_path: Path) -> None:
    import os
    import subprocess
    import sys

    worker = spawn_worker()
    addr = worker.address
    done = subprocess.run(
        [sys.executable, "-m", "potluck.cli", "bench", "-m", str(smollm2_path), "-c", "256",
         "-n", "8", "-p", "16", "--peer", addr, "--tensor-split", "1,1"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "POTLUCK_MDNS": "0", "COLUMNS": "200"},
    )  # fmt: skip
    worker.stop()
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert " alone " in out and "│ pool " in out and "decode tok/s" in out
    assert out.splitlines()[-1].startswith("measured: pool ")
    assert "predicted: " in out
    alone = subprocess.run(
        [sys.executable, "-m", "potluck.cli", "bench", "-m", str(smollm2_path), "--no-mdns"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "POTLUCK_MDNS": "0"},
    )  # fmt: skip
    assert alone.returncode == 1 and "no workers to compare with" in alone.stderr
