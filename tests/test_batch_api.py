"""The Files and Batches API on a real `potluck serve`, driven by the official `openai` client:
a batch survives the server being SIGKILLed and started again (every custom_id once, greedy
answers as one process gives them alone, a sample done before the kill and after); cancel; the
listing; errors."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from potluck.api.batch import REVIVE_S
from potluck.api.batch_store import BatchStore
from potluck.engine.generate import generate
from potluck.model.stage import Compute
from potluck.pool.build import load_model
from potluck.sampling import GREEDY, Sampler
from workers import Spawn
from workers import spawn_worker as spawn_worker

pytestmark = pytest.mark.slow  # servers killed and started again, workers too


def _serve(
    model: Path,
    batch_dir: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    said: list[str] | None = None,
) -> tuple[subprocess.Popen, str]:
    """A server started; `said` gets what it said until it listens. One thread (-t 1), as the
    workers: a process spinning on every core slows to a crawl when other tests share them."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "potluck.cli", "serve", "-m", str(model), "-c", "512", "--port",
         "0", "-np", "4", "-t", "1", "--batch-dir", str(batch_dir), "--no-mdns", *extra],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        env={**os.environ, "POTLUCK_MDNS": "0", **(env or {})},
    )  # fmt: skip
    assert proc.stderr is not None
    deadline, seen = time.monotonic() + 90, []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if found := re.search(r"listening on (http://127\.0\.0\.1:\d+)", line):
            if said is not None:
                said += seen
            return proc, found.group(1)
    proc.kill()
    raise AssertionError("".join(seen))


@pytest.fixture
def batch_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "batches"


def _submit(c: openai.OpenAI, inp: Path):
    """The file uploaded and a chat batch over it created, as a client does."""
    f = c.files.create(file=inp.open("rb"), purpose="batch")
    return c.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )


def _follow(proc: subprocess.Popen) -> list[str]:
    """The lines a server logs from now on, collected by a thread (never a full pipe)."""
    lines: list[str] = []
    assert proc.stderr is not None
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()  # type: ignore[arg-type]
    return lines


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def _input(path: Path, model_id: str, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            body = {"model": model_id, "max_tokens": 10, "temperature": 0,
                    "messages": [{"role": "user", "content": f"Say the number {i} in words."}]}  # fmt: skip
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                "url": "/v1/chat/completions", "body": body}) + "\n")  # fmt: skip
        f.write('{"custom_id": "broken"\n')  # a bad line: to the error file


def _greedy_as_alone(model: Path, out: list[dict], ids: list[str]) -> None:
    """Greedy answers (those of `ids`, "r<i>" each) are what one process alone gives for the same
    request."""
    m = load_model(model, n_ctx=512, compute=Compute(threads=1))
    by_id = {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in out}
    for cid in ids:
        msgs = [{"role": "user", "content": f"Say the number {cid[1:]} in words."}]
        got = generate(m, m.tokenizer.encode(m.chat.render(msgs)), 10, Sampler(GREEDY))
        want = m.tokenizer.decode([t for t in got if t not in m.tokenizer.eot_ids])
        assert by_id[cid] == want, cid
    m.close()


def _done_on_disk(batch_dir: Path, bid: str) -> list[str]:
    """The custom_ids in a batch's output journal as it is on disk (the server stopped), in the
    order they were done."""
    store = BatchStore(batch_dir)
    output, _ = store.journal_paths(bid)
    store.db.close()
    lines = output.read_text().splitlines() if output.exists() else []
    return [json.loads(x)["custom_id"] for x in lines]


def _sample(before: list[str], after: list[str]) -> list[str]:
    """A few done before a kill (the first and last) and a few done after it."""
    return [*before[:2], before[-1], *after[:2], after[-1]]


