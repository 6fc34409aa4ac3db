"""The OpenAI-compatible server, driven by the official `openai` client over real HTTP on
127.0.0.1: a uvicorn server on a background thread (so the test can look at the stages' KV caches),
and `potluck serve` as a subprocess for the command line itself."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from potluck.api.server import ServerConfig, bind, create_app, model_id_of, uvicorn_server
from potluck.engine.generate import Model, generate
from potluck.engine.scheduler import (
    Event,
    Finished,
    Request,
    Scheduler,
    SchedulerConfig,
    Stats,
    Stream,
)
from potluck.pool.build import load_model
from potluck.sampling import GREEDY, Sampler, SamplingParams
from workers import Spawn
from workers import spawn_module_worker as spawn_module_worker

KEY = "test-key-123"
N_CTX = 512


@dataclass
class Server:
    url: str
    model: Model
    scheduler: Scheduler
    model_id: str

    def client(self, key: str | None = KEY, **kw: object) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.url + "/v1", api_key=key or "none", max_retries=0, timeout=120, **kw
        )

    def idle(self, timeout: float = 10.0) -> bool:
        """True once no request is generating or waiting and no KV cache is held."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (
                self.scheduler.active == 0
                and self.scheduler.queued == 0
                and all(not s.caches for s in self.model.pipeline.stages)
            ):
                return True
            time.sleep(0.02)
        return False


def start_server(
    model: Model,
    config: SchedulerConfig,
    api_key: str | None,
    scheduler: Callable[[Model, SchedulerConfig], Scheduler] = Scheduler,
) -> Iterator[Server]:
    sched = scheduler(model, config)
    app = create_app(model, sched, ServerConfig(model_id=model_id_of(model), api_key=api_key))
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
        yield Server(url, model, sched, model_id_of(model))
    finally:
        srv.should_exit = True
        thread.join(10)
        sched.close()
        sock.close()


@pytest.fixture(scope="module")
def server(smollm2_path: Path) -> Iterator[Server]:
    m = load_model(smollm2_path, n_ctx=N_CTX)
    yield from start_server(m, SchedulerConfig(max_active=16, max_queue=16), KEY)


@pytest.fixture(scope="module")
def ref(smollm2_path: Path) -> Model:
    """A second copy of the model for reference outputs (never touched by the server)."""
    return load_model(smollm2_path, n_ctx=N_CTX)


def _chat_ids(m: Model, messages: list[dict[str, str]]) -> list[int]:
    return m.tokenizer.encode(m.chat.render(messages))


def _greedy(m: Model, ids: list[int], n: int) -> tuple[str, list[int], str]:
    """generate()'s text, ids and finish reason (what the API must answer)."""
    out = list(generate(m, ids, n, Sampler(GREEDY)))
    eot = m.tokenizer.eot_ids
    finish = "stop" if out and out[-1] in eot else "length"
    return m.tokenizer.decode([t for t in out if t not in eot]), out, finish


def test_health_models_and_page(server: Server) -> None:
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and h["model"] == server.model_id
    models = server.client().models.list().data
    assert [m.id for m in models] == [server.model_id]
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]


def test_chat_greedy_equals_generate(server: Server, ref: Model) -> None:
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three planets."},
        {"role": "assistant", "content": "Mars, Venus, Earth."},
        {"role": "user", "content": "Two more?"},
    ]
    ids = _chat_ids(ref, msgs)
    text, out, finish = _greedy(ref, ids, 40)
    r = server.client().chat.completions.create(
        model=server.model_id, messages=msgs, max_tokens=40, temperature=0
    )
    assert r.object == "chat.completion" and r.model == server.model_id
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == finish
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(out)
    assert r.usage.total_tokens == len(ids) + len(out)
    assert 0 <= r.usage.prompt_tokens_details.cached_tokens <= len(ids)  # always there
    # the same through SSE, with the usage chunk at the end
    chunks = list(
        server.client().chat.completions.create(
            model=server.model_id,
            messages=msgs,
            max_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(out)
    assert 0 <= chunks[-1].usage.prompt_tokens_details.cached_tokens <= len(ids)
    assert all(c.usage is None for c in chunks[:-1])
    assert server.idle()


def test_content_parts_and_developer_role(server: Server) -> None:
    """OpenAI's newer message forms read as the plain ones; an image part is refused clearly."""
    c = server.client()

    def ask(msgs: list) -> str:
        r = c.chat.completions.create(
            model=server.model_id, messages=msgs, max_tokens=12, temperature=0
        )
        return r.choices[0].message.content

    plain = ask(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    )
    parts = ask(
        [
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
            },
        ]
    )
    assert parts == plain
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError, match="'image_url' is not supported"):
        ask([{"role": "user", "content": [image]}])


