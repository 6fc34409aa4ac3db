"""A pool of real worker processes on loopback: the pipeline invariant across processes and
sockets, weights shipped to a worker that lacks the file, and the errors a user can hit.

(The workers are separate OS processes on 127.0.0.1 standing in for separate machines.)
"""

from __future__ import annotations

import functools
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from potluck.engine.generate import generate
from potluck.model.stage import SeqChunk
from potluck.pool.build import load_model
from potluck.sampling import GREEDY, Sampler, SamplingParams
from potluck.transport import potluck_pb2 as pb
from potluck.transport import potluck_pb2_grpc as pb_grpc
from potluck.transport.client import NodeError
from workers import Spawn, Worker
from workers import spawn_module_worker as spawn_module_worker
from workers import spawn_worker as spawn_worker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def worker_pair(
    spawn_module_worker: Spawn, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Worker]]:
    """Two workers: the first finds the model in the shared cache, the second has an empty cache
    (as on a machine that never downloaded it), so the head ships it only its layers' tensors."""
    empty = tmp_path_factory.mktemp("empty-cache")
    pair = [
        spawn_module_worker(),
        spawn_module_worker(env={"POTLUCK_CACHE": str(empty), "HOME": str(empty)}),
    ]
    yield pair
    for w in pair:  # (before the check below: the shipped blobs are then all written)
        w.stop()
    empty_blobs = empty / "blobs"
    assert empty_blobs.is_dir() and any(empty_blobs.iterdir()), (
        "no tensors were shipped to the bare worker"
    )


@pytest.fixture(scope="module")
def workers(worker_pair: list[Worker]) -> list[str]:
    """The pair's addresses."""
    return [w.address for w in worker_pair]


def _single(path: Path, prompt: str, n: int, params: SamplingParams = GREEDY) -> list[int]:
    """One process's tokens for `prompt`, the reference a pool must equal."""
    return list(_reference(path, prompt, n, params))


@functools.cache  # (one reference per module run: several tests compare against the same one)
def _reference(path: Path, prompt: str, n: int, params: SamplingParams) -> tuple[int, ...]:
    m = load_model(path, n_ctx=256)
    ids = m.tokenizer.encode(m.chat.render([{"role": "user", "content": prompt}]))
    return tuple(generate(m, ids, n, Sampler(params)))


# greedy decoding is causal: one process's first k tokens of 16 are its tokens for -n k
PLANETS_16 = ("Name three planets.", 16)


@pytest.mark.parametrize("shares", [None, "1,2,1", "0.5,1,1"])
def test_pool_equals_single_process_smollm2(
    workers: list[str], smollm2_path: Path, shares: str | None
) -> None:
    want = _single(smollm2_path, *PLANETS_16)
    split = [float(x) for x in shares.split(",")] if shares else ()
    pool = load_model(smollm2_path, n_ctx=256, peers=workers, tensor_split=split)
    ids = pool.tokenizer.encode(
        pool.chat.render([{"role": "user", "content": "Name three planets."}])
    )
    assert list(generate(pool, ids, 16, Sampler(GREEDY))) == want
    pool.close()  # (frees its stages: a later head's Load would wait out their LIVE_S)
    stage_ms = pool.pipeline.last_stage_ms
    assert len(stage_ms) == 3 and all(ms > 0 for ms in stage_ms)
    if shares is None:  # prompts over a pool go in micro-batches that overlap in the stages
        from potluck.engine.generate import DEFAULT_N_BATCH, POOL_N_BATCH, prompt_batch

        assert prompt_batch(pool) == POOL_N_BATCH < DEFAULT_N_BATCH
        assert prompt_batch(pool, 64) == 64
        assert prompt_batch(load_model(smollm2_path, n_ctx=64)) == DEFAULT_N_BATCH


@pytest.mark.parametrize("split", ["1,1,2", "3 remote"])
def test_pool_equals_single_process_gemma3(
    workers: list[str], spawn_worker: Spawn, gemma3_path: Path, split: str
) -> None:
    """This machine and two workers (one without the file), or three workers and no layer here
    (the first node gets token ids, the last samples)."""
    from potluck.engine.contract import Assignment

    want = _single(gemma3_path, "Name three planets.", 12)
    if split == "3 remote":
        plan = [
            Assignment(workers[0], 0, 5),
            Assignment(workers[1], 5, 11),
            Assignment(spawn_worker().address, 11, 18),
        ]
        pool = load_model(gemma3_path, n_ctx=256, assignments=plan)
    else:
        shares = [float(x) for x in split.split(",")]
        pool = load_model(gemma3_path, n_ctx=256, peers=workers, tensor_split=shares)
    try:
        ids = pool.tokenizer.encode(
            pool.chat.render([{"role": "user", "content": "Name three planets."}])
        )
        assert list(generate(pool, ids, 12, Sampler(GREEDY))) == want
    finally:
        pool.close()