def _wait(c: openai.OpenAI, bid: str, until, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = c.batches.retrieve(bid)
        if until(b):
            return b
        time.sleep(0.2)
    raise AssertionError(f"batch {bid} stayed {b.status}: {b.request_counts}")


def test_a_batch_survives_a_server_killed_and_restarted(
    smollm2_path: Path, batch_dir: Path, tmp_path: Path
) -> None:
    n = 40  # enough that the kill lands mid-job, with requests done before it and after
    model_id = smollm2_path.stem
    inp = tmp_path / "in.jsonl"
    _input(inp, model_id, n)
    proc, url = _serve(smollm2_path, batch_dir)
    try:
        c = _client(url)
        f = c.files.create(file=inp.open("rb"), purpose="batch")
        assert f.purpose == "batch" and f.bytes == inp.stat().st_size
        b = c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
            metadata={"job": "numbers"},
        )  # fmt: skip
        assert b.status in ("validating", "in_progress") and b.metadata == {"job": "numbers"}
        b = _wait(c, b.id, lambda b: b.request_counts and b.request_counts.completed >= 8)
        assert b.status == "in_progress" and b.request_counts.total == n + 1
        # an interactive chat meanwhile is answered (batch requests wait behind it)
        chat = c.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.usage.completion_tokens >= 1
    finally:
        proc.kill()  # SIGKILL: no chance to tidy up
        proc.wait()
    before = _done_on_disk(batch_dir, b.id)
    assert 8 <= len(before) < n, len(before)  # the kill landed mid-job
    proc, url = _serve(smollm2_path, batch_dir)
    try:
        c = _client(url)
        b = _wait(c, b.id, lambda b: b.status == "completed")
        assert b.request_counts.completed == n and b.request_counts.failed == 1
        assert b.completed_at and b.in_progress_at and b.finalizing_at
        out = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
        errs = [json.loads(x) for x in c.files.content(b.error_file_id).text.splitlines()]
        assert [e["error"]["code"] for e in errs] == ["invalid_json"]
        ids = [o["custom_id"] for o in out]
        assert sorted(ids) == sorted(f"r{i}" for i in range(n))  # each once
        assert ids[: len(before)] == before  # those done before the kill were kept, not redone
        assert [x.id for x in c.batches.list().data] == [b.id]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    _greedy_as_alone(smollm2_path, out, _sample(before, ids[len(before) :]))


def test_cancel_list_and_errors(smollm2_path: Path, batch_dir: Path, tmp_path: Path) -> None:
    inp = tmp_path / "in.jsonl"
    _input(inp, smollm2_path.stem, 60)
    proc, url = _serve(smollm2_path, batch_dir)
    try:
        c = _client(url)
        f = c.files.create(file=inp.open("rb"), purpose="batch")
        first = c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        b = c.batches.cancel(first.id)
        assert b.status in ("cancelling", "cancelled")
        b = _wait(c, first.id, lambda b: b.status == "cancelled")
        assert b.cancelled_at and b.request_counts.completed < 60
        second = c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        listed = c.batches.list(limit=1)
        assert [x.id for x in listed.data] == [second.id] and listed.has_more
        assert [x.id for x in c.batches.list(after=second.id).data] == [first.id]
        # errors in OpenAI's shape, with the reason
        with pytest.raises(openai.BadRequestError, match="input_file_id"):
            c.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                             completion_window="24h")  # fmt: skip
        with pytest.raises(openai.BadRequestError, match="endpoint"):
            c.batches.create(
                input_file_id=f.id, endpoint="/v1/moderations", completion_window="24h"
            )
        with pytest.raises(openai.NotFoundError):
            c.batches.retrieve("batch_nope")
        r = httpx.post(url + "/v1/files", files={"file": ("x.jsonl", b"{}\n")},
                       data={"purpose": "fine-tune"})  # fmt: skip
        assert r.status_code == 400 and "purpose" in r.json()["error"]["message"]
        assert c.files.delete(f.id).deleted
        with pytest.raises(openai.NotFoundError):
            c.files.retrieve(f.id)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_idle_workers_take_batch_requests_and_a_killed_one_hands_them_back(
    spawn_worker: Spawn, smollm2_path: Path, batch_dir: Path, tmp_path: Path
) -> None:
    """serve over two workers whose plan uses one (--tensor-split 0,1,0, the head holding none):
    the idle one runs the whole model as a batch replica. It is SIGKILLed mid-batch (its
    requests go back), started again on its port (it is loaded again and takes requests), and
    the server is SIGKILLed and started again: the batch completes with every custom_id once."""
    n = 60  # enough to last until the worker is back and loaded again, with some left after
    inp = tmp_path / "in.jsonl"
    _input(inp, smollm2_path.stem, n)
    a, b = spawn_worker(), spawn_worker()
    args = ("--peer", a.address, "--peer", b.address, "--mem", "0", "--tensor-split", "0,1,0")
    proc, url = _serve(smollm2_path, batch_dir, *args)
    try:
        c = _client(url)
        batch = _submit(c, inp)
        _wait(c, batch.id, lambda x: x.request_counts and x.request_counts.completed >= 8)
        b.kill()  # the batch replica's machine goes away ...
        _wait(c, batch.id, lambda x: x.request_counts.completed >= 16)
        again = spawn_worker(port=b.port)  # ... and comes back
        assert again.address == b.address
        # it is loaded again (within REVIVE_S) and takes requests
        assert again.wait_for("layers 0–29", timeout=120), "the worker that came back was not used"
    finally:
        proc.kill()
        proc.wait()
    before = _done_on_disk(batch_dir, batch.id)
    assert len(before) < n  # the server was killed mid-job
    proc, url = _serve(smollm2_path, batch_dir, *args)  # the server, started again
    try:
        c = _client(url)
        done = _wait(c, batch.id, lambda x: x.status == "completed")
        out = [json.loads(x) for x in c.files.content(done.output_file_id).text.splitlines()]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "layers 0–29" in b.stop()  # a replica
    ids = [o["custom_id"] for o in out]
    assert sorted(ids) == sorted(f"r{i}" for i in range(n)) and ids[: len(before)] == before
    assert done.request_counts.completed == n and done.request_counts.failed == 1
    _greedy_as_alone(smollm2_path, out, _sample(before, ids[len(before) :]))


