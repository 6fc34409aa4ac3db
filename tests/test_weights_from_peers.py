"""Weights from whoever has them: a worker without the model file receives its layers from a peer
of the pool that has it (GetTensors), and from the head only what no peer sent.

Real worker processes on loopback; the "machines without the file" are workers with an empty cache
folder. The broken link is a real TCP connection that a proxy cuts in the middle of the transfer.
"""

from __future__ import annotations

import hashlib
import re
import time
from pathlib import Path

import grpc

from cut_proxy import CutProxy
from potluck.engine.contract import LOCAL, Assignment
from potluck.engine.generate import generate
from potluck.model.archs import hparams_from_metadata
from potluck.model.layout import stage_tensor_names
from potluck.modelfile.gguf_file import GGUFFile
from potluck.pool.build import load_model
from potluck.sampling import GREEDY, Sampler
from potluck.transport import potluck_pb2 as pb
from potluck.transport import potluck_pb2_grpc as pb_grpc
from potluck.transport.codec import PROTOCOL_VERSION
from test_pool import _cli, _single
from workers import Spawn
from workers import spawn_worker as spawn_worker

PROMPT = "The capital of France is"


def _bare(path: Path) -> dict[str, str]:
    """A worker on a machine that never had the model: an empty cache, no other model folder."""
    path.mkdir()
    return {"POTLUCK_CACHE": str(path), "HOME": str(path)}


def _stage_bytes(model: Path, start: int, stop: int) -> int:
    f = GGUFFile(model)
    hp = hparams_from_metadata(f.metadata)
    return sum(
        f.tensors[n].nbytes for n in stage_tensor_names(f.tensors.values(), hp.n_layer, start, stop)
    )


def _blob_bytes(cache: Path) -> int:
    return sum(p.stat().st_size for p in (cache / "blobs").iterdir() if p.is_file())


def _greedy(assignments: list[Assignment], model: Path, seen: list) -> tuple[list[int], dict]:
    m = load_model(
        model, n_ctx=128, assignments=assignments, failover_s=None,
        on_transfer=lambda *a: seen.append(a),
    )  # fmt: skip
    try:
        ids = m.tokenizer.encode(m.chat.render([{"role": "user", "content": PROMPT}]))
        return list(generate(m, ids, 8, Sampler(GREEDY))), dict(m.pipeline.held)
    finally:
        m.close()


def test_a_node_without_the_file_gets_its_layers_from_a_peer(
    spawn_worker: Spawn, smollm2_path: Path, tmp_path: Path
) -> None:
    """B lacks the file and is told to ask C (no file either: it says so) and then A (has it):
    every byte of B's layers comes from A, exactly its layers' bytes, none from the head; the
    pool then computes what one process computes."""
    a = spawn_worker()  # finds SmolLM2 in the shared model cache
    b = spawn_worker(env=_bare(tmp_path / "b"))
    c = spawn_worker(env=_bare(tmp_path / "c"))
    addr_a, addr_b, addr_c = a.address, b.address, c.address
    plan = [
        Assignment(LOCAL, 0, 10), Assignment(addr_a, 10, 20),
        Assignment(addr_b, 20, 30, sources=(addr_c, addr_a)),
    ]  # fmt: skip
    seen: list = []
    got, held = _greedy(plan, smollm2_path, seen)
    logs = {name: w.stop() for name, w in (("a", a), ("b", b), ("c", c))}
    assert got == _single(smollm2_path, PROMPT, 8)
    assert seen == [], "the head sent tensors although a peer had them"
    stage = _stage_bytes(smollm2_path, 20, 30)
    assert held[addr_b].pulled_from == addr_a
    assert held[addr_b].pulled_bytes == stage
    assert _blob_bytes(tmp_path / "b") == stage  # exactly its layers crossed, nothing more
    assert f"peer {addr_c} did not send them" in logs["b"] and "does not have model" in logs["b"]
    assert f"from peer {addr_a}: received" in logs["b"]
    assert "sending" in logs["a"] and f"{stage / 2**20:.1f} MiB" in logs["a"], logs["a"]
    assert not (tmp_path / "c" / "blobs").exists() or _blob_bytes(tmp_path / "c") == 0


def test_a_pull_cut_in_the_middle_is_finished_by_the_head(
    spawn_worker: Spawn, smollm2_path: Path, tmp_path: Path
) -> None:
    """The link from the peer breaks 6 MiB into B's transfer: B keeps what arrived (whole tensors
    and the part of the one in flight) and the head sends only the rest; the blobs pass their
    hashes and the pool computes what one process computes."""
    a, b = spawn_worker(), spawn_worker(env=_bare(tmp_path / "b"))
    addr_b = b.address
    cut = 6 << 20
    with CutProxy(a.address, cut_after=cut) as link:
        plan = [Assignment(LOCAL, 0, 15), Assignment(addr_b, 15, 30, sources=(link.address,))]
        seen: list = []
        got, held = _greedy(plan, smollm2_path, seen)
        assert link.cut.is_set()
    log_a, log_b = a.stop(), b.stop()
    assert got == _single(smollm2_path, PROMPT, 8)
    stage = _stage_bytes(smollm2_path, 15, 30)
    assert f"peer {link.address} did not send them" in log_b, log_b
    assert held[addr_b].pulled_bytes == 0
    sent_by_head = seen[-1][2]
    kept = stage - sent_by_head  # what came through the link before it broke
    assert 0 < kept <= cut, (kept, cut)  # (gRPC framing: less than the raw bytes that crossed)
    assert _blob_bytes(tmp_path / "b") == stage
    assert not list((tmp_path / "b" / "blobs").glob(".part-*"))
    assert log_a.count("sending") == 1


def _hello_models(address: str) -> list[str]:
    with grpc.insecure_channel(address) as channel:
        hello = pb_grpc.NodeStub(channel).Hello(
            pb.HelloRequest(protocol_version=PROTOCOL_VERSION), timeout=10
        )
    return list(hello.model_sha256)


def test_the_plan_says_which_workers_have_the_file(
    spawn_worker: Spawn, smollm2_path: Path, tmp_path: Path
) -> None:
    """A worker given the model's folder (--model-dir) hashes its files once, in the background,
    and its Hello names them; a bare worker names none. `potluck plan` says that the first maps
    its own copy and that the second receives its layers' bytes, from whom, and how long that
    takes at most."""
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / smollm2_path.name).symlink_to(smollm2_path)
    a = spawn_worker("--model-dir", str(folder), env=_bare(tmp_path / "a")).address
    b = spawn_worker(env=_bare(tmp_path / "b")).address
    digest = hashlib.sha256(smollm2_path.read_bytes()).hexdigest()
    deadline = time.monotonic() + 60
    while digest not in (named := _hello_models(a)) and time.monotonic() < deadline:
        time.sleep(0.5)  # (until the background hashing ends)
    assert named == [digest]
    assert _hello_models(b) == []
    done = _cli(
        "plan", "-m", str(smollm2_path), "--peer", a, "--peer", b, "-c", "256",
        "--tensor-split", "1,1,1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [x for x in done.stdout.splitlines() if x.startswith("weights:")]
    assert lines[0] == f"weights: {a} maps its own copy of the file", done.stdout
    # from a (the holder, asked first) unless the head's link measured much faster than a's
    got = re.fullmatch(
        rf"weights: {b} receives ([\d.]+) MiB from (\S+|this machine), ≤ .*", lines[1]
    )
    assert got is not None, lines
    assert got[2] in (a, "this machine")
    assert float(got[1]) == round(_stage_bytes(smollm2_path, 20, 30) / 2**20, 1)