def test_seeded_sampling_through_pool(workers: list[str], smollm2_path: Path) -> None:
    """The last stage rebuilds the head's sampler from its parameters and seed: same draws."""
    params = SamplingParams(
        temperature=1.2, top_k=50, top_p=0.9, min_p=0.0, repeat_penalty=1.1, seed=1234
    )
    want = _single(smollm2_path, "Tell me a story.", 16, params)
    pool = load_model(smollm2_path, n_ctx=256, peers=workers)
    ids = pool.tokenizer.encode(pool.chat.render([{"role": "user", "content": "Tell me a story."}]))
    assert list(generate(pool, ids, 16, Sampler(params))) == want
    pool.close()


def test_prompt_in_micro_batches_through_pool(workers: list[str], smollm2_path: Path) -> None:
    m = load_model(smollm2_path, n_ctx=256)
    ids = m.tokenizer.encode("The history of astronomy is long. " * 8)
    want = list(generate(m, ids, 8, Sampler(GREEDY)))
    pool = load_model(smollm2_path, n_ctx=256, peers=workers)
    assert list(generate(pool, ids, 8, Sampler(GREEDY), n_batch=16)) == want
    pool.close()


def test_unreachable_peer(smollm2_path: Path) -> None:
    port = _free_port()  # nothing listens there
    with pytest.raises(
        NodeError,
        match=rf"node 127.0.0.1:{port} is unreachable .* is `potluck worker` running there",
    ):
        load_model(smollm2_path, n_ctx=256, peers=[f"127.0.0.1:{port}"])


def test_a_peer_that_never_answers_says_how_long_it_waited() -> None:
    """A port where something accepts connections and never speaks (a hung process, another
    program): the call ends at its deadline, and the line says how long that was."""
    from potluck.transport.client import NodeClient

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        addr = f"127.0.0.1:{srv.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(NodeError, match=rf"node {addr} did not answer within 1.5 s: .* hung"):
            NodeClient(addr).hello(timeout=1.5)
        assert time.monotonic() - t0 < 10


def test_malformed_calls_rejected_worker_stays_up(workers: list[str], smollm2_path: Path) -> None:
    stub = pb_grpc.NodeStub(grpc.insecure_channel(workers[0]))
    with pytest.raises(grpc.RpcError) as bad_version:
        stub.Hello(pb.HelloRequest(protocol_version=999), timeout=5)
    assert bad_version.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "protocol version 999" in bad_version.value.details()
    with pytest.raises(grpc.RpcError) as unknown_plan:
        stub.Forward(pb.ForwardRequest(plan_id="nope"), timeout=5)
    assert unknown_plan.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    pool = load_model(smollm2_path, n_ctx=256, peers=workers[:1])
    plan_id = pool.pipeline.plan_id
    bad = pb.Tensor(data=b"\x00" * 12, shape=[2, 576], dtype="float32")  # 12 bytes for 1152 floats
    with pytest.raises(grpc.RpcError) as short:
        stub.Forward(
            pb.ForwardRequest(plan_id=plan_id, chunks=[pb.SeqChunk(seq_id=1, n=2)], input=bad),
            timeout=5,
        )
    assert (
        short.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "needs 4,608 bytes, got 12" in short.value.details()
    )
    weird = pb.Tensor(data=b"", shape=[0], dtype="complex128")
    with pytest.raises(grpc.RpcError) as dtype:
        stub.Forward(
            pb.ForwardRequest(plan_id=plan_id, chunks=[pb.SeqChunk(seq_id=1, n=1)], input=weird),
            timeout=5,
        )
    assert "dtype 'complex128' is not one of" in dtype.value.details()
    ok = pb.Tensor(data=b"\x00" * 4 * 576, shape=[1, 576], dtype="float32")
    big = pb.SeqChunk(seq_id=1, n=1, sample=True, recent=[10**6])  # past the 49152-token vocab
    with pytest.raises(grpc.RpcError) as vocab:
        stub.Forward(pb.ForwardRequest(plan_id=plan_id, chunks=[big], input=ok), timeout=5)
    assert "recent token ids (for penalties) must be in [0, 49152)" in vocab.value.details()
    # still serving the real head
    ids = pool.tokenizer.encode("Hello")
    assert len(list(generate(pool, ids, 3, Sampler(GREEDY)))) == 3
    pool.close()


