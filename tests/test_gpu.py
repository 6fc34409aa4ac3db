"""GPU paths on a real second ggml backend: Vulkan, here on Mesa's lavapipe (a software Vulkan
device), on a real GPU where the machine has one. `-ngl` splits a stage between that device and
the CPU (ggml's backend scheduler); the text must be the CPU's until a near-tie, the device must
hold exactly what was put there, a stage that does not fit must say how many layers do, and a
worker that offers its GPU must be planned with GPU layers. Skipped, with the reason, where this
machine's ggml has no GPU backend (build it with CMAKE_ARGS="-DGGML_VULKAN=ON", see .ci/run).

Faked, because it cannot exist here: a GPU's speed. lavapipe computes on the CPU, slower than
ggml's CPU backend, so the planner would rightly leave it out; the worker test tells it the GPU
streams 1 TB/s (POTLUCK_GPU_BYTES_PER_S) so that it plans GPU layers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from potluck.engine.generate import generate
from potluck.model.archs import hparams_from_metadata
from potluck.model.archs.common import is_routed
from potluck.model.ggml_lib import BackendError, devices
from potluck.model.stage import Compute, GpuConfig, SeqChunk, Stage
from potluck.modelfile.gguf_file import GGUFFile
from potluck.pool.build import load_model
from potluck.sampling import GREEDY, Sampler, log_softmax
from test_hybrid import write_hybrid
from test_model_reference import CASES, _ids
from workers import Spawn
from workers import spawn_worker as spawn_worker

from ggufgen import write_tiny_model

GPUS = [d for d in devices() if d.is_gpu]
pytestmark = pytest.mark.skipif(
    not GPUS, reason="this machine's ggml has no GPU backend (CMAKE_ARGS=-DGGML_VULKAN=ON)"
)
NEAR_TIE = 0.5  # nats, by the CPU's own logits: where a GPU's rounding may pick the other token
TOKENS = [5, 70, 71, 72, 100, 3, 200, 150, 260, 9, 33, 34, 35, 36, 40, 41, 42, 43, 44, 45]


def _greedy(stage: Stage, ids: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """n greedy tokens after `ids` through one stage, with the logits each was taken from."""
    logits = stage(np.array(ids), [SeqChunk(1, len(ids))])
    out, rows = [], []
    for _ in range(n):
        rows.append(logits[0])
        out.append(int(logits[0].argmax()))
        logits = stage(np.array([out[-1]]), [SeqChunk(1, 1)])
    stage.drop(1)
    return out, rows


# the first of test_model_reference's cases per architecture (dense or not): lavapipe takes
# seconds per case at n_embd 256, and its low-bit K-quant cases are CPU-vs-CPU questions
GPU_CASES = list({(c[0], "n_expert" in c[3]): c for c in reversed(CASES)}.values())[::-1]


@pytest.mark.parametrize("case", GPU_CASES, ids=[_ids(c) for c in GPU_CASES])
def test_every_architecture_on_the_gpu_equals_the_cpu(case: tuple, tmp_path: Path) -> None:
    """Tiny random models of every architecture and quant mix that tests/test_model_reference.py
    checks against transformers, with every layer on the device: the logits of 20 teacher-forced
    tokens equal the CPU's within the rounding of two backends' kernels (of a mixture of
    experts, on average: where a router's top k is nearly tied, that rounding picks another
    expert, as test_model_reference's quantized path allows)."""
    arch, qtype, over, shape = case
    path = write_tiny_model(tmp_path / "m.gguf", arch, None, qtype, qtypes=over, **shape)
    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata)
    rows = np.arange(len(TOKENS))
    cpu = Stage(hp, f, 0, hp.n_layer, 64, n_gpu_layers=0)(np.array(TOKENS), [SeqChunk(0, 20)], rows)
    gpu_stage = Stage(hp, f, 0, hp.n_layer, 64, n_gpu_layers=hp.n_layer + 1)
    assert gpu_stage.device_weight_bytes() > 0
    gpu = gpu_stage(np.array(TOKENS), [SeqChunk(0, len(TOKENS))], rows)
    diff = np.abs(gpu - cpu) / np.abs(cpu).max()  # of the logits' range
    if hp.is_hybrid:
        # a hybrid moves 8-bit rounding further (test_model_reference: 1.4–3.3e-2 on average
        # against transformers; so the device's quantized kernels against the CPU's), so its
        # graph on the device is proven on the dequantized weights, where both round alike
        assert diff.mean() < 4e-2, f"{arch}: GPU logits differ by {diff.mean():.2e} on average"
        assert (gpu.argmax(-1) == cpu.argmax(-1)).mean() >= 0.8
        exact = [
            Stage(hp, f, 0, hp.n_layer, 64, n_gpu_layers=n, exact=True, cache_type="f32")(
                np.array(TOKENS), [SeqChunk(0, len(TOKENS))], rows
            )
            for n in (0, hp.n_layer + 1)
        ]
        worst = np.abs(exact[1] - exact[0]).max() / np.abs(exact[0]).max()
        assert worst < 1e-2, f"{arch}: the exact path on the GPU differs by {worst:.2e}"
        return
    if shape.get("n_expert"):  # a mixture of experts: on average
        assert diff.mean() < 1.5e-2, f"{arch}: GPU logits differ by {diff.mean():.2e} on average"
    else:
        assert diff.max() < 5e-2, f"{arch}: GPU logits differ from the CPU's by {diff.max():.2e}"
    assert (gpu.argmax(-1) == cpu.argmax(-1)).mean() >= 0.9