def test_completion_from_token_ids_equals_generate(server: Server, ref: Model) -> None:
    ids = ref.tokenizer.encode("The three laws of robotics are")
    text, out, finish = _greedy(ref, ids, 24)
    r = server.client().completions.create(
        model=server.model_id, prompt=ids, max_tokens=24, temperature=0
    )
    assert r.object == "text_completion"
    assert r.choices[0].text == text and r.choices[0].finish_reason == finish
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(out)
    # as text, streamed: the same (the tokenizer gives the same ids back)
    stream = server.client().completions.create(
        model=server.model_id,
        prompt="The three laws of robotics are",
        max_tokens=24,
        temperature=0,
        stream=True,
    )
    assert "".join(c.choices[0].text for c in stream) == text


def test_completion_default_max_tokens_and_echo(server: Server) -> None:
    r = server.client().completions.create(
        model=server.model_id, prompt="Once upon a time", temperature=0, echo=True
    )
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
    assert r.choices[0].text.startswith("Once upon a time")


def test_stop_sequences_are_cut_and_not_sent(server: Server, ref: Model) -> None:
    msgs = [{"role": "user", "content": "Name three planets."}]
    text, _, _ = _greedy(ref, _chat_ids(ref, msgs), 60)
    words = text.split()
    word = words[len(words) // 2]  # a word from the middle of the greedy answer
    assert len(words) >= 4 and text.index(word) >= 3, text
    want = text[: text.index(word)]
    c = server.client()
    r = c.chat.completions.create(
        model=server.model_id, messages=msgs, max_tokens=60, temperature=0, stop=[word, "zzz"]
    )
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    assert server.idle()
    stops = server.scheduler.stats.requests_finished.get("stop", 0)
    stream = c.chat.completions.create(
        model=server.model_id, messages=msgs, max_tokens=60, temperature=0, stop=word, stream=True
    )
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert server.idle()
    assert server.scheduler.stats.requests_finished.get("stop", 0) == stops + 1  # not "cancelled"
    # a stop sequence that spans a token boundary is cut as well
    mid = text.index(word)
    span = text[mid - 2 : mid + 3]
    r = c.completions.create(
        model=server.model_id,
        prompt=_chat_ids(ref, msgs),
        max_tokens=60,
        temperature=0,
        stop=[span],
    )
    assert r.choices[0].text == text[: mid - 2]
    assert server.idle()


def test_seed_reproducible_and_n(server: Server) -> None:
    c = server.client()
    msgs = [{"role": "user", "content": "Write a short poem about the sea."}]

    def ask(seed: int, n: int = 1) -> list[str]:
        r = c.chat.completions.create(
            model=server.model_id, messages=msgs, max_tokens=30, temperature=1.0, seed=seed, n=n
        )
        return [ch.message.content for ch in sorted(r.choices, key=lambda ch: ch.index)]

    a, b = ask(42), ask(42)
    assert a == b
    two = ask(42, n=2)
    assert two[0] == a[0]  # choice j uses seed + j
    assert two[1] != two[0]
    assert ask(43)[0] == two[1]


def test_logprobs(server: Server) -> None:
    c = server.client()
    r = c.chat.completions.create(
        model=server.model_id,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert (
        len(content) == r.usage.completion_tokens or len(content) == r.usage.completion_tokens - 1
    )
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token  # greedy: the chosen token is the most likely
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert [a.logprob for a in t.top_logprobs] == sorted(
            (a.logprob for a in t.top_logprobs), reverse=True
        )
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
    # legacy completions' shape
    r = c.completions.create(
        model=server.model_id,
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0,
        logprobs=2,
    )
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.text_offset[0] == 0 and all(len(d) == 2 for d in lp.top_logprobs)
    # streaming carries them chunk by chunk
    chunks = list(
        c.chat.completions.create(
            model=server.model_id,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=6,
            temperature=0,
            logprobs=True,
            stream=True,
        )
    )
    streamed = [
        t.token
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
        for t in ch.choices[0].logprobs.content
    ]
    assert streamed == [t.token for t in content]


def _error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_api_key_required(server: Server) -> None:
    with pytest.raises(openai.AuthenticationError) as e:
        server.client(key="wrong").models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": server.model_id})
    assert r.status_code == 401 and "Authorization: Bearer" in _error(r)["message"]
    for path in ("/v1/models", "/api/pool", "/metrics"):
        assert httpx.get(server.url + path).status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # liveness stays open


def test_error_shapes(server: Server) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    url = server.url + "/v1/chat/completions"
    r = httpx.post(
        url,
        content=b'{"model": "x", "messages": [',
        headers=auth | {"Content-Type": "application/json"},
    )
    assert r.status_code == 400 and "not valid JSON" in _error(r)["message"]
    r = httpx.post(
        url,
        json={
            "model": server.model_id,
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 7,
        },
        headers=auth,
    )
    err = _error(r)
    assert r.status_code == 400 and err["param"] == "temperature"
    r = httpx.post(url, json={"model": server.model_id, "messages": []}, headers=auth)
    assert r.status_code == 400 and _error(r)["param"] == "messages"
    c = server.client()
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found" and server.model_id in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model=server.model_id, messages=[{"role": "user", "content": "word " * 600}]
        )
    body = e.value.body
    assert body["code"] == "context_length_exceeded"
    assert re.search(
        rf"maximum context length is {N_CTX} tokens.*you requested \d+ tokens", body["message"]
    )
    with pytest.raises(
        openai.BadRequestError, match=r"requested 612 tokens \(12 in the prompt, 600"
    ):
        c.completions.create(model=server.model_id, prompt=list(range(1, 13)), max_tokens=600)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        c.completions.create(model=server.model_id, prompt=[10**7], max_tokens=2)
    r = httpx.get(server.url + "/v1/nothing", headers=auth)
    assert r.status_code == 404 and _error(r)
    assert server.idle()


def _post(server: Server, path: str, body: bytes | dict, **headers: str) -> httpx.Response:
    """A raw POST (the openai client cannot send broken bodies), JSON unless headers say not."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"} | headers
    return httpx.post(server.url + path, content=raw, headers=h, timeout=60)


def _chat(server: Server, **fields: object) -> dict:
    return {
        "model": server.model_id,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 4,
    } | fields


def test_seed_range(server: Server) -> None:
    """A seed is a 64-bit integer, signed (OpenAI) or unsigned (torch's generator, the wire's
    uint64); a negative one is its unsigned twin, and seed + j wraps for the n choices."""
    for seed in (99999999999999999999999, -(2**63) - 1, 2**64):
        r = _post(server, "/v1/chat/completions", _chat(server, seed=seed))
        err = _error(r)
        assert r.status_code == 400 and err["param"] == "seed", r.text
        assert err["message"].startswith(f"seed: {seed} is out of range")
        assert "-9223372036854775808 to 18446744073709551615" in err["message"]

    def texts(seed: int, n: int = 1) -> list[str]:
        body = _chat(server, seed=seed, n=n, temperature=1.0, max_tokens=12)
        r = _post(server, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        return [c["message"]["content"] for c in r.json()["choices"]]

    assert texts(-5) == texts(2**64 - 5)
    top = texts(2**64 - 1, n=2)  # the second choice's seed wraps to 0
    assert top[1] == texts(0)[0]
    assert server.idle()


def test_lone_surrogates_are_400(server: Server) -> None:
    """A lone surrogate is valid JSON ("\\ud800") but no Unicode text: the answer names the field
    (json.dumps writes such a str as that escape, and a proper pair as "\\ud83d\\ude00")."""
    chat = "/v1/chat/completions"
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "\udfff"}]
    cases = {
        "messages[0].content": (
            chat,
            _chat(server, messages=[{"role": "user", "content": "ok \ud800"}]),
        ),
        "messages[0].content[1].text": (
            chat,
            _chat(server, messages=[{"role": "user", "content": parts}]),
        ),
        "model": (chat, _chat(server, model="\ud83d")),
        "prompt": ("/v1/completions", {"model": server.model_id, "prompt": "\ud800x"}),
        "stop[1]": (
            "/v1/completions",
            {"model": server.model_id, "prompt": "x", "stop": ["a", "\udc00"]},
        ),
    }
    for where, (path, body) in cases.items():
        r = _post(server, path, body)
        err = _error(r)
        assert r.status_code == 400 and err["param"] == where, (where, r.text)
        assert err["message"].startswith(f"{where} is not valid Unicode text"), err["message"]
    r = _post(
        server, "/v1/chat/completions", _chat(server, messages=[{"role": "user", "content": "😀"}])
    )
    assert r.status_code == 200  # a proper pair ("\ud83d\ude00" in JSON) is fine
    assert server.idle()


def test_unreadable_bodies_get_openai_errors(server: Server) -> None:
    """Bodies FastAPI cannot parse, and methods a route does not take, answer in OpenAI's shape."""
    r = _post(server, "/v1/chat/completions", b'{"model": "x", "messages": "\xff\xfe"}')
    err = _error(r)
    assert r.status_code == 400 and "not valid UTF-8" in err["message"] and "0xff" in err["message"]
    deep = b'{"model": "x", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = _post(server, "/v1/chat/completions", deep)
    assert r.status_code == 400 and "nested too deeply" in _error(r)["message"]
    r = _post(server, "/v1/models", _chat(server))
    assert r.status_code == 405 and _error(r)["message"].endswith("it takes GET")
    for bad in (b'{"temperature": NaN}', b'{"repeat_penalty": Infinity}', b'{"top_p": -Infinity}'):
        body = json.dumps(_chat(server))[:-1].encode() + b", " + bad[1:]
        r = _post(server, "/v1/chat/completions", body)
        assert r.status_code == 400 and "finite number" in _error(r)["message"], r.text


def test_body_must_be_sent_as_json(server: Server) -> None:
    """Without Content-Type: application/json the body is not read (a web page could otherwise
    make a browser post text/plain to a local server without asking): 415 says what to send."""
    body = json.dumps(_chat(server)).encode()
    for kind in ("text/plain", "application/x-www-form-urlencoded", None):
        h = {"Authorization": f"Bearer {KEY}"} | ({"Content-Type": kind} if kind else {})
        r = httpx.post(server.url + "/v1/chat/completions", content=body, headers=h)
        err = _error(r)
        assert r.status_code == 415 and "Content-Type: application/json" in err["message"]
        assert (kind or "no Content-Type") in err["message"]
    ok = _post(server, "/v1/completions", {"model": server.model_id, "prompt": "Hi", "max_tokens": 2},
               **{"Content-Type": "application/json; charset=utf-8"})  # fmt: skip
    assert ok.status_code == 200
    r = httpx.post(
        server.url + "/v1/completions", content=b"x", headers={"Content-Type": "text/plain"}
    )
    assert r.status_code == 401  # the key is asked for first


def test_null_content(server: Server) -> None:
    """Only an assistant message that makes tool_calls may leave content null (as OpenAI)."""
    hi = {"role": "user", "content": "Hi"}
    for msgs, where, state in (
        ([{"role": "user", "content": None}], "messages[0].content", "null"),
        ([{"role": "user"}], "messages[0].content", "missing"),
        ([hi, {"role": "assistant", "content": None}, hi], "messages[1].content", "null"),
        ([{"role": "system", "content": None}, hi], "messages[0].content", "null"),
    ):
        r = _post(server, "/v1/chat/completions", _chat(server, messages=msgs))
        err = _error(r)
        assert r.status_code == 400 and err["param"] == where, r.text
        assert err["message"].startswith(f"{where} is {state}:"), err["message"]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    msgs = [hi, {"role": "assistant", "content": None, "tool_calls": [call]}, hi]
    r = _post(server, "/v1/chat/completions", _chat(server, messages=msgs))
    assert r.status_code == 200, r.text
    parts = [{"type": "text", "text": None}]
    r = _post(
        server, "/v1/chat/completions", _chat(server, messages=[{"role": "user", "content": parts}])
    )
    err = _error(r)
    assert r.status_code == 400 and err["param"] == "messages[0].content[0].text", r.text
    assert server.idle()


def test_extreme_sampling_values(server: Server, ref: Model) -> None:
    """Values at the edges sample or answer 400, never a NaN in the sampler (a 500)."""
    msgs = [{"role": "user", "content": "Name a color."}]
    greedy, _, _ = _greedy(ref, _chat_ids(ref, msgs), 6)
    for t in (1e-45, 5e-324, 1e-6):  # that close to 0 is greedy (logits / t would overflow fp32)
        r = _post(
            server,
            "/v1/chat/completions",
            _chat(server, messages=msgs, temperature=t, max_tokens=6),
        )
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == greedy
    for rp in (1e-45, 1e300):
        r = _post(server, "/v1/chat/completions", _chat(server, repeat_penalty=rp, temperature=1))
        assert r.status_code == 400 and _error(r)["param"] == "repeat_penalty", r.text
    for fields in (
        {"top_k": 2**40},
        {"max_tokens": 10**30},
        {"n": 10**30},
        {"top_logprobs": 10**30, "logprobs": True},
    ):
        r = _post(server, "/v1/chat/completions", _chat(server, **fields))
        assert r.status_code in (200, 400), (fields, r.text)
        if r.status_code == 400:
            _error(r)
    assert server.idle()


def test_sixteen_streaming_clients(server: Server, ref: Model) -> None:
    """16 simultaneous streaming chats each get exactly what generate() gives for it alone."""
    topics = ["cats", "rain", "bread", "trains", "the moon", "chess", "tea", "rivers",
              "bees", "snow", "clocks", "maps", "owls", "salt", "kites", "glass"]  # fmt: skip
    msgs = [[{"role": "user", "content": f"One sentence about {t}."}] for t in topics]
    want = [_greedy(ref, _chat_ids(ref, m), 24)[0] for m in msgs]

    def one(m: list[dict[str, str]]) -> str:
        stream = server.client().chat.completions.create(
            model=server.model_id, messages=m, max_tokens=24, temperature=0, stream=True
        )
        return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, msgs, timeout=180))  # a hang fails here, not a slow machine
    assert got == want
    assert server.scheduler.stats.decode_rows > 1  # they really were batched together
    assert server.idle()