def test_speed_probe_on_this_models_layer(workers: list[str], smollm2_path: Path) -> None:
    """The planner's speed figure: a worker times its decode through one layer of the model
    being planned (its types and widths); a malformed request is refused and it stays up."""
    from potluck.modelfile.gguf_file import GGUFFile, layer_matrices
    from potluck.transport.client import NodeClient
    from potluck.transport.codec import matrix_to_proto

    layer = layer_matrices(GGUFFile(smollm2_path).tensors, 15)
    assert len(layer) == 7  # q, k, v, o, gate, up, down
    client = NodeClient(workers[0], None)
    try:
        good = pb.ProbeSpeedRequest(matrices=[matrix_to_proto(m) for m in layer])
        assert client.probe_speed(good).bytes_per_s > 1e8  # any CPU streams 100 MB/s
        bad = {
            "of unknown GGML type 999": [pb.ProbeMatrix(ggml_type=999, n_out=8, n_in=32)],
            "rows must be whole 32-blocks": [pb.ProbeMatrix(ggml_type=3, n_out=8, n_in=100)],
            "exceeds the limit of 16": [pb.ProbeMatrix(ggml_type=3, n_out=8, n_in=32)] * 17,
            "is outside 1..1048576": [pb.ProbeMatrix(ggml_type=3, n_out=1 << 21, n_in=32)],
            "no matrices to probe": [],
        }
        for says, matrices in bad.items():
            with pytest.raises(NodeError, match=re.escape(says)):
                client.probe_speed(pb.ProbeSpeedRequest(matrices=matrices))
        assert client.probe_speed(good).bytes_per_s > 1e8
    finally:
        client.close()


def test_worker_refuses_open_address_without_secret() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "potluck.cli", "worker", "-H", "0.0.0.0", "-p", str(_free_port())],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert "refusing to listen on 0.0.0.0" in done.stderr and "--insecure" in done.stderr


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "potluck.cli", *args], capture_output=True, text=True, timeout=300,
        env={**os.environ, "COLUMNS": "200", "POTLUCK_MDNS": "0"},
    )  # fmt: skip


def test_plan_command(workers: list[str], smollm2_path: Path) -> None:
    done = _cli(
        "plan", "-m", str(smollm2_path), "--peer", workers[0], "--rpc", workers[1], "-c", "256"
    )
    assert done.returncode == 0, done.stderr
    assert "weights + KV + buffers" in done.stdout and "tok/s for one stream" in done.stdout
    assert "best single machine:" in done.stdout
    verdict = done.stdout.strip().splitlines()[-1]
    assert verdict.startswith(("use ", "pooling is worth it")), verdict
    manual = _cli(
        "plan", "-m", str(smollm2_path), "--peer", workers[0], "-c", "256", "--tensor-split", "1,2"
    )
    assert manual.returncode == 0, manual.stderr
    assert "0–9" in manual.stdout and "10–29" in manual.stdout
    # serve's -np: KV for that many sequences at once (SmolLM2 at -c 256: 5.6 MiB for 30 layers)
    # (-np 1 is plan's default: `manual` above is that plan)
    three = _cli(
        "plan", "-m", str(smollm2_path), "--peer", workers[0], "-c", "256", "--tensor-split",
        "1,2", "-np", "3",
    )  # fmt: skip
    # serve's prefix cache, planned as that many more full-context sequences: 5 MiB here is one
    cached = _cli(
        "plan", "-m", str(smollm2_path), "--peer", workers[0], "-c", "256", "--tensor-split",
        "1,2", "-np", "3", "--cache-ram", "5",
    )  # fmt: skip
    kv = [manual, three, cached]
    assert "context 256 × 3 sequences at once" in kv[1].stdout, kv[1].stdout
    assert "context 256 × 3 sequences at once + 1 cached" in kv[2].stdout, kv[2].stdout
    per_node = [re.findall(r"\+ ([\d.]+) MiB \+", k.stdout) for k in kv]
    assert per_node[0] and len(per_node[0]) == len(per_node[1]), kv[0].stdout
    for one, three, four in zip(*per_node, strict=True):
        assert float(three) == pytest.approx(3 * float(one), abs=0.2)
        assert float(four) == pytest.approx(4 * float(one), abs=0.2)