def test_a_hybrids_states_on_the_gpu_go_back_where_kept(tmp_path: Path) -> None:
    """A hybrid with every layer on the device: its recurrent states, their checkpoint at a
    prompt's end and the states after each drafted token live there; rewound to each drafted
    position, a sequence goes on as one that only read that far (within the device's rounding of
    chunks of other sizes)."""
    path = write_hybrid(tmp_path, "qwen35moe")
    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata)

    def stage() -> Stage:
        return Stage(hp, f, 0, hp.n_layer, 64, exact=True, n_gpu_layers=hp.n_layer + 1,
                     cache_type="f32")  # fmt: skip

    a, d, more = np.array(TOKENS[:10]), np.array([40, 41, 42, 43, 44]), np.array([77, 78])
    st = stage()
    st(a, [SeqChunk(1, len(a), mark=True)])
    assert st.caches[1].state is not None and st.kv_bytes() > 0
    for keep in range(len(a) + 1, len(a) + len(d) + 1):
        st(d, [SeqChunk(1, len(d), pos=len(a), draft=tuple(d[1:]))], np.arange(len(d)))
        got = st(more, [SeqChunk(1, 2, pos=keep)])
        fresh = stage()
        fresh(np.concatenate([a, d[: keep - len(a)]]), [SeqChunk(9, keep)])
        want = fresh(more, [SeqChunk(9, 2)])
        assert np.abs(got - want).max() < 1e-2 * np.abs(want).max(), keep


def test_experts_in_ram_attention_on_the_gpu(tmp_path: Path) -> None:
    """A qwen3moe with every layer on the device: its logits equal the CPU's with all experts
    there, the first layer's kept in RAM (--n-cpu-moe 1) or every layer's (--cpu-moe). The device
    holds exactly the stage's weights less those expert stacks, and their products run on the
    CPU: the logits change (before weight buffers were marked as such, ggml's scheduler copied
    them to the device for every step and the logits were bit-identical)."""
    path = write_tiny_model(
        tmp_path / "m.gguf", "qwen3moe", None, T.Q8_0, n_layer=2, n_expert=8, n_ff_exp=64
    )
    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata)
    rows = np.arange(len(TOKENS))
    cpu = Stage(hp, f, 0, hp.n_layer, 64)(np.array(TOKENS), [SeqChunk(0, 20)], rows)
    out, held = {}, {}
    for n_cpu_moe in (0, 1, 99):
        compute = Compute(gpu=GpuConfig(n_gpu_layers=hp.n_layer + 1, n_cpu_moe=n_cpu_moe))
        stage = Stage(hp, f, 0, hp.n_layer, 64, compute=compute)
        out[n_cpu_moe] = gpu = stage(np.array(TOKENS), [SeqChunk(0, len(TOKENS))], rows)
        held[n_cpu_moe] = stage.device_weight_bytes()
        # a router's near-tie turns one backend's rounding into another expert: the mean, as
        # tests/test_model_reference.py's quantized path
        mean = float(np.abs(gpu - cpu).mean() / np.abs(cpu).max())
        assert mean < 1.5e-2, f"--n-cpu-moe {n_cpu_moe}: logits differ from the CPU's by {mean}"
        assert (gpu.argmax(-1) == cpu.argmax(-1)).mean() >= 0.9
    for n_cpu_moe in (1, 99):
        in_ram = sum(
            t.nbytes for t in f.tensors.values() if is_routed(t.name) and t.layer < n_cpu_moe
        )
        assert 0 < in_ram <= held[0] - held[n_cpu_moe] < in_ram + 256 * 6  # (256-byte alignment)
        assert not np.array_equal(out[n_cpu_moe], out[0])