def test_client_disconnect_frees_its_slot(server: Server) -> None:
    body = {
        "model": server.model_id,
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    url = server.url + "/v1/chat/completions"
    cancelled = server.scheduler.stats.requests_finished.get("cancelled", 0)
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", url, json=body, headers=headers) as r,
    ):
        assert r.status_code == 200
        n = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                n += 1
            if n == 5:
                break
        assert server.scheduler.active == 1
        assert len(server.model.pipeline.stages[0].caches) == 1
        # leaving the block closes the connection mid-stream
    assert server.idle(timeout=10), "the disconnected stream still holds its slot or KV cache"
    assert server.scheduler.stats.requests_finished.get("cancelled", 0) == cancelled + 1


def test_non_streaming_disconnect_frees_its_slot(server: Server) -> None:
    body = {
        "model": server.model_id,
        "prompt": "count: 1 2 3 4 5 6 7 8 9 10 11 12",  # goes on counting, no end of text
        "max_tokens": 450,
        "temperature": 0,
    }
    cancelled = server.scheduler.stats.requests_finished.get("cancelled", 0)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            server.url + "/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=0.5,
        )
    assert server.idle(timeout=10)
    # it was stopped, not run to its 450 tokens (the server polls its client every second)
    assert server.scheduler.stats.requests_finished.get("cancelled", 0) == cancelled + 1