def test_run_over_pool_cli(workers: list[str], smollm2_path: Path) -> None:
    args = (
        "run",
        "-m",
        str(smollm2_path),
        "--temp",
        "0",
        "-n",
        "12",
        "-c",
        "256",
        "Name a colour.",
    )
    alone = _cli(*args)
    pooled = _cli(*args, "--peer", workers[0], "--peer", workers[1], "--tensor-split", "1,1,1")
    assert alone.returncode == 0 and pooled.returncode == 0, pooled.stderr
    assert pooled.stdout == alone.stdout and pooled.stdout.strip()
    assert "layers 0–9 → this machine (cpu)" in pooled.stderr
    assert f"layers 20–29 → {workers[1]} (cpu)" in pooled.stderr
    half = _cli(*args, "--peer", workers[0], "--peer", workers[1], "--wire-dtype", "f16")
    assert half.returncode == 0 and half.stdout.strip(), half.stderr
    bad = _cli(*args, "--peer", workers[0], "--wire-dtype", "f8")
    assert bad.returncode == 2 and "give one of f32, f16, bf16, got 'f8'" in bad.stderr


def _whole_model_on(worker: str, path: Path):
    from potluck.engine.contract import Assignment

    n_layer = load_model(path, n_ctx=64).hp.n_layer
    return load_model(path, n_ctx=256, assignments=[Assignment(worker, 0, n_layer)])


def test_batches_arriving_out_of_order_run_in_sequence_order(
    worker_pair: list[Worker], smollm2_path: Path
) -> None:
    """With several batches in flight, a node may receive a sequence's second batch first: it
    waits for the first and computes them in position order (tokens equal one process)."""
    from potluck.transport.codec import sampling_to_proto, tensor_to_proto

    m = load_model(smollm2_path, n_ctx=256)
    ids = m.tokenizer.encode("The history of astronomy is long and")
    assert len(ids) >= 6
    want = list(generate(m, ids, 1, Sampler(GREEDY)))[0]
    node = worker_pair[0]
    pool = _whole_model_on(node.address, smollm2_path)
    stub = pb_grpc.NodeStub(grpc.insecure_channel(node.address))
    cut = len(ids) // 2
    greedy = sampling_to_proto(GREEDY, 0)

    def req(pos: int, part: list[int], sample: bool) -> pb.ForwardRequest:
        chunk = pb.SeqChunk(seq_id=77, n=len(part), pos=pos, sample=sample, sampling=greedy)
        return pb.ForwardRequest(
            plan_id=pool.pipeline.plan_id,
            chunks=[chunk],
            input=tensor_to_proto(np.array(part, np.int64)),
        )

    second = stub.Forward.future(req(cut, ids[cut:], True), timeout=30)
    # the node says when the second batch is there, waiting (not a guess by the clock)
    assert node.wait_for(f"sequence 77: the batch at position {cut} came before", timeout=20)
    first = stub.Forward(req(0, ids[:cut], False), timeout=30)
    assert list(first.tokens) == [-1]
    assert list(second.result(timeout=120).tokens) == [want]
    with pytest.raises(grpc.RpcError) as stale:
        stub.Forward(req(0, ids[:cut], False), timeout=10)
    assert stale.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"sequence 77 is at position {len(ids)} here" in stale.value.details()
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as lost:  # its predecessor never comes: bounded wait
        stub.Forward(req(len(ids) + 5, [1], True), timeout=1.5)
    assert lost.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 10
    stub.Drop(pb.DropRequest(plan_id=pool.pipeline.plan_id, seq_ids=[77]), timeout=5)