_SEQUENCES_COME_AND_GO = """
import sys
import numpy as np
from potluck.model.stage import SeqChunk, Stage
from potluck.modelfile.gguf_file import GGUFFile
from potluck.model.archs import hparams_from_metadata

path, out, ngl = sys.argv[1], sys.argv[2], int(sys.argv[3])
f = GGUFFile(path)
hp = hparams_from_metadata(f.metadata)
stage = Stage(hp, f, 0, hp.n_layer, 512, n_gpu_layers=ngl)
ids = np.arange(5, 45)
stage(ids[:8], [SeqChunk(1, 8)])  # a prompt of sequence 1, which is then dropped
stage.drop(1)
rows = [stage(ids[i : i + 1], [SeqChunk(2, 1)])[0] for i in range(3)]  # a new sequence decodes
for i in range(260):  # past the first 256 positions: its cache grows (its old buffers freed)
    stage(ids[i % 40 : i % 40 + 1], [SeqChunk(2, 1)])
rows.append(stage(ids[:8], [SeqChunk(2, 8)])[0])  # then a prompt chunk
np.save(out, np.stack(rows))
"""


def test_sequences_that_come_and_go_keep_the_device_computing(tmp_path: Path) -> None:
    """A dropped sequence frees its KV buffers on the device, a growing one its old buffers; the
    next graph of another size crashed inside ggml's Vulkan backend (Mesa's lavapipe: segfault)
    until a stage restarted that backend after such a free (stage.py, _RESTART_AFTER_FREE).
    Run in a child process, so that a crash fails this test only. The new sequence's logits equal
    those of a stage that never saw the dropped one (same device, same graph shapes).

    Without the restart it crashed every time. With it, lavapipe still crashed now and then
    (bench/RESULTS.md, "The test suite's time"): a crash is run once more and reported as a
    warning with the child's stack (faulthandler), and two crashes fail the test. Where exactly
    ggml-vulkan keeps the stale pointer is not known."""
    path = write_tiny_model(tmp_path / "m.gguf", "llama", None, T.Q8_0, n_layer=4)
    ngl = 99
    out = tmp_path / "rows.npy"
    argv = [sys.executable, "-X", "faulthandler", "-c", _SEQUENCES_COME_AND_GO]
    argv += [str(path), str(out), str(ngl)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if done.returncode < 0:  # killed by a signal: once more, and say so
        import warnings

        warnings.warn(
            f"the Vulkan come-and-go child crashed (signal {-done.returncode}) and is run again: "
            f"{done.stderr[-3000:]}",
            stacklevel=1,
        )
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    got = np.load(out)
    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata)
    fresh = Stage(hp, f, 0, hp.n_layer, 512, n_gpu_layers=ngl)
    ids = np.arange(5, 45)
    want = [fresh(ids[i : i + 1], [SeqChunk(2, 1)])[0] for i in range(3)]
    np.testing.assert_array_equal(got[:3], np.stack(want))
    assert np.isfinite(got).all()