def test_pool_and_metrics(server: Server) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    server.client().chat.completions.create(
        model=server.model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    p = httpx.get(server.url + "/api/pool", headers=auth).json()
    assert set(p) == {
        "model",
        "nodes",
        "tokens_per_s",
        "requests_active",
        "requests_queued",
        "requests_total",
        "prefix_cache",
        "batches",
    }
    assert p["batches"] == []  # (no batch API on this app: ServerConfig.batch_dir is None)
    assert set(p["prefix_cache"]) == {"hits", "misses", "cached_tokens", "entries", "bytes"}
    assert p["model"]["name"] == server.model_id and p["model"]["arch"] == "llama"
    assert p["model"]["n_layer"] == 30 and p["model"]["n_ctx"] == N_CTX and p["model"]["quant"]
    (node,) = p["nodes"]
    assert set(node) == {"name", "address", "device", "layers", "memory_used_bytes",
                         "memory_total_bytes", "compute_ms", "hop_ms", "tokens_per_s", "status"}  # fmt: skip
    assert node["address"] == "local" and node["layers"] == [0, 30] and node["status"] == "ok"
    assert 0 < node["memory_used_bytes"] < node["memory_total_bytes"]
    assert node["compute_ms"] > 0 and node["hop_ms"] is None and node["tokens_per_s"] > 0
    assert p["requests_total"] >= 1 and isinstance(p["tokens_per_s"], float)
    samples = _metrics(httpx.get(server.url + "/metrics", headers=auth).text)
    assert samples[("potluck_generated_tokens_total", ())] > 0
    assert samples[("potluck_queue_depth", ())] == 0
    assert samples[("potluck_time_to_first_token_seconds_count", ())] >= 1
    compute = ("potluck_node_compute_ms_per_token", (("name", node["name"]), ("node", "local")))
    assert samples[compute] > 0
    assert any(name == "potluck_http_requests_total" for name, _ in samples)
    assert ("potluck_kv_cache_sequences", ()) in samples
    for name in ("potluck_prefix_cache_hits_total", "potluck_prefix_cache_entries"):
        assert (name, ()) in samples


def _metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics' samples by (name, sorted labels), read with prometheus-client's parser."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


class PrefixCached:
    """A Scheduler as the API sees one with a prefix cache (engine/requests.py's interface),
    whatever the real one reuses: every choice's Finished says its first CACHED prompt tokens were
    reused, and `stats` counts them. The same tokens are generated: only the figures are set."""

    CACHED, ENTRIES, BYTES = 5, 3, 12 << 20

    def __init__(self, model: Model, config: SchedulerConfig) -> None:
        self.inner = Scheduler(model, config)
        self.hits = self.tokens = 0  # (written on the scheduler's thread only)

    def submit(self, req: Request, sink: Callable[[Event], None]) -> Stream:
        def stamped(ev: Event) -> None:
            if isinstance(ev, Finished):
                n = min(self.CACHED, ev.n_prompt)
                self.hits, self.tokens = self.hits + 1, self.tokens + n
                ev = dataclasses.replace(ev, n_cached=n)
            sink(ev)

        return self.inner.submit(req, stamped)

    @property
    def stats(self) -> Stats:
        return dataclasses.replace(
            self.inner.stats,
            prefix_hits=self.hits,
            prefix_misses=1,
            cached_tokens=self.tokens,
            prefix_entries=self.ENTRIES,
            prefix_bytes=self.BYTES,
        )

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def cached_server(smollm2_path: Path) -> Iterator[Server]:
    m = load_model(smollm2_path, n_ctx=N_CTX)
    yield from start_server(m, SchedulerConfig(max_active=8), None, PrefixCached)


def test_usage_and_figures_of_the_prefix_cache(cached_server: Server) -> None:
    """`usage.prompt_tokens_details.cached_tokens` is the choices' Finished.n_cached with each
    prompt counted once (as prompt_tokens counts it), in every form usage takes; /api/pool and
    /metrics show the scheduler's prefix cache figures."""
    s, cached = cached_server, PrefixCached.CACHED
    c = s.client()
    msgs = [{"role": "user", "content": "Name a planet."}]
    one = c.chat.completions.create(model=s.model_id, messages=msgs, max_tokens=4, temperature=0)
    assert one.usage.prompt_tokens > cached
    assert one.usage.prompt_tokens_details.cached_tokens == cached
    three = c.chat.completions.create(
        model=s.model_id, messages=msgs, max_tokens=4, temperature=0, n=3
    )
    assert len(three.choices) == 3 and three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.prompt_tokens_details.cached_tokens == cached  # the prompt once, not 3×
    chunks = list(
        c.chat.completions.create(
            model=s.model_id,
            messages=msgs,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    # completions: two prompts × n=2, non-streaming and streaming; the JSON as sent
    body = {"model": s.model_id, "prompt": [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17]],
            "n": 2, "max_tokens": 3, "temperature": 0}  # fmt: skip
    usage = _post(s, "/v1/completions", body).json()["usage"]
    assert usage["prompt_tokens"] == 6 + 7
    assert usage["prompt_tokens_details"] == {"cached_tokens": 2 * cached}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    events = _post(s, "/v1/completions", body).text.split("\n\n")
    last = json.loads(events[-3].removeprefix("data: "))  # (then "data: [DONE]" and "")
    assert last["choices"] == [] and last["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 2 * cached
    }
    assert s.idle()
    stats = s.scheduler.stats
    assert (
        stats.prefix_hits == 1 + 3 + 1 + 4 + 4 and stats.cached_tokens == stats.prefix_hits * cached
    )
    p = httpx.get(s.url + "/api/pool").json()
    assert p["prefix_cache"] == {
        "hits": stats.prefix_hits,
        "misses": 1,
        "cached_tokens": stats.cached_tokens,
        "entries": PrefixCached.ENTRIES,
        "bytes": PrefixCached.BYTES,
    }
    samples = _metrics(httpx.get(s.url + "/metrics").text)
    assert samples[("potluck_prefix_cache_hits_total", ())] == stats.prefix_hits
    assert samples[("potluck_prefix_cache_misses_total", ())] == 1
    assert samples[("potluck_prefix_cached_tokens_total", ())] == stats.cached_tokens
    assert samples[("potluck_prefix_cache_entries", ())] == PrefixCached.ENTRIES
    assert samples[("potluck_prefix_cache_bytes", ())] == PrefixCached.BYTES


@pytest.fixture
def tiny_server(server: Server, smollm2_path: Path) -> Iterator[Server]:
    """One generating slot and one waiting place, no API key (its own copy of the model)."""
    m = load_model(smollm2_path, n_ctx=256)
    yield from start_server(m, SchedulerConfig(max_active=1, max_queue=1), None)


def test_overload_answers_429(tiny_server: Server) -> None:
    c = tiny_server.client()
    msgs = [{"role": "user", "content": "Tell me a long story."}]
    # the server submits before it answers the headers: once create() returns, both are in
    streams = [
        c.chat.completions.create(
            model=tiny_server.model_id, messages=msgs, max_tokens=200, stream=True
        )
        for _ in range(2)
    ]
    with pytest.raises(openai.RateLimitError) as e:
        c.chat.completions.create(model=tiny_server.model_id, messages=msgs, max_tokens=5)
    assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
    assert e.value.response.headers["retry-after"] == "1"
    for s in streams:
        s.close()
    assert tiny_server.idle(timeout=15)
    r = c.chat.completions.create(model=tiny_server.model_id, messages=msgs, max_tokens=3)
    assert r.usage.completion_tokens == 3


# -- the command line ------------------------------------------------------------------------------
def test_serve_refuses_lan_without_key() -> None:
    env = {k: v for k, v in os.environ.items() if k != "POTLUCK_API_KEY"}
    r = subprocess.run(
        [sys.executable, "-m", "potluck.cli", "serve", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert r.returncode == 1
    assert "refusing to listen on 0.0.0.0 without an API key" in r.stderr


def test_potluck_serve_subprocess(smollm2_path: Path) -> None:
    env = {**os.environ, "POTLUCK_API_KEY": "from-env", "POTLUCK_MDNS": "0"}  # no other pools
    proc = subprocess.Popen(
        [sys.executable, "-m", "potluck.cli", "serve", "-m", str(smollm2_path), "-c", "256",
         "-t", "1", "--port", "0"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        deadline, url, seen = time.monotonic() + 90, None, []
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            seen.append(line)
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            url = m.group(1) if m else None
        assert url, "".join(seen)
        assert "API key required" in "".join(seen)
        c = openai.OpenAI(base_url=url + "/v1", api_key="from-env", max_retries=0, timeout=60)
        model = c.models.list().data[0].id
        assert model == smollm2_path.stem
        r = c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
        )
        assert r.usage.completion_tokens >= 1
        r = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    assert proc.returncode in (0, -15)


# -- over a pool: this machine + one worker process -------------------------------------------------
@pytest.fixture(scope="module")
def pool_server(spawn_module_worker: Spawn, smollm2_path: Path) -> Iterator[Server]:
    address = spawn_module_worker().address
    m = load_model(smollm2_path, n_ctx=256, peers=[address], tensor_split=[1, 1])
    yield from start_server(m, SchedulerConfig(), None)


def test_pool_server_dashboard_and_logprobs(pool_server: Server, ref: Model) -> None:
    """Over a pool the answers are the same, /api/pool lists both nodes with the worker's memory
    and per-hop time, and logprobs come back from the last stage equal to one process's."""
    c = pool_server.client()
    ids = ref.tokenizer.encode("The three laws of robotics are")
    text, out, _ = _greedy(ref, ids, 12)
    r = c.completions.create(model=pool_server.model_id, prompt=ids, max_tokens=12, temperature=0)
    assert r.choices[0].text == text and r.usage.completion_tokens == len(out)
    lp = c.completions.create(model=pool_server.model_id, prompt=ids, max_tokens=3, logprobs=1,
                              temperature=0)  # fmt: skip
    want = list(generate(ref, ids, 3, Sampler(SamplingParams(temperature=0, logprobs=1))))
    got = lp.choices[0].logprobs.token_logprobs
    assert len(got) == len(want) and all(
        abs(g - w.logprob) < 1e-4 for g, w in zip(got, want, strict=True)
    )
    p = httpx.get(pool_server.url + "/api/pool").json()
    head, worker = p["nodes"]
    assert head["address"] == "local" and head["layers"] == [0, 15] and head["hop_ms"] is None
    assert worker["address"].startswith("127.0.0.1:") and worker["layers"] == [15, 30]
    assert (
        worker["status"] == "ok" and worker["memory_total_bytes"] > worker["memory_used_bytes"] > 0
    )
    assert worker["compute_ms"] > 0 and worker["hop_ms"] >= 0 and worker["tokens_per_s"] > 0
    assert head["compute_ms"] > 0
    samples = _metrics(httpx.get(pool_server.url + "/metrics").text)
    hops = {
        dict(labels)["node"] for name, labels in samples if name.endswith("network_ms_per_token")
    }
    assert hops == {worker["address"]}
    assert pool_server.idle()


def test_pool_server_takes_any_seed_and_top_k(pool_server: Server) -> None:
    """The wire carries seed as uint64 and top_k as int32: a negative seed and a top_k past the
    vocabulary still sample over a pool, as they do in one process."""
    c = pool_server.client()
    for kw in ({"seed": -5}, {"seed": 2**64 - 1}, {"extra_body": {"top_k": 2**40}}):
        r = c.completions.create(
            model=pool_server.model_id, prompt="Once", max_tokens=3, temperature=1.0, **kw
        )
        assert r.usage.completion_tokens == 3
    assert pool_server.idle()