def test_concurrent_sequences_in_flight_equal_one_process(
    workers: list[str], smollm2_path: Path
) -> None:
    """Two groups of sequences kept in flight at once over a three-stage pool (what the scheduler
    does to keep every stage busy) give each sequence exactly its single-process tokens."""
    from potluck.model.stage import SeqChunk

    prompts = ["Name three planets.", "What is a cat?", "Count to five.", "Say hello."]
    want = [_single(smollm2_path, *PLANETS_16)[:10]]
    want += [_single(smollm2_path, p, 10) for p in prompts[1:]]
    pool = load_model(smollm2_path, n_ctx=256, peers=workers)
    assert pool.pipeline.depth == 3
    seqs = [pool.new_seq_id() for _ in prompts]
    samplers = {s: Sampler(GREEDY) for s in seqs}
    hist: dict[int, list[int]] = {}
    for s, p in zip(seqs, prompts, strict=True):
        hist[s] = pool.tokenizer.encode(pool.chat.render([{"role": "user", "content": p}]))
    firsts = [
        pool.pipeline.submit(np.array(hist[s]), [SeqChunk(s, len(hist[s]))], samplers, hist)
        for s in seqs
    ]
    # (bounded: once, in a fresh clone's suite beside the real-size tests, a reply never came
    # and the whole run waited here; the workers were idle, the head's links reading)
    out = {s: [f.result(timeout=120)[0]] for s, f in zip(seqs, firsts, strict=True)}
    groups = [seqs[:2], seqs[2:]]

    def launch(g: list[int]):
        for s in g:
            hist[s] = hist[s] + [out[s][-1]]
        toks = np.array([out[s][-1] for s in g])
        return pool.pipeline.submit(toks, [SeqChunk(s, 1) for s in g], samplers, hist)

    flying = [launch(g) for g in groups]
    for _ in range(9):
        for i, g in enumerate(groups):
            for s, t in zip(g, flying[i].result(timeout=120), strict=True):
                out[s].append(t)
            if len(out[g[0]]) < 10:
                flying[i] = launch(g)
    assert [out[s] for s in seqs] == want
    # and without a failover: each batch carries the settings of its own sequences only (the
    # samplers given cover all four; marking them all opened at the first batch left the others'
    # first batches without settings: refused by the last stage, recovered only by a re-plan)
    assert getattr(pool.pipeline, "events", []) == []
    for s in seqs:
        pool.pipeline.drop(s)


def test_worker_mem_limit(spawn_worker: Spawn, smollm2_path: Path) -> None:
    """--mem caps what the worker offers (Hello, so the planner sees it) and what it loads."""
    addr = spawn_worker("--mem", "64M").address
    stub = pb_grpc.NodeStub(grpc.insecure_channel(addr))
    from potluck.transport.codec import PROTOCOL_VERSION

    hello = stub.Hello(pb.HelloRequest(protocol_version=PROTOCOL_VERSION), timeout=10)
    assert hello.devices[0].memory_bytes == 64 * 2**20
    with pytest.raises(NodeError, match=r"has --mem 64 MiB: layers 3–29 need [\d.]+ MiB"):
        load_model(smollm2_path, n_ctx=256, peers=[addr], tensor_split=(1, 9))
    few = load_model(smollm2_path, n_ctx=256, peers=[addr], tensor_split=(5, 1))
    assert few.pipeline.assignments[1].start == 25
    ids = few.tokenizer.encode("Hello")
    assert len(list(generate(few, ids, 3, Sampler(GREEDY)))) == 3
    one_kv = few.pipeline.held[addr].kv_bytes
    few.close()
    # serve's -np: the node counts the KV of that many sequences at the full context
    three = load_model(smollm2_path, n_ctx=256, peers=[addr], tensor_split=(5, 1), n_seq=3)
    assert three.pipeline.held[addr].kv_bytes == 3 * one_kv > 0
    three.close()
    with pytest.raises(NodeError, match=r"KV at -c 256 × -np 100\); .* a smaller -c or -np"):
        load_model(smollm2_path, n_ctx=256, peers=[addr], tensor_split=(5, 1), n_seq=100)


def test_worker_frees_plans_of_a_vanished_head(spawn_worker: Spawn, smollm2_path: Path) -> None:
    """A plan that no head uses or names in a heartbeat is freed after --idle-timeout; a head
    with failover (its heartbeat names the plan) keeps its plan however long it idles."""
    addr = spawn_worker("--idle-timeout", "1").address
    silent = load_model(smollm2_path, n_ctx=128, peers=[addr], failover_s=None)
    alive = load_model(smollm2_path, n_ctx=256, peers=[addr])
    time.sleep(2.5)
    ids = silent.tokenizer.encode("Hello")
    with pytest.raises(NodeError, match=r"plan \w+ is not loaded on this node"):
        list(generate(silent, ids, 2, Sampler(GREEDY)))
    assert len(list(generate(alive, ids, 2, Sampler(GREEDY)))) == 2


