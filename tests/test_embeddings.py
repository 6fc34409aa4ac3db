"""POST /v1/embeddings against `transformers` on the same GGUF, driven by the official `openai`
client over real HTTP: tiny random models of each pooling (mean: a chat model without the key, and
one with it; CLS; last, a qwen3 as Qwen3-Embedding) on the exact path (weights dequantized to f32,
f32 KV cache: equal to the reference to float round-off), the packaged SmolLM2 on the quantized
path a server runs (within a stated tolerance); batched inputs, token ids, base64, `dimensions`,
the errors, embeddings beside generation, the Batches API and `potluck serve --embedding-model`.

Reference vectors: transformers' `AutoModel(...).last_hidden_state` (decoder models apply the
final norm there, as ours is taken after `output_norm`), pooled the same way, unit length.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from fastapi import FastAPI

from potluck.api.embeddings import serve_beside
from potluck.api.server import ServerConfig, bind, create_app, model_id_of, uvicorn_server
from potluck.engine.contract import Assignment
from potluck.engine.embed import Embedder, text_ids, unit
from potluck.engine.generate import Model, Opened, generate, load_model
from potluck.engine.local import LocalPipeline
from potluck.engine.scheduler import Scheduler, SchedulerConfig
from potluck.model.stage import Stage
from potluck.pool.build import load_model as pool_model
from potluck.sampling import GREEDY, Sampler
from workers import Spawn
from workers import spawn_worker as spawn_worker

from ggufgen import write_tiny_model

transformers = pytest.importorskip("transformers")

N_CTX = 64
N_BATCH = 16  # the chat model's prompt batch: a longer input goes through in several forwards
# lengths 1 to ~50 tokens in the tiny byte-level vocabulary (3 forwards for the longest)
TEXTS = [
    "the quick brown fox",
    "a",
    "there are rather more words in this one than in the other texts",
    "in the end",
]
EXACT = 1e-5  # max |ours - reference| on the exact path (measured ≈ 2e-7: fp32 round-off)
# SmolLM2 Q4_1 on the quantized path (8-bit activations in the quantized dot products, an f16 KV
# cache) against transformers' fp32 on the dequantized weights: cosine measured 0.9992–0.9998
QUANTIZED_COSINE = 0.998
# the tiny models, by file stem (= model id): architecture, {arch}.pooling_type (None: no key)
TINY = {
    "chat": ("llama", None),  # a chat model: mean
    "mean": ("llama", 1),
    "cls": ("llama", 2),
    "last": ("qwen3", 3),  # (head_dim 128: transformers' Qwen3 default, which the file lacks)
    "rank": ("llama", 4),  # a reranker: refused
}
POOL = {"chat": "mean", "mean": "mean", "cls": "cls", "last": "last"}


def _exact(o: Opened) -> LocalPipeline:
    return LocalPipeline([Stage(o.hp, o.file, 0, o.hp.n_layer, o.n_ctx, exact=True)])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("embed")
    out = {}
    for seed, (name, (arch, pooling)) in enumerate(TINY.items()):
        extra = {} if pooling is None else {f"{arch}.pooling_type": pooling}
        shape = {"head_dim": 128} if arch == "qwen3" else {}
        out[name] = write_tiny_model(folder / f"{name}.gguf", arch, seed=seed, extra=extra, **shape)
    return out


@pytest.fixture(scope="module")
def refs(tiny: dict[str, Path]) -> dict[str, torch.nn.Module]:
    """transformers' base model (no head) over each file, loaded once."""
    return {
        name: transformers.AutoModel.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
        for name, path in tiny.items()
        if name in POOL
    }


def _reference(ref: torch.nn.Module, ids: list[int], pooling: str) -> np.ndarray:
    with torch.no_grad():
        h = ref(torch.tensor([ids])).last_hidden_state[0].double().numpy()  # [T, D]
    pooled = {"mean": h.mean(axis=0), "cls": h[0], "last": h[-1]}[pooling]
    return pooled / np.linalg.norm(pooled)


@dataclass
class Server:
    url: str
    app: FastAPI
    model: Model  # the chat model
    beside: dict[str, Model]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def post(self, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(self.url + "/v1/embeddings", json=body, timeout=60)

    def floats(self, model: str, inputs: Any, **kw: Any) -> np.ndarray:
        r = self.post({"model": model, "input": inputs, "encoding_format": "float", **kw})
        assert r.status_code == 200, r.text
        return np.array([d["embedding"] for d in r.json()["data"]], np.float32)


@contextlib.contextmanager
def _running(
    model: Model, beside: dict[str, Model], batch_dir: Path | None = None
) -> Iterator[Server]:
    """An in-process server (uvicorn on a thread) over `model`, `beside` served beside it."""
    sched = Scheduler(model, SchedulerConfig(n_batch=N_BATCH, max_active=4))
    config = ServerConfig(model_id=model_id_of(model), batch_dir=batch_dir)
    app = create_app(model, sched, config)
    for m in beside.values():
        serve_beside(app, m)
    sock, url = bind("127.0.0.1", 0)
    srv = uvicorn_server(app)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.05)
    try:
        yield Server(url, app, model, beside)
    finally:
        srv.should_exit = True
        thread.join(10)
        sched.close()
        sock.close()


