"""A pool that loses a node mid-request answers as OpenAI does for an outage: 503 with
{"error": {"message", "type", "param", "code"}}, not a 500; a streaming request that has started
gets the same object as its last event (its status line has gone). Nothing is faked: a real
`potluck serve` over a real worker process on 127.0.0.1 (standing in for another machine) that
holds every layer (--mem 0: the head holds none), SIGKILLed while both requests generate. Failover
is on (serve has no --failover-timeout) but finds no machine left to run the model, so the engine
ends the requests with PoolLostError; a node's own failure (NodeError, failover off) maps the same
way, checked on the mapping itself."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from workers import Spawn
from workers import spawn_worker as spawn_worker

# counting goes on well past what is generated before the kill (greedy, no end of text)
PROMPT = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 400, "temperature": 0}
ERROR_KEYS = {"message", "type", "param", "code"}


def _serve(model: Path, *args: str) -> tuple[subprocess.Popen, str, list[str]]:
    """`potluck serve` on a free port; its URL, and its log lines from then on (read by a thread,
    so that the pipe never fills)."""
    env = {k: v for k, v in os.environ.items() if k != "POTLUCK_API_KEY"} | {"POTLUCK_MDNS": "0"}
    cmd = [sys.executable, "-m", "potluck.cli", "serve", "-m", str(model), "--port", "0", *args]
    proc = subprocess.Popen(
        cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )
    assert proc.stderr is not None
    deadline, seen = time.monotonic() + 120, []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if found := re.search(r"listening on (http://127\.0\.0\.1:\d+)", line):
            threading.Thread(target=lambda: seen.extend(proc.stderr), daemon=True).start()  # type: ignore[arg-type]
            return proc, found.group(1), seen
    proc.kill()
    raise AssertionError("".join(seen))


def _assert_pool_error(body: dict, log: list[str]) -> None:
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    err = body["error"]
    assert err["type"] == "server_error" and err["code"] == "pool_unavailable", (body, log)
    assert "went away and the machines left cannot run the model" in err["message"], body


def test_a_node_lost_mid_request_answers_503_in_openais_shape(
    spawn_worker: Spawn, smollm2_path: Path
) -> None:
    worker = spawn_worker()
    head, url, log = _serve(
        smollm2_path, "-c", "512", "-np", "2", "--peer", worker.address, "--mem", "0"
    )  # fmt: skip
    body = PROMPT | {"model": smollm2_path.stem}
    try:
        with ThreadPoolExecutor(1) as pool:
            plain = pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=120)
            events = []
            with httpx.stream(
                "POST", url + "/v1/completions", json=body | {"stream": True}, timeout=120
            ) as streamed:
                assert streamed.status_code == 200
                lines = streamed.iter_lines()
                for line in lines:  # until text flows
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                        break
                deadline = time.monotonic() + 60
                while httpx.get(url + "/health").json()["requests_active"] < 2:
                    assert time.monotonic() < deadline, "the non-streaming request never started"
                    time.sleep(0.05)
                worker.kill()  # SIGKILL: the node is gone, both requests mid-generation
                events = [line for line in lines if line.startswith("data: ")]
            answer = plain.result(timeout=120)
        # the streaming request: its last event is the error, and no [DONE] follows it
        assert events and events[-1] != "data: [DONE]", events[-3:]
        _assert_pool_error(json.loads(events[-1][6:]), log)
        # the non-streaming one: a 503 with the same object
        assert answer.status_code == 503, (answer.text, log)
        _assert_pool_error(answer.json(), log)
        # and a request after the loss: the same (the pool is not there to run it)
        later = httpx.post(url + "/v1/completions", json=body | {"max_tokens": 2}, timeout=120)
        assert later.status_code == 503, later.text
        _assert_pool_error(later.json(), log)
        assert httpx.get(url + "/health").status_code == 200  # the server itself is fine
    finally:
        head.terminate()
        head.wait(timeout=30)


def test_a_node_error_maps_to_503_as_a_lost_pool_does() -> None:
    """A node that fails a call (NodeError: with failover off it ends the request) is the same
    outage to a client: 503, type server_error, code pool_unavailable."""
    from potluck.api.errors import api_error
    from potluck.pool.failover import PoolLostError
    from potluck.transport.client import NodeError

    for exc in (NodeError("node 10.0.0.2:50052: unavailable"), PoolLostError("gone")):
        err = api_error(exc)
        assert err.status == 503 and err.body()["error"] == {
            "message": str(exc), "type": "server_error", "param": None, "code": "pool_unavailable"
        }  # fmt: skip