def test_worker_device_flags(spawn_worker: Spawn) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "potluck.cli", "worker", "--device", "cuda", "-p", str(_free_port())],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "--device cuda needs -ngl N" in done.stderr, done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "potluck.cli", "worker", "-ngl", "4", "--device", "NoSuchGPU9",
         "-p", str(_free_port())],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1 and "has no device 'NoSuchGPU9'" in done.stderr, done.stderr
    spawn_worker("--device", "cpu").stop()  # cpu: no GPU, as without the flag


def test_weights_transfer_reports_progress_on_both_sides(
    spawn_worker: Spawn, smollm2_path: Path, tmp_path: Path
) -> None:
    """A worker without the model file gets its layers' tensors: the head reports bytes sent
    (the CLI's progress bar), the worker logs what it received."""
    bare = {"POTLUCK_CACHE": str(tmp_path), "HOME": str(tmp_path)}
    worker = spawn_worker(env=bare)
    addr = worker.address
    seen: list[tuple[str, int, int]] = []
    m = load_model(smollm2_path, n_ctx=128, peers=[addr], on_transfer=lambda *a: seen.append(a))
    m.close()
    log = worker.stop()
    assert seen and all(node == addr for node, _, _ in seen)
    sent = [s for _, s, _ in seen]
    assert sent == sorted(sent) and sent[-1] == seen[-1][2] > 30 * 2**20
    import re

    asked = re.search(
        r"layers \d+–29: no local copy of the model; receiving (\d+) tensors, ([\d.]+) MiB", log
    )
    done = re.search(
        r"received (\d+) tensors, ([\d.]+) MiB in [\d.]+ s, \d+ MB/s \(checked, cached\)", log
    )
    assert asked and done, log
    assert asked.group(1) == done.group(1) and asked.group(2) == done.group(2)
    assert float(done.group(2)) == pytest.approx(sent[-1] / 2**20, abs=0.1)
    # progress on the way, with the rate and the time left
    assert re.search(r"received [\d.]+ MiB of [\d.]+ MiB \(\d+%\), \d+ MB/s, \d+ s left", log)
    # only the stage's own tensors travel, never the whole file
    from potluck.model.layout import stage_tensor_names
    from potluck.modelfile.gguf_file import GGUFFile

    f = GGUFFile(smollm2_path)
    start = int(re.search(r"layers (\d+)–29: no local copy", log).group(1))  # type: ignore[union-attr]
    names = stage_tensor_names(f.tensors.values(), 30, start, 30)
    assert sent[-1] == sum(f.tensors[n].nbytes for n in names) < f.size_bytes * 0.7