@pytest.fixture(scope="module")
def server(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny chat model on the exact path, the other tiny models beside it (exact too)."""
    models = {name: load_model(p, n_ctx=N_CTX, build=_exact) for name, p in tiny.items()}
    chat = models.pop("chat")
    with _running(chat, models, tmp_path_factory.mktemp("batches")) as s:
        yield s


def _ids(s: Server, name: str, text: str) -> list[int]:
    return text_ids(s.model if name == "chat" else s.beside[name], text)


# -- equal to transformers -------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(POOL))
def test_each_pooling_equals_transformers(
    server: Server, refs: dict[str, torch.nn.Module], name: str
) -> None:
    """Mean (without the key and with it), CLS and last, through the openai client (which asks
    for base64 and decodes it)."""
    r = server.client().embeddings.create(model=name, input=TEXTS)
    ids = [_ids(server, name, t) for t in TEXTS]
    assert [d.index for d in r.data] == list(range(len(TEXTS)))
    assert r.model == name and r.object == "list"
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(x) for x in ids)
    for d, x in zip(r.data, ids, strict=True):
        want = _reference(refs[name], x, POOL[name])
        assert d.object == "embedding" and len(d.embedding) == len(want)
        assert np.abs(np.array(d.embedding) - want).max() < EXACT


def test_batched_inputs_equal_each_alone(server: Server) -> None:
    """Inputs of different lengths in one request (sharing forwards; the longest in three) give
    what each gives alone (to 1e-6: the same rows through matmuls of other batch sizes)."""
    for name in ("chat", "last"):
        together = server.floats(name, TEXTS)
        alone = np.concatenate([server.floats(name, t) for t in TEXTS])
        np.testing.assert_allclose(together, alone, rtol=0, atol=1e-6)
        assert np.allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-6)


def test_token_ids_give_what_their_text_gives(server: Server) -> None:
    ids = [_ids(server, "cls", t) for t in TEXTS]
    by_text = server.floats("cls", TEXTS)
    np.testing.assert_allclose(server.floats("cls", ids), by_text, rtol=0, atol=1e-6)
    np.testing.assert_allclose(server.floats("cls", ids[2]), by_text[2:3], rtol=0, atol=1e-6)
    r = server.client().embeddings.create(model="cls", input=ids[0])  # (the client's int list)
    np.testing.assert_allclose(r.data[0].embedding, by_text[0], rtol=0, atol=1e-6)


def test_base64_is_the_float32_bytes(server: Server) -> None:
    floats = server.floats("mean", TEXTS[:2])
    r = server.post({"model": "mean", "input": TEXTS[:2], "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    got = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in r.json()["data"]]
    assert np.array_equal(np.stack(got), floats)


def test_dimensions_truncate_and_renormalise(server: Server) -> None:
    full = server.floats("last", TEXTS)
    r = server.client().embeddings.create(model="last", input=TEXTS, dimensions=16)
    short = np.array([d.embedding for d in r.data])
    assert short.shape == (len(TEXTS), 16)
    np.testing.assert_allclose(short, unit(full[:, :16]), rtol=0, atol=1e-6)
    np.testing.assert_allclose(server.floats("last", TEXTS, dimensions=64), full, atol=0)


def test_the_models_list_names_the_embedding_models(server: Server) -> None:
    models = server.client().models.list().data
    assert [m.id for m in models] == ["chat", "mean", "cls", "last", "rank"]
    card = httpx.get(server.url + "/v1/models/last").json()
    assert card["id"] == "last" and card["context_length"] == N_CTX


@pytest.mark.parametrize(
    ("body", "status", "param", "says"),
    [
        ({"model": "chat", "input": "hi", "truncate": True}, 400, "truncate", "unknown field 'truncate'"),
        ({"model": "chat", "input": "x" * (N_CTX + 1)}, 400, "input", f"maximum context length is {N_CTX}"),
        ({"model": "last", "input": ["ok", "y" * 70]}, 400, "input[1]", "input[1] is 70 tokens"),
        ({"model": "chat", "input": ""}, 400, "input", "input is empty"),
        ({"model": "chat", "input": ["fine", ""]}, 400, "input[1]", "input[1] is empty"),
        ({"model": "chat", "input": []}, 400, "input", "input is empty"),
        ({"model": "chat", "input": [[5, 6], []]}, 400, "input[1]", "input[1] is empty"),
        ({"model": "chat", "input": [5, 100000]}, 400, "input", "token id 100000 is outside"),
        ({"model": "chat", "input": [[5], [-1]]}, 400, "input[1]", "token id -1 is outside"),
        ({"model": "chat", "input": [5, "a"]}, 400, "input", "a list of lists of token ids"),
        ({"model": "chat", "input": [1.5]}, 400, "input", "a list of token ids"),
        ({"model": "chat", "input": "hi", "dimensions": 65}, 400, "dimensions", "give 1 to 64"),
        ({"model": "chat", "input": "hi", "dimensions": 0}, 400, "dimensions", "give 1 to 64"),
        ({"model": "chat", "input": "hi", "encoding_format": "int8"}, 400, "encoding_format", "'float' or 'base64'"),
        ({"model": "rank", "input": "hi"}, 400, "model", "pooling type is rank"),
        ({"model": "text-embedding-3-small", "input": "hi"}, 404, "model", "'chat', 'mean', 'cls'"),
        ({"input": "hi"}, 400, "model", "model: Field required"),
    ],
)  # fmt: skip
def test_errors_say_why_in_one_line(
    server: Server, body: dict[str, Any], status: int, param: str, says: str
) -> None:
    r = server.post(body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert says in err["message"] and "\n" not in err["message"], err
    assert err["param"] == param and err["type"] == "invalid_request_error"
    if "context length" in says:
        assert err["code"] == "context_length_exceeded"


def test_user_is_taken_and_ignored(server: Server) -> None:
    np.testing.assert_array_equal(
        server.floats("cls", "hi", user="u-1"), server.floats("cls", "hi")
    )


# -- beside generation -----------------------------------------------------------------------------
def test_embeddings_of_the_chat_model_leave_generation_alone(server: Server) -> None:
    """Embedding requests computed on the chat model's stages while the scheduler generates:
    the greedy text is the one it gives alone, the vectors those they give alone, and no KV
    cache is left behind."""
    c = server.client()
    msgs = [{"role": "user", "content": "the quick brown fox"}]

    def chat() -> str:
        r = c.chat.completions.create(model="chat", messages=msgs, max_tokens=24, temperature=0)
        return r.choices[0].message.content or ""

    want_text, want_vecs = chat(), server.floats("chat", TEXTS)
    assert want_text
    with ThreadPoolExecutor(6) as pool:
        texts = [pool.submit(chat) for _ in range(2)]
        vecs = [pool.submit(server.floats, "chat", TEXTS) for _ in range(8)]
        assert [t.result() for t in texts] == [want_text] * 2
        for v in vecs:
            np.testing.assert_allclose(v.result(), want_vecs, rtol=0, atol=1e-6)
    deadline = time.monotonic() + 10
    while any(s.caches for s in server.model.pipeline.stages) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(s.caches for s in server.model.pipeline.stages)
    assert all(not s.caches for m in server.beside.values() for s in m.pipeline.stages)


def test_embedding_and_generating_threads_share_the_stages(tiny: dict[str, Path]) -> None:
    """An Embedder's thread and a generating thread on one model's stages, back to back as fast
    as they go: each gives exactly what it gives alone. (Without the stage's lock, one forward's
    graph was freed or rebuilt under the other's compute: ggml aborted or crashed.)"""
    m = load_model(tiny["chat"], n_ctx=N_CTX)
    embedder = Embedder(m, N_BATCH)
    ids = [text_ids(m, t) for t in TEXTS]
    prompt = m.tokenizer.encode("the quick brown fox jumps")
    want_vecs = embedder.embed(ids)
    want_ids = list(generate(m, prompt, 40, Sampler(GREEDY)))
    wrong: list[str] = []

    def embedding() -> None:
        for _ in range(60):
            if not np.array_equal(embedder.embed(ids), want_vecs):
                wrong.append("embeddings")

    def generating() -> None:
        for _ in range(6):
            if list(generate(m, prompt, 40, Sampler(GREEDY))) != want_ids:
                wrong.append("tokens")

    threads = [threading.Thread(target=f) for f in (embedding, generating)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
    assert not any(s.caches for s in m.pipeline.stages)


def test_over_a_pool_equal_one_process(smollm2_path: Path, spawn_worker: Spawn) -> None:
    """The chat model over two worker processes (the head holding no layer): the last stage
    answers the rows' hidden states (ForwardRequest.want_hidden) and the vectors equal one
    process's (the same kernels on the same CPU; the wire carries f32)."""
    texts = ["Embeddings map text to vectors.", "hi", "The quick brown fox jumps over the dog."]
    one = load_model(smollm2_path, n_ctx=256)
    want = Embedder(one).embed([text_ids(one, t) for t in texts])
    workers = [spawn_worker(), spawn_worker()]
    plan = [Assignment(workers[0].address, 0, 14), Assignment(workers[1].address, 14, 30)]
    pooled = pool_model(smollm2_path, n_ctx=256, assignments=plan)
    try:
        with _running(pooled, {}) as s:
            r = s.client().embeddings.create(model=s.model.path.stem, input=texts)
            got = np.array([d.embedding for d in r.data], np.float32)
        assert np.abs(got - want).max() < 1e-4
        assert pooled.pipeline.held  # (it ran on the workers)
    finally:
        pooled.close()


# -- the Batches API -------------------------------------------------------------------------------
def test_an_embeddings_batch(server: Server, tmp_path: Path) -> None:
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "last", "input": TEXTS}},
        {"custom_id": "b", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "chat", "input": TEXTS[0], "dimensions": 8}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "chat", "input": "hi", "normalize": False}},
    ]  # fmt: skip
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    c = server.client()
    f = c.files.create(file=inp.open("rb"), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + 60
    while (b := c.batches.retrieve(b.id)).status != "completed":
        assert time.monotonic() < deadline, b
        time.sleep(0.1)
    assert b.request_counts is not None and b.request_counts.completed == 2
    assert b.output_file_id is not None and b.error_file_id is not None
    out = {x["custom_id"]: x for x in map(json.loads, c.files.content(b.output_file_id).text.split("\n")[:-1])}  # fmt: skip
    vecs = [d["embedding"] for d in out["a"]["response"]["body"]["data"]]
    np.testing.assert_array_equal(np.array(vecs, np.float32), server.floats("last", TEXTS))
    short = out["b"]["response"]["body"]["data"][0]["embedding"]
    np.testing.assert_array_equal(short, server.floats("chat", TEXTS[0], dimensions=8)[0])
    (bad,) = map(json.loads, c.files.content(b.error_file_id).text.split("\n")[:-1])
    assert bad["custom_id"] == "bad" and bad["error"]["code"] == "http_400"
    assert "unknown field 'normalize'" in bad["error"]["message"]


# -- a real model on the quantized path ------------------------------------------------------------
def test_smollm2_quantized_within_tolerance(smollm2_path: Path) -> None:
    """The packaged SmolLM2 Q4_1, as `potluck serve` computes it, against transformers' fp32 on
    its dequantized weights: cosine > QUANTIZED_COSINE per input (the quantized kernels round
    activations to 8 bits; the KV cache is f16)."""
    model = load_model(smollm2_path, n_ctx=256)
    texts = [
        "Embeddings map text to vectors.",
        "The quick brown fox jumps over the lazy dog.",
        "hi",
    ]
    ref = transformers.AutoModel.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()
    with _running(model, {}) as s:
        r = s.client().embeddings.create(model=s.model.path.stem, input=texts)
        for d, text in zip(r.data, texts, strict=True):
            want = _reference(ref, text_ids(model, text), "mean")
            assert float(np.dot(d.embedding, want)) > QUANTIZED_COSINE
            assert abs(np.linalg.norm(d.embedding) - 1) < 1e-5


# -- the command line ------------------------------------------------------------------------------
def _serve(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "POTLUCK_MDNS": "0"}
    env.pop("POTLUCK_API_KEY", None)
    return subprocess.Popen(
        [sys.executable, "-m", "potluck.cli", "serve", "-c", str(N_CTX), "-t", "1", "--port", "0",
         *args],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env,
    )  # fmt: skip


def test_potluck_serve_embedding_model(tiny: dict[str, Path]) -> None:
    """--embedding-model: listed beside the chat model, and its vectors those an Embedder of
    the same file gives in this process (the same quantized path); a reranker is refused."""
    proc = _serve("-m", str(tiny["chat"]), "--embedding-model", str(tiny["last"]))
    try:
        assert proc.stderr is not None
        deadline, url, seen = time.monotonic() + 90, None, []
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            seen.append(line)
            found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            url = found.group(1) if found else None
        assert url, "".join(seen)
        assert "last pooling" in "".join(seen)
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in c.models.list().data] == ["chat", "last"]
        r = c.embeddings.create(model="last", input=TEXTS)
        here = load_model(tiny["last"])
        want = Embedder(here).embed([text_ids(here, t) for t in TEXTS])
        np.testing.assert_allclose([d.embedding for d in r.data], want, rtol=0, atol=1e-6)
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    refused = _serve("-m", str(tiny["chat"]), "--embedding-model", str(tiny["rank"]))
    _, said = refused.communicate(timeout=90)
    assert refused.returncode == 1
    assert "--embedding-model: rank's pooling type is rank" in said