@pytest.mark.parametrize("ngl", [10, 31])
def test_ngl_split_gives_the_cpus_text_until_a_near_tie(smollm2_path: Path, ngl: int) -> None:
    """SmolLM2 with its last 10 layers (or every layer and the head's norm) on the device."""
    f = GGUFFile(smollm2_path)
    hp = hparams_from_metadata(f.metadata)
    ids = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    want, cpu_rows = _greedy(Stage(hp, f, 0, hp.n_layer, 256, n_gpu_layers=0), ids, 16)
    stage = Stage(hp, f, 0, hp.n_layer, 256, n_gpu_layers=ngl)
    # the device holds exactly the tensors of the layers put there (each padded to 256 bytes)
    gpu_names = [n for n in f.tensors if n.startswith("blk.") and int(n.split(".")[1]) >= 30 - ngl]
    held = sum(-(-f.tensors[n].nbytes // 256) * 256 for n in gpu_names)
    if ngl > hp.n_layer:
        held += -(-f.tensors["output_norm.weight"].nbytes // 256) * 256
    assert stage.device_weight_bytes() == held
    assert stage.weight_bytes() == sum(t.nbytes for t in f.tensors.values()) - sum(
        f.tensors[n].nbytes for n in gpu_names
    ) + held - (f.tensors["output_norm.weight"].nbytes if ngl > hp.n_layer else 0)
    got, _ = _greedy(stage, ids, 16)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            lp = log_softmax(cpu_rows[i])
            gap = float(lp[b] - lp[a])
            assert gap < NEAR_TIE, f"token {i}: GPU took {a}, CPU {b}, {gap:.3f} nats apart"
            break


def test_a_stage_too_big_for_the_device_says_how_many_layers_fit(smollm2_path: Path) -> None:
    from potluck.model.stage import Compute, GpuConfig

    f = GGUFFile(smollm2_path)
    hp = hparams_from_metadata(f.metadata)
    layer = sum(t.nbytes for n, t in f.tensors.items() if n.startswith("blk.0."))
    gpu = GpuConfig(30, None, vram=int(layer * 4.5))  # --vram: room for 4 layers
    with pytest.raises(
        BackendError, match=r"-ngl 30 needs \d+ MiB .* at most 4 layers fit \(-ngl 4\)"
    ):
        Stage(hp, f, 0, hp.n_layer, 256, compute=Compute(gpu=gpu))


def test_a_gpu_offer_measures_the_device_when_no_speed_is_given() -> None:
    """A worker or head with -ngl and no POTLUCK_GPU_BYTES_PER_S (every real GPU user) times the
    batch-1 product on the device itself; it used to call the CPU probe with an argument it did
    not take (TypeError at startup)."""
    from potluck.model.stage import GpuConfig
    from potluck.node.probe import gpu_offer

    offer = gpu_offer(GpuConfig(n_gpu_layers=3))
    assert offer is not None and offer.max_layers == 3
    assert offer.bytes_per_s > 0 and offer.memory_bytes > 0
    assert gpu_offer(GpuConfig(n_gpu_layers=0)) is None


def test_a_worker_offering_its_gpu_is_planned_with_gpu_layers(
    spawn_worker: Spawn, smollm2_path: Path
) -> None:
    """`potluck worker -ngl 99`: its Hello names the device with ggml's free memory; the head's
    planner puts layers there (the GPU's speed is given: lavapipe is no faster than the CPU);
    `potluck run` over it gives one process's text until a near-tie."""
    gpu_speed = {"POTLUCK_GPU_BYTES_PER_S": "1e12"}
    env = {**os.environ, "POTLUCK_MDNS": "0", **gpu_speed}
    addr = spawn_worker("-ngl", "99", env=gpu_speed, timeout=120).address
    from potluck.pool.survey import survey

    nodes, _ = survey([addr])
    node = nodes[1]
    assert node.device == "gpu" and node.gpu_memory_bytes > 0 and node.max_gpu_layers == 99
    plan = subprocess.run(
        [sys.executable, "-m", "potluck.cli", "plan", "-m", str(smollm2_path), "-c", "256",
         "--peer", addr, "--tensor-split", "1,1"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    assert "15–29 +" in plan.stdout and "head" in plan.stdout, plan.stdout  # on its GPU
    prompt = "Name three planets."
    run = subprocess.run(
        [sys.executable, "-m", "potluck.cli", "run", "-m", str(smollm2_path), "-c", "256",
         "--peer", addr, "--tensor-split", "1,1", "--temp", "0", "-n", "12", prompt],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert f"layers 15–29 → {addr} (GPU + output head)" in run.stderr, run.stderr
    single = load_model(smollm2_path, n_ctx=256)
    ids = single.tokenizer.encode(single.chat.render([{"role": "user", "content": prompt}]))
    want = single.tokenizer.decode(list(generate(single, ids, 12, Sampler(GREEDY))))
    # the same text until a near-tie: here the first line at least ("1. Mars" on this CPU)
    assert run.stdout.split("\n")[0] == want.split("\n")[0], (run.stdout, want)


def test_a_gpu_too_small_for_the_experts_gets_attention_and_kv(
    spawn_worker: Spawn, tmp_path: Path
) -> None:
    """A worker whose GPU (--vram) holds every layer's attention and KV but the experts of only
    the last two layers: the planner keeps the first two layers' experts in RAM (--n-cpu-moe),
    `potluck plan` says so, and the worker computes so: its greedy tokens equal those of a stage
    here with the same placement (same backends; the CPU's tokens may part at a near-tie)."""
    from potluck.planner import footprint_from_gguf
    from potluck.pool.planning import PlanInputs, plan_model
    from potluck.pool.survey import assignments_of

    path = write_tiny_model(
        tmp_path / "moe.gguf", "qwen3moe", None, T.Q8_0, n_layer=4, n_embd=256, n_expert=8,
        n_ff_exp=256, tied=False,
    )  # fmt: skip
    f = GGUFFile(path)
    hp = hparams_from_metadata(f.metadata)
    fp = footprint_from_gguf(f.tensors, hp, n_ctx=256)
    experts = fp.layer_expert_bytes
    rest = sum(w + kv for w, kv in zip(fp.layer_weight_bytes, fp.layer_kv_bytes, strict=True))
    vram = fp.buffer_bytes + rest - experts[0] - experts[1] + fp.head_bytes + 4096
    gpu_speed = {"POTLUCK_GPU_BYTES_PER_S": "1e12"}  # (lavapipe is no faster than the CPU)
    addr = spawn_worker("-ngl", "99", "--vram", str(vram), env=gpu_speed, timeout=120).address
    env = {**os.environ, "POTLUCK_MDNS": "0", **gpu_speed, "COLUMNS": "200"}
    shown = subprocess.run(
        [sys.executable, "-m", "potluck.cli", "plan", "-m", str(path), "-c", "256", "--peer", addr,
         "--mem", "0"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "0–3 + head, experts of 0–1 in RAM" in shown.stdout, shown.stdout
    plan = plan_model(PlanInputs(path, 256, mem=0), [addr])
    (a,) = [a for a in assignments_of(plan) if a.node == addr]
    assert (a.start, a.stop, a.ram_experts) == (0, 4, 2)
    prompt = [5, 70, 71, 72, 100, 3, 200, 150, 9, 33]
    pool = load_model(path, n_ctx=256, assignments=assignments_of(plan))
    try:
        got = list(generate(pool, prompt, 12, Sampler(GREEDY)))
    finally:
        pool.close()
    here = Stage(hp, f, 0, 4, 256, n_gpu_layers=5, ram_experts=2)
    assert (
        here.device_weight_bytes() < Stage(hp, f, 0, 4, 256, n_gpu_layers=5).device_weight_bytes()
    )
    assert got == _greedy(here, prompt, 12)[0]


@pytest.mark.skipif(
    not all("llvmpipe" in d.description for d in GPUS), reason="a real GPU is here: it is found"
)
def test_doctor_says_why_a_vulkan_build_finds_no_device() -> None:
    """Here the only Vulkan device is Mesa's software one, which ggml hides unless
    GGML_VK_VISIBLE_DEVICES names it: without that variable the build finds no device, and
    doctor's backend check says so and what to do (it used to report the CPU alone as fine)."""
    env = {k: v for k, v in os.environ.items() if k != "GGML_VK_VISIBLE_DEVICES"}
    done = subprocess.run(
        [sys.executable, "-m", "potluck.cli", "doctor", "--load-seconds", "0", "--json"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    checks = {c["check"]: c for c in json.loads(done.stdout)}
    backend = checks["backend"]
    assert backend["status"] == "warn", backend
    assert (
        "built with Vulkan" in backend["advice"]
        and "GGML_VK_VISIBLE_DEVICES=0" in backend["advice"]
    )
    # with the variable (as every other test here runs), the device is found: nothing to say
    done = subprocess.run(
        [sys.executable, "-m", "potluck.cli", "doctor", "--load-seconds", "0", "--json"],
        capture_output=True, text=True, timeout=120, env={**env, "GGML_VK_VISIBLE_DEVICES": "0"},
    )  # fmt: skip
    checks = {c["check"]: c for c in json.loads(done.stdout)}
    assert "built with Vulkan" not in checks["backend"]["advice"], checks["backend"]