def test_a_broken_transfer_resumes_where_it_stopped(
    spawn_worker: Spawn, smollm2_path: Path, tmp_path: Path
) -> None:
    """A head that stops halfway through sending a tensor (its process killed, the link cut):
    the worker keeps what arrived; the next head sends only the rest of that tensor, and the
    blob passes its sha256 (so the pool computes what one process computes)."""
    from potluck.model.archs import hparams_from_metadata
    from potluck.model.layout import stage_tensor_names
    from potluck.modelfile.gguf_file import GGUFFile
    from potluck.node.weights import sha256_file, tensor_digests
    from potluck.transport.client import NodeClient

    bare = {"POTLUCK_CACHE": str(tmp_path), "HOME": str(tmp_path)}
    worker = spawn_worker(env=bare)
    addr = worker.address
    f = GGUFFile(smollm2_path)
    hp = hparams_from_metadata(f.metadata)
    names = stage_tensor_names(f.tensors.values(), hp.n_layer, hp.n_layer - 1, hp.n_layer)
    sha = sha256_file(smollm2_path)
    digests = tensor_digests(sha, f.raw, names)
    embd = "token_embd.weight"  # SmolLM2's head is tied: the last stage needs it, ≈ 30 MiB
    cut = f.tensors[embd].nbytes // 2
    client = NodeClient(addr, None)
    try:
        client.hello()
        reply = client.load(
            pb.LoadRequest(
                plan_id="broken-head", model_sha256=sha, start=hp.n_layer - 1, stop=hp.n_layer,
                n_ctx=128, metadata_gguf=f.header_bytes(), tensor_sha256=digests,
                wire_dtype="float32", model_bytes=f.size_bytes,
            )
        )  # fmt: skip
        assert reply.need_tensors and embd in reply.missing and not reply.partial

        def half_then_gone() -> Iterator[pb.TensorChunk]:
            data = memoryview(f.raw(embd).reshape(-1))
            step = 1 << 20
            yield pb.TensorChunk(
                name=embd, sha256=digests[embd], total_bytes=len(data), data=bytes(data[:step])
            )
            for off in range(step, cut, step):
                yield pb.TensorChunk(name=embd, data=bytes(data[off : off + step]))
            raise ConnectionError("the head's process ended")

        with pytest.raises(Exception):  # noqa: B017 (gRPC wraps the sender's error its own way)
            client.put_tensors(half_then_gone())
    finally:
        client.close()
    kept = tmp_path / "blobs" / f".part-{digests[embd]}"
    sizes = [-1]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the worker writes what arrived, then sees the end
        sizes.append(kept.stat().st_size if kept.is_file() else -1)
        if sizes[-1] > 0 and sizes[-10:] == [sizes[-1]] * 10:
            break
        time.sleep(0.05)
    held = sizes[-1]  # what arrived before the cut (gRPC may drop the last messages in flight)
    assert 0 < held <= cut + (1 << 20), sizes[-3:]
    seen: list[tuple[str, int, int]] = []
    m = load_model(smollm2_path, n_ctx=128, peers=[addr], on_transfer=lambda *a: seen.append(a))
    try:
        prompt = [{"role": "user", "content": "The capital of France is"}]
        ids = m.tokenizer.encode(m.chat.render(prompt))
        pool = list(generate(m, ids, 8, Sampler(GREEDY)))
    finally:
        m.close()
    log = worker.stop()
    assert pool == _single(smollm2_path, "The capital of France is", 8)
    assert f"resuming 1 tensors of a broken transfer ({held / 2**20:.1f} MiB kept)" in log, log
    start = int(re.findall(r"layers (\d+)–29: no local copy", log)[-1])  # the second head's
    stage = stage_tensor_names(f.tensors.values(), hp.n_layer, start, hp.n_layer)
    assert seen[-1][1] == seen[-1][2] == sum(f.tensors[n].nbytes for n in stage) - held
    assert not kept.exists() and (tmp_path / "blobs" / digests[embd]).is_file()


def test_two_workers_on_one_cache_receive_the_same_tensor_at_once(
    spawn_worker: Spawn, smollm2_path: Path, tmp_path: Path
) -> None:
    """Two workers on one machine (one per GPU) share a cache and lack the model file; the head
    holds no layers, so the first stage (the embedding) and the last (SmolLM2's tied head: the
    same tensor) both receive token_embd at once. Both store it and the pool computes what one
    process computes (it failed on first use: the second worker's rename found no part file)."""
    from potluck.engine.contract import Assignment

    bare = {"POTLUCK_CACHE": str(tmp_path), "HOME": str(tmp_path)}
    a, b = spawn_worker(env=bare), spawn_worker(env=bare)
    plan = [Assignment(a.address, 0, 15), Assignment(b.address, 15, 30)]
    m = load_model(smollm2_path, n_ctx=128, assignments=plan, failover_s=None)
    try:
        ids = m.tokenizer.encode(m.chat.render([{"role": "user", "content": "Hi"}]))
        pool = list(generate(m, ids, 6, Sampler(GREEDY)))
    finally:
        m.close()
    logs = a.stop() + b.stop()
    assert pool == _single(smollm2_path, "Hi", 6)
    assert logs.count("no local copy of the model") == 2, logs
    assert not list((tmp_path / "blobs").glob(".part-*"))