def test_a_worker_started_after_the_server_joins_a_running_batch(
    spawn_worker: Spawn, smollm2_path: Path, batch_dir: Path, tmp_path: Path
) -> None:
    """serve over worker a (the head holding none); worker b is in the peers file but not running,
    so it is left out at start. Started while a batch runs, it is found, loaded with the whole
    model (a replica of its own) and takes requests; the batch has every custom_id once."""
    n = 50  # enough to last until b joins, with some left for it
    inp = tmp_path / "in.jsonl"
    _input(inp, smollm2_path.stem, n)
    a, b = spawn_worker(), spawn_worker()
    addr_b = b.address
    b.kill()  # its port, free again: b is started on it later
    config = tmp_path / "config"
    config.mkdir()
    (config / "peers").write_text(addr_b + "\n")
    proc, url = _serve(smollm2_path, batch_dir, "--peer", a.address, "--mem", "0",
                       env={"POTLUCK_CONFIG": str(config)})  # fmt: skip
    server_said = _follow(proc)
    try:
        c = _client(url)
        batch = _submit(c, inp)
        _wait(c, batch.id, lambda x: x.request_counts and x.request_counts.completed >= 5)
        back = spawn_worker(port=b.port)  # started now
        assert back.address == addr_b
        done = _wait(c, batch.id, lambda x: x.status == "completed")
        out = [json.loads(x) for x in c.files.content(done.output_file_id).text.splitlines()]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    said = back.stop()
    assert "layers 0–29" in said, said  # b holds the whole model
    assert f"replica {addr_b} joins" in "".join(server_said), "".join(server_said)
    ids = [o["custom_id"] for o in out]
    assert sorted(ids) == sorted(f"r{i}" for i in range(n))
    assert done.request_counts.completed == n and done.request_counts.failed == 1
    _greedy_as_alone(smollm2_path, out, [*ids[:3], *ids[-3:]])


def test_serve_starts_while_a_peer_is_down_and_takes_it_in_when_it_answers(
    spawn_worker: Spawn, smollm2_path: Path, batch_dir: Path, tmp_path: Path
) -> None:
    """serve --peer a --peer b with b down (the head holding none): it starts on a, names b and
    why, and answers; b, started while a batch runs, is taken in as a replica of its own. (`run`
    fails fast instead: test_pool's test_unreachable_peer.)"""
    with socket.socket() as s:  # b's port: nothing listens there until b starts
        s.bind(("127.0.0.1", 0))
        port_b = s.getsockname()[1]
    addr_b = f"127.0.0.1:{port_b}"
    a = spawn_worker()
    said: list[str] = []
    proc, url = _serve(smollm2_path, batch_dir, "--peer", a.address, "--peer", addr_b,
                       "--mem", "0", said=said)  # fmt: skip
    server_said = _follow(proc)
    try:
        start = " ".join("".join(said).split())  # rich wraps long lines when not a terminal
        assert f"left out {addr_b} (--peer): it does not accept connections" in start, start
        assert "asked again while a batch job runs" in start, start
        c = _client(url)
        chat = c.chat.completions.create(
            model=smollm2_path.stem, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.usage.completion_tokens >= 1
        inp = tmp_path / "in.jsonl"
        _input(inp, smollm2_path.stem, 1000)  # more than the time b needs to join; cancelled then
        batch = _submit(c, inp)
        # the server asks for newcomers every REVIVE_S while the batch runs: b, still down, is
        # asked once (and must not count as tried), then started
        time.sleep(REVIVE_S + 1)
        b = spawn_worker(port=port_b)
        deadline = time.monotonic() + 120
        while f"replica {addr_b} joins" not in "".join(server_said):  # it takes requests ...
            assert time.monotonic() < deadline and proc.poll() is None, "".join(server_said)
            time.sleep(0.2)
        assert "layers 0–29" in b.log, b.log  # ... with the whole model
        c.batches.cancel(batch.id)
    finally:
        proc.kill()
        proc.wait()
