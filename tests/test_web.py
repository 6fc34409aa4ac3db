"""The web page (src/potluck/api/static/) in a real headless Chromium against a real `potluck serve`.

Debian's `chromium` driven by Playwright (Playwright cannot download its own browsers here, so it is
pointed at the system binary). The server is a real `potluck serve` process on 127.0.0.1 running
SmolLM2; answers are checked against the same greedy request made through the `openai` client.
Screenshots go to a temporary directory (its path is printed) and, when POTLUCK_KEEP_ARTIFACTS is
set, are copied to tests/artifacts/ (ignored by git).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from workers import Spawn
from workers import spawn_module_worker as spawn_module_worker

playwright_sync = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

CHROMIUM = next(
    (
        p
        for p in (
            os.environ.get("POTLUCK_CHROMIUM"),
            shutil.which("chromium"),
            shutil.which("chromium-browser"),
        )
        if p
    ),
    None,
)

pytestmark = [
    pytest.mark.web,
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="no chromium binary: install Debian's `chromium` package (apt-get install -y chromium) "
        "or set POTLUCK_CHROMIUM to a Chromium executable",
    ),
]

CTX = 512  # small context: fast to allocate, enough for the prompts below
API_KEY = "test-key-7f3a"
START_TIMEOUT_S = 180  # loading SmolLM2 and compiling kernels on a busy 2-core machine
ANSWER_TIMEOUT_MS = 90_000  # one answer of ≤ 48 tokens, with margin for a loaded machine
ARTIFACTS = Path(__file__).parent / "artifacts"
POOL = f"web-test-{os.getpid()}"  # a pool name of our own


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    """The processes' environment: no mDNS (other test runs' workers on this host must not join
    these pools), a pool name of our own, and API keys only from argv."""
    env = {k: v for k, v in os.environ.items() if k != "POTLUCK_API_KEY"}
    return {**env, "POTLUCK_MDNS": "0", "POTLUCK_POOL": POOL}


class Server:
    """A `potluck serve` subprocess on loopback, its log in a file."""

    def __init__(self, model: Path, log: Path, *extra: str) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "potluck.cli", "serve", "-m", str(model), "-c", str(CTX)]
        cmd += ["-t", os.environ.get("POTLUCK_TEST_THREADS", "2")]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *extra]
        cmd += ["--batch-dir", str(log.with_suffix(".batches"))]  # batches of its own
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env())
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"potluck serve exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"potluck serve not healthy after {START_TIMEOUT_S} s:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def headers(self, key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if key else {}

    def pool(self, key: str | None = None) -> dict:
        return httpx.get(f"{self.base}/api/pool", headers=self.headers(key), timeout=10).json()

    def model_id(self, key: str | None = None) -> str:
        r = httpx.get(f"{self.base}/v1/models", headers=self.headers(key), timeout=10)
        return r.json()["data"][0]["id"]

    def greedy(
        self, messages: list[dict[str, str]], max_tokens: int, key: str | None = None
    ) -> str:
        """The same request the page makes, non-streaming, through the official client."""
        import openai

        client = openai.OpenAI(base_url=f"{self.base}/v1", api_key=key or "none", timeout=120)
        done = client.chat.completions.create(
            model=self.model_id(key), messages=messages, temperature=0, max_tokens=max_tokens
        )
        return done.choices[0].message.content or ""

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("web-artifacts")
    yield out
    print(f"\nweb page screenshots: {out}")
    if os.environ.get("POTLUCK_KEEP_ARTIFACTS"):
        ARTIFACTS.mkdir(exist_ok=True)
        for f in out.iterdir():
            if f.is_file():  # (not the servers' batch folders)
                shutil.copy2(f, ARTIFACTS / f.name)
        print(f"copied to {ARTIFACTS}")


@pytest.fixture(scope="module")
def server(smollm2_path: Path, artifacts: Path) -> Iterator[Server]:
    s = Server(smollm2_path, artifacts / "serve.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def keyed_server(smollm2_path: Path, artifacts: Path) -> Iterator[Server]:
    s = Server(smollm2_path, artifacts / "serve-keyed.log", "--api-key", API_KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def pool_server(
    spawn_module_worker: Spawn, smollm2_path: Path, artifacts: Path
) -> Iterator[Server]:
    """A head and one `potluck worker` process on loopback (standing in for a second machine),
    the layers split evenly. The worker's log is kept beside the server's."""
    worker = spawn_module_worker(env={"POTLUCK_POOL": POOL}, timeout=START_TIMEOUT_S)
    try:
        s = Server(
            smollm2_path, artifacts / "serve-pool.log", "--peer", worker.address, "-ts", "1,1"
        )
        try:
            yield s
        finally:
            s.stop()
    finally:
        (artifacts / "worker.log").write_text(worker.stop(timeout=20))


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with playwright_sync.sync_playwright() as p:
        # --no-sandbox: the tests may run as root (CI containers), where Chromium's sandbox refuses.
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


class Page:
    """A fresh browser context (empty localStorage) with its page; uncaught JS errors fail the test."""

    def __init__(self, browser, base: str, **context_args) -> None:
        self.context = browser.new_context(**context_args)
        self.context.set_default_timeout(30_000)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.base = base

    def open(self) -> None:
        self.page.goto(self.base + "/")
        self.page.wait_for_selector("body[data-ready=true]")

    def settings(
        self,
        temperature: float | None = None,
        max_tokens: int | None = None,
        key: str | None = None,
    ) -> None:
        pg = self.page
        pg.click("#settings-btn")
        pg.wait_for_selector("#settings[open]")
        if temperature is not None:
            pg.eval_on_selector(  # a range input: set it as a drag would, with its input event
                "#temperature",
                "(el, v) => { el.value = v; el.dispatchEvent(new Event('input', {bubbles: true})); }",
                str(temperature),
            )
        if max_tokens is not None:
            pg.fill("#max-tokens", str(max_tokens))
        if key is not None:
            pg.fill("#api-key", key)
        pg.click("#settings-save")
        pg.wait_for_selector("#settings:not([open])", state="attached")

    def ask(self, text: str, expect: str = "done") -> object:
        """Type and send a message; wait for the answer to end; its <article>."""
        pg = self.page
        before = pg.locator(".msg.assistant").count()
        pg.fill("#prompt", text)
        pg.press("#prompt", "Enter")
        reply = pg.locator(".msg.assistant").nth(before)
        reply.wait_for()
        pg.wait_for_function(
            "el => el.dataset.state !== 'streaming'",
            arg=reply.element_handle(),
            timeout=ANSWER_TIMEOUT_MS,
        )
        assert reply.get_attribute("data-state") == expect, reply.inner_text()
        return reply

    def stored(self) -> list[dict]:
        """The conversations the page keeps in localStorage."""
        return json.loads(
            self.page.evaluate("localStorage.getItem('potluck.conversations')") or "[]"
        )

    def shot(self, artifacts: Path, name: str) -> None:
        self.page.screenshot(path=str(artifacts / f"{name}.png"), full_page=True)

    def close(self) -> None:
        self.context.close()
        assert not self.errors, f"uncaught errors in the page: {self.errors}"


@pytest.fixture
def page(browser, server: Server) -> Iterator[Page]:
    p = Page(browser, server.base, viewport={"width": 1280, "height": 800})
    p.open()
    yield p
    p.close()


def test_page_loads_and_dashboard_lists_the_nodes(
    page: Page, server: Server, artifacts: Path
) -> None:
    pg = page.page
    pool = server.pool()
    assert pool["nodes"], pool
    pg.wait_for_function(
        "id => document.getElementById('model-pill').textContent === id", arg=server.model_id()
    )
    pg.wait_for_selector("#pool-status[data-state=live]")
    nodes = pg.locator("#nodes .node")
    assert nodes.count() == len(pool["nodes"])
    n_layer = pool["model"]["n_layer"]
    for i, want in enumerate(pool["nodes"]):
        node = nodes.nth(i)
        start, stop = want["layers"]
        assert node.get_attribute("data-layers") == f"{start},{stop}"
        assert (
            node.locator(".node-layers").inner_text()
            == f"{start}–{stop - 1} ({stop - start}/{n_layer})"
        )
        assert node.locator(".node-name").inner_text() == want["name"]
        assert node.locator(".node-device").inner_text() == want["device"].upper()
        used, total = want["memory_used_bytes"], want["memory_total_bytes"]
        assert 0 < used < total
        assert node.locator(".bar").get_attribute("aria-valuenow") == f"{100 * used / total:.0f}"
    assert pool["model"]["name"] in pg.inner_text("#pool-model")
    assert f"{n_layer} layers" in pg.inner_text("#pool-model")
    page.shot(artifacts, "desktop-empty")


def test_chat_streams_the_same_answer_as_the_api(
    page: Page, server: Server, artifacts: Path
) -> None:
    pg = page.page
    pg.wait_for_selector("#pool-status[data-state=live]")
    served = server.pool()["requests_total"]
    page.settings(temperature=0, max_tokens=40)

    question = "What is the capital of France? Answer in one sentence."
    pg.fill("#prompt", question)
    pg.press("#prompt", "Enter")
    pg.wait_for_selector("#stop:not([hidden])")  # while streaming, Stop replaces Send
    reply = pg.locator(".msg.assistant").first
    pg.wait_for_function(
        "el => el.dataset.state !== 'streaming'",
        arg=reply.element_handle(),
        timeout=ANSWER_TIMEOUT_MS,
    )
    assert reply.get_attribute("data-state") == "done", reply.inner_text()
    assert pg.is_visible("#send") and not pg.is_visible("#stop")

    messages = [{"role": "user", "content": question}]
    want = server.greedy(messages, 40)
    assert want.strip()
    got = page.stored()[0]["messages"][1]["content"]
    assert got == want
    assert int(reply.get_attribute("data-chunks")) > 1, (
        "the answer arrived in one piece, not streamed"
    )
    # What is shown is exactly the markdown rendering of the API's text.
    rendered = pg.evaluate("async t => (await import('/markdown.js')).renderMarkdown(t)", want)
    assert reply.locator(".msg-body").inner_html() == rendered
    assert "tokens" in reply.locator(".msg-meta").inner_text()

    # A second turn sends the conversation so far.
    follow = "And of Italy?"
    second = page.ask(follow)
    messages += [{"role": "assistant", "content": want}, {"role": "user", "content": follow}]
    assert page.stored()[0]["messages"][3]["content"] == server.greedy(messages, 40)
    assert second.locator(".msg-body").inner_text().strip()

    # The dashboard counted the requests (two from the page, two from the openai client).
    pg.wait_for_function(
        "n => Number(document.getElementById('pool-total').textContent) >= n",
        arg=served + 4,
        timeout=10_000,
    )
    page.shot(artifacts, "desktop-chat")


def test_stop_aborts_the_stream_and_frees_the_slot(page: Page, server: Server) -> None:
    pg = page.page
    page.settings(temperature=0, max_tokens=400)
    pg.fill("#prompt", "Write a long story about a dragon who learns to bake bread.")
    pg.click("#send")
    reply = pg.locator(".msg.assistant").first
    pg.wait_for_function(
        "el => Number(el.dataset.chunks) >= 3",
        arg=reply.element_handle(),
        timeout=ANSWER_TIMEOUT_MS,
    )
    pg.click("#stop")
    pg.wait_for_function(
        "el => el.dataset.state === 'stopped'", arg=reply.element_handle(), timeout=5_000
    )
    assert pg.is_visible("#send")
    assert "stopped" in reply.locator(".msg-meta").inner_text()
    kept = page.stored()[0]["messages"][1]
    assert kept["state"] == "stopped" and kept["content"]
    # The server notices the closed connection and ends the generation.
    deadline = time.monotonic() + 15
    while server.pool()["requests_active"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.pool()["requests_active"] == 0


_HOSTILE = [
    "<script>window.__pwned = 1</script>",
    '<img src=x onerror="window.__pwned = 1">',
    "**<img src=x onerror=window.__pwned=1>**",
    "[click](javascript:window.__pwned=1)",
    '[x](https://example.com/"onmouseover="window.__pwned=1)',
    "`<b>` and ```\n<iframe src=javascript:window.__pwned=1></iframe>\n```",
    "| <svg onload=window.__pwned=1> | b |\n|---|---|\n| <a href=javascript:1>x</a> | y |",
    "- <details open ontoggle=window.__pwned=1>",
    "# <style>body{display:none}</style>",
]


def test_markdown_renders_and_never_injects_html(page: Page) -> None:
    pg = page.page
    html = pg.evaluate(
        """async cases => {
            const { renderMarkdown } = await import('/markdown.js');
            const box = document.createElement('div');
            document.body.append(box);
            box.innerHTML = cases.map(renderMarkdown).join('<hr>');
            await new Promise(r => setTimeout(r, 300));  // let any onerror/onload fire
            const bad = [...box.querySelectorAll('*')].filter(el =>
                ['SCRIPT', 'IMG', 'IFRAME', 'SVG', 'STYLE', 'DETAILS'].includes(el.tagName.toUpperCase()) ||
                [...el.attributes].some(a => a.name.startsWith('on')));
            const hrefs = [...box.querySelectorAll('a')].map(a => a.getAttribute('href'));
            box.remove();
            return { bad: bad.map(el => el.outerHTML), hrefs, pwned: window.__pwned ?? null };
        }""",
        _HOSTILE,
    )
    assert html["bad"] == [] and html["pwned"] is None, html
    assert html["hrefs"] == ['https://example.com/"onmouseover="window.__pwned=1'], html["hrefs"]

    def render(text: str) -> str:
        return pg.evaluate("async t => (await import('/markdown.js')).renderMarkdown(t)", text)

    assert render("# Title") == "<h1>Title</h1>"
    assert render("**bold** and *it* and `a<b`") == (
        "<p><strong>bold</strong> and <em>it</em> and <code>a&lt;b</code></p>"
    )
    assert render("```python\nif a < b:\n    pass\n```") == (
        '<pre><span class="code-lang">python</span><code class="language-python">'
        "if a &lt; b:\n    pass</code></pre>"
    )
    assert render("```\nstill streaming") == "<pre><code>still streaming</code></pre>"
    assert render("- a\n- b\n  - c\n\n1. x\n2. y") == (
        "<ul><li>a</li><li>b<ul><li>c</li></ul></li></ul><ol><li>x</li><li>y</li></ol>"
    )
    assert render("see [docs](https://example.com/a?b=1&c=2)") == (
        '<p>see <a href="https://example.com/a?b=1&amp;c=2" target="_blank" '
        'rel="noopener noreferrer">docs</a></p>'
    )
    assert render("snake_case_word stays") == "<p>snake_case_word stays</p>"


def test_api_key_rejected_then_accepted_and_remembered(
    browser, keyed_server: Server, artifacts: Path
) -> None:
    p = Page(browser, keyed_server.base, viewport={"width": 1280, "height": 800})
    try:
        pg = p.page
        p.open()
        pg.wait_for_selector("#model-pill[data-state=error]")
        assert pg.inner_text("#model-pill") == "API key needed"
        assert "needs an API key" in pg.inner_text("#banner-text")

        reply = p.ask("Hello", expect="error")
        banner = pg.inner_text("#banner-text")
        assert "HTTP 401" in banner and "Settings" in banner, banner
        assert "401" in reply.locator(".msg-meta").inner_text()
        p.shot(artifacts, "api-key-missing")

        # A wrong key: rejected, and the page says the saved key is the problem.
        p.settings(key="wrong-key")
        p.ask("Hello", expect="error")
        assert "was rejected" in pg.inner_text("#banner-text")

        # The banner's button opens the settings; the right key works at once.
        pg.click("#banner-action")
        pg.wait_for_selector("#settings[open]")
        pg.click("#settings-cancel")
        p.settings(temperature=0, max_tokens=16, key=API_KEY)
        pg.wait_for_function(
            "id => document.getElementById('model-pill').textContent === id",
            arg=keyed_server.model_id(API_KEY),
        )
        pg.wait_for_selector("#pool-status[data-state=live]")
        pg.wait_for_selector("#nodes .node")
        reply = p.ask("Say hello.")
        got = p.stored()[0]["messages"][-1]["content"]
        # The failed turns are not sent as context: the request is just this question.
        assert got == keyed_server.greedy([{"role": "user", "content": "Say hello."}], 16, API_KEY)

        # The key is kept in this browser and used after a reload.
        pg.reload()
        pg.wait_for_selector("body[data-ready=true]")
        assert (
            pg.evaluate("JSON.parse(localStorage.getItem('potluck.settings')).api_key") == API_KEY
        )
        pg.wait_for_selector("#model-pill[data-state=ok]")
        assert pg.locator(".msg.assistant").count() == 3  # the conversation came back too
        p.shot(artifacts, "api-key-accepted")
    finally:
        p.close()


def test_conversation_history(page: Page) -> None:
    pg = page.page
    page.settings(temperature=0, max_tokens=8)
    page.ask("Name a fruit.")
    pg.click("#new-chat-btn")
    assert pg.locator(".msg").count() == 0 and pg.is_visible("#empty")
    page.ask("Name a color.")

    pg.click("#history-btn")
    entries = pg.locator("#history-list .history-open")
    assert entries.count() == 2
    assert entries.nth(0).inner_text().startswith("Name a color.")  # newest first
    entries.nth(1).click()
    assert pg.is_hidden("#history")
    assert pg.locator(".msg.user").inner_text() == "Name a fruit."

    pg.reload()
    pg.wait_for_selector("body[data-ready=true]")
    assert pg.locator(".msg.user").inner_text() == "Name a fruit."  # the open one is remembered
    pg.click("#history-btn")
    pg.locator("#history-list li.current button[title^=Delete]").click()
    assert pg.locator(".msg").count() == 0
    assert pg.locator("#history-list .history-open").count() == 1


def test_phone_layout(browser, server: Server, artifacts: Path) -> None:
    p = Page(
        browser,
        server.base,
        viewport={"width": 390, "height": 844},
        device_scale_factor=2,
        is_mobile=True,
        has_touch=True,
    )
    try:
        pg = p.page
        p.open()
        overflow = "document.documentElement.scrollWidth - document.documentElement.clientWidth"
        assert pg.evaluate(overflow) == 0, "the page scrolls sideways on a phone"
        assert pg.is_visible("#chat") and pg.is_hidden("#pool")
        assert pg.is_visible(".tabs")
        p.settings(temperature=0, max_tokens=12)

        # On a touch screen Enter is a new line; the Send button sends.
        pg.fill("#prompt", "Hi")
        pg.press("#prompt", "Enter")
        assert pg.input_value("#prompt") == "Hi\n"
        pg.tap("#send")
        reply = pg.locator(".msg.assistant").first
        pg.wait_for_function(
            "el => el.dataset.state === 'done'",
            arg=reply.element_handle(),
            timeout=ANSWER_TIMEOUT_MS,
        )
        assert pg.evaluate(overflow) == 0
        p.shot(artifacts, "phone-chat")

        pg.tap(".tab[data-view=pool]")
        assert pg.is_hidden("#chat") and pg.is_visible("#pool")
        pg.wait_for_selector("#nodes .node")
        assert pg.evaluate(overflow) == 0
        p.shot(artifacts, "phone-pool")
    finally:
        p.close()


def test_dashboard_shows_a_two_node_pool(browser, pool_server: Server, artifacts: Path) -> None:
    p = Page(browser, pool_server.base, viewport={"width": 1280, "height": 800})
    try:
        pg = p.page
        p.open()
        pg.wait_for_selector("#pool-status[data-state=live]")
        nodes = pg.locator("#nodes .node")
        assert nodes.count() == 2
        assert [nodes.nth(i).get_attribute("data-layers") for i in range(2)] == ["0,15", "15,30"]
        assert nodes.nth(0).locator(".node-address").inner_text() == "this machine (head)"
        remote = pool_server.pool()["nodes"][1]["address"]
        assert nodes.nth(1).locator(".node-address").inner_text() == remote
        assert nodes.nth(1).locator(".node-layers").inner_text() == "15–29 (15/30)"

        p.settings(temperature=0, max_tokens=24)
        p.ask("Name three planets.")
        want = p.stored()[0]["messages"][1]["content"]
        assert want == pool_server.greedy([{"role": "user", "content": "Name three planets."}], 24)

        # After decoding, each node shows its compute time, speed and (remote) hop latency as
        # /api/pool reports them (the page polls every second; the values hold still once no
        # request runs). Compared as numbers: the page rounds to 0.1.
        after = pool_server.pool()["nodes"]
        assert after[1]["hop_ms"] is not None, after
        for i, node in enumerate(after):
            for cell, key in (
                ("compute", "compute_ms"),
                ("hop", "hop_ms"),
                ("rate", "tokens_per_s"),
            ):
                if node[key] is None:
                    assert node["address"] == "local" and key == "hop_ms", node
                    continue
                pg.wait_for_function(
                    """([i, cls, v]) => {
                        const text = document.querySelectorAll('#nodes .node')[i].querySelector(cls).textContent;
                        return Math.abs(parseFloat(text) - v) <= Math.max(0.06, v * 0.005);
                    }""",
                    arg=[i, f".node-{cell}", node[key]],
                    timeout=5_000,
                )
        # Exactly one node is marked as the pool's bottleneck: the one with the most ms per token.
        cost = [(n["compute_ms"] or 0) + (n["hop_ms"] or 0) for n in after]
        slowest = pg.locator("#nodes .node .node-slowest:not([hidden])")
        assert slowest.count() == 1
        flagged = [nodes.nth(i).locator(".node-slowest").is_visible() for i in range(2)]
        assert flagged.index(True) == cost.index(max(cost))
        p.shot(artifacts, "desktop-pool-two-nodes")
    finally:
        p.close()


def test_dashboard_shows_the_prefix_cache(page: Page, artifacts: Path) -> None:
    """The prefix cache's tiles: its hit rate and hits, the prompt tokens reused, its MiB and the
    sequences it holds. The figures are set on /api/pool's answer (the page only shows what it is
    given; tests/test_api.py checks the server's)."""
    pg = page.page
    pg.wait_for_selector("#pool-status[data-state=live]")
    figures = {"hits": 3, "misses": 1, "cached_tokens": 12_345, "entries": 2, "bytes": 3 << 19}

    def answer(route) -> None:
        route.fulfill(json=route.fetch().json() | {"prefix_cache": figures})

    pg.route("**/api/pool", answer)
    pg.wait_for_function("() => document.getElementById('pool-cache-rate').textContent === '75%'")
    assert pg.inner_text("#pool-cache-hits") == "3 of 4 requests"
    assert pg.inner_text("#pool-cache-tokens") == "12.3K"
    assert pg.inner_text("#pool-cache-bytes") == "1.5 MiB"
    assert pg.inner_text("#pool-cache-entries") == "2 sequences"
    page.shot(artifacts, "desktop-prefix-cache")
    figures |= dict.fromkeys(figures, 0)  # nothing looked up yet: no rate
    pg.wait_for_function("() => document.getElementById('pool-cache-rate').textContent === '—'")
    assert pg.inner_text("#pool-cache-tokens") == "0"
    assert pg.inner_text("#pool-cache-bytes") == "0 MiB"
    assert pg.inner_text("#pool-cache-entries") == "0 sequences"
    pg.unroute("**/api/pool")