def test_heads_share_a_worker_without_evicting_each_other(
    spawn_worker: Spawn, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Heads are told apart by their head id (random per process; set here by hand to play three
    head processes in one). Two heads with the same model and split get plans of their own and
    decode in turn, each token for token as one process; a third head is refused in one line
    while both compute (it used to evict the oldest plan: a live conversation); a head that
    closes frees its plan at once, and the third head then loads."""
    import potluck.pool.pipeline as pipeline_mod
    from potluck.engine.contract import Assignment

    addr = spawn_worker().address
    want = _single(smollm2_path, *PLANETS_16)[:12]
    plan = [Assignment(addr, 0, 30)]  # SmolLM2's 30 layers, all on the worker

    def whole_model_on_the_worker():
        return load_model(smollm2_path, n_ctx=256, assignments=plan)

    heads = []
    for name in ("head-a", "head-b"):
        monkeypatch.setattr(pipeline_mod, "HEAD_ID", name)
        heads.append(whole_model_on_the_worker())
    assert heads[0].pipeline.plan_id != heads[1].pipeline.plan_id
    ids = heads[0].tokenizer.encode(
        heads[0].chat.render([{"role": "user", "content": "Name three planets."}])
    )
    gens = [generate(h, ids, 12, Sampler(GREEDY)) for h in heads]
    got: list[list[int]] = [[], []]
    for _ in range(12):  # interleaved: both sequences live on the worker at once
        for out, gen in zip(got, gens, strict=True):
            out.append(next(gen))
    assert got == [want, want]
    monkeypatch.setattr(pipeline_mod, "HEAD_ID", "head-c")
    with pytest.raises(NodeError, match=r"running the stages of 2 other heads .* at most 2"):
        whole_model_on_the_worker()  # within LIVE_S (10 s) of both heads' last tokens
    heads[0].close()  # releases its plan on the worker
    third = whole_model_on_the_worker()
    assert list(generate(third, ids, 12, Sampler(GREEDY))) == want
    # head-b's plan was kept (in use): it still decodes, without a failover
    assert list(generate(heads[1], ids, 12, Sampler(GREEDY))) == want
    assert not heads[1].pipeline.events


@pytest.mark.parametrize(("wire", "tol"), [("float16", 0.06), ("bfloat16", 0.1)])
def test_half_precision_hidden_states_on_the_wire(
    workers: list[str], smollm2_path: Path, wire: str, tol: float
) -> None:
    """--wire-dtype f16 / bf16: hidden states cross every link in half the bytes. The logits of a
    24-token prompt stay within `tol` of one process's (relative to their range; the next stage's
    8-bit activation rounding turns a hidden state's half-precision error into steps) and the greedy
    choice agrees at almost every position; they are not bit-equal (the dtype is really used)."""
    single = load_model(smollm2_path, n_ctx=256)
    ids = np.array(single.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 2))
    rows = np.arange(len(ids))
    seq = single.new_seq_id()
    want = single.pipeline.forward(ids, [SeqChunk(seq, len(ids))], rows)
    pool = load_model(
        smollm2_path, n_ctx=256, peers=workers, tensor_split=(1, 1, 1), wire_dtype=wire
    )
    try:
        got = pool.pipeline.forward(ids, [SeqChunk(pool.new_seq_id(), len(ids))], rows)
    finally:
        pool.close()
    scale = float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= tol * scale
    assert not np.array_equal(got, want)
    agree = (got.argmax(-1) == want.argmax(-1)).mean()
    assert agree >= 0.9, agree


def test_cli_heads_free_their_plans_when_they_exit(spawn_worker: Spawn, smollm2_path: Path) -> None:
    """Three `potluck run` in a row on one worker: each frees its stage as it exits (the third
    used to be refused: two finished heads still held the worker's two plans)."""
    worker = spawn_worker()
    addr = worker.address
    for _ in range(3):
        done = _cli(
            "run", "-m", str(smollm2_path), "-n", "3", "-c", "128", "--peer", addr,
            "--tensor-split", "1,1", "Hi",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    assert worker.stop().count("its head is done with it") == 3


def test_serve_stopped_by_sigterm_frees_its_plan(spawn_worker: Spawn, smollm2_path: Path) -> None:
    """`potluck serve` over a worker, stopped as systemd or docker stop it (SIGTERM): the worker
    frees the head's stage at once (uvicorn re-raised the signal under the default handler, which
    killed the process before it could say so; the stage waited for the idle timeout)."""
    import signal

    worker = spawn_worker()
    addr = worker.address
    env = {**os.environ, "POTLUCK_MDNS": "0"}
    cmd = [
        sys.executable, "-m", "potluck.cli", "serve", "-m", str(smollm2_path), "-c", "128",
        "--peer", addr, "--tensor-split", "1,1", "--port", "0",
    ]  # fmt: skip
    head = subprocess.Popen(
        cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )
    try:
        assert head.stderr is not None
        deadline = time.monotonic() + 120
        while "listening on" not in (line := head.stderr.readline()):
            assert head.poll() is None and time.monotonic() < deadline, line
        head.send_signal(signal.SIGTERM)  # at once: the handler is in place before it says so
        assert head.wait(timeout=30) == 0, "the head died of the signal instead of stopping"
        # the worker says so within moments (its idle timeout would be 120 s)
        freed = worker.wait_for("its head is done with it", timeout=5)
    finally:
        if head.poll() is None:
            head.kill()
    assert freed, worker.stop()