def test_dashboard_shows_a_mixture_of_experts(browser, artifacts: Path, tmp_path: Path) -> None:
    """A qwen3moe served: /api/pool and the dashboard's model line name its experts and the
    parameters a token computes with."""
    from gguf import GGMLQuantizationType as T

    from ggufgen import write_tiny_model

    path = write_tiny_model(tmp_path / "moe.gguf", "qwen3moe", None, T.Q8_0, n_expert=8)
    s = Server(path, artifacts / "serve-moe.log")
    try:
        m = s.pool()["model"]
        assert (m["arch"], m["n_expert"], m["n_expert_used"]) == ("qwen3moe", 8, 2)
        assert 0 < m["active_parameters"] < m["parameters"]
        p = Page(browser, s.base, viewport={"width": 1280, "height": 800})
        p.open()
        p.page.wait_for_selector("#pool-status[data-state=live]")
        line = p.page.inner_text("#pool-model")
        assert "parameters active: 2 of 8 experts per token" in line, line
        p.shot(artifacts, "desktop-moe")
        p.close()
    finally:
        s.stop()


def test_errors_are_shown_and_the_chat_recovers(page: Page, server: Server) -> None:
    pg = page.page
    page.settings(temperature=0, max_tokens=8)

    # A prompt longer than the context: the server's one-line reason, with the numbers.
    page.ask("word " * (CTX + 50), expect="error")
    banner = pg.inner_text("#banner-text")
    assert "HTTP 400" in banner and str(CTX) in banner, banner
    assert pg.inner_text("#banner-action") == "Retry"

    # The network gone (Chromium's offline mode): the chat and the dashboard say so.
    pg.wait_for_selector("#pool-status[data-state=live]")
    page.context.set_offline(True)
    page.ask("Hello?", expect="error")
    assert "Cannot reach the Potluck server" in pg.inner_text("#banner-text")
    pg.wait_for_selector("#pool-status[data-state=down]", timeout=10_000)

    # Back online: the dashboard resumes by itself and the next question is answered; the
    # failed turns are not sent as context.
    page.context.set_offline(False)
    pg.wait_for_selector("#pool-status[data-state=live]", timeout=10_000)
    page.ask("Hello!")
    got = page.stored()[0]["messages"][-1]["content"]
    assert got == server.greedy([{"role": "user", "content": "Hello!"}], 8)


def test_dashboard_shows_a_batch_and_its_progress(
    page: Page, server: Server, artifacts: Path
) -> None:
    """A batch created through the Batches API appears under the nodes with its status and the
    requests done, and ends as completed."""
    import openai

    model = server.model_id()
    lines = [
        json.dumps({"custom_id": f"w{i}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": model, "max_tokens": 4, "temperature": 0,
                             "messages": [{"role": "user", "content": f"Say {i}."}]}})
        for i in range(6)
    ]  # fmt: skip
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="none", timeout=60)
    f = client.files.create(file=("web.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    pg = page.page
    row = pg.locator("#batches .batch", has_text=b.id[-8:])
    row.wait_for()
    pg.wait_for_function(
        "id => [...document.querySelectorAll('#batches .batch')].some("
        "li => li.textContent.includes(id) && li.dataset.status === 'completed')",
        arg=b.id[-8:],
        timeout=ANSWER_TIMEOUT_MS,
    )
    assert "completed · 6/6" in row.inner_text()
    assert row.locator(".bar").get_attribute("aria-valuenow") == "100"
    page.shot(artifacts, "desktop-batch")
