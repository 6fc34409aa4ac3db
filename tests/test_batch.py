"""`potluck batch`: OpenAI batch files through the server's own handlers, nothing lost, nothing
done twice. Real `potluck batch` processes on the packaged SmolLM2; a kill is a real SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from potluck.api.batch import Journal, read_input
from potluck.engine.generate import generate
from potluck.model.stage import Compute
from potluck.pool.build import load_model
from potluck.sampling import GREEDY, Sampler
from workers import Spawn
from workers import spawn_worker as spawn_worker

MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"
# one thread, as the `potluck batch` processes here (-t 1) and the workers: a process spinning on
# every core slows to a crawl when other tests share them
ONE_THREAD = Compute(threads=1)


def _chat(cid: str, question: str, n: int = 12, **extra: object) -> str:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": question}],
            "max_tokens": n, "temperature": 0, **extra}  # fmt: skip
    return json.dumps(
        {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}
    )


def _batch(inp: Path, out: Path, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "potluck.cli", "batch", str(inp), "-o", str(out), "--no-mdns",
         "-t", "1", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "POTLUCK_MDNS": "0"}, **kw,
    )  # fmt: skip


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _content(line: dict) -> str:
    choice = line["response"]["body"]["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def _count_input(tmp_path: Path, n: int, tokens: int) -> Path:
    """An input of n requests ("q<i>": count from i) of `tokens` tokens each."""
    inp = tmp_path / "in.jsonl"
    inp.write_text(
        "".join(_chat(f"q{i}", f"Count from {i} to {i + 20}.", n=tokens) + "\n" for i in range(n))
    )
    return inp


def _alone(model: Path, ids: list[str], tokens: int) -> dict[str, str]:
    """The greedy answers to _count_input's requests `ids` as one process alone gives them
    (potluck run's path)."""
    m = load_model(model, compute=ONE_THREAD)
    want = {}
    for cid in ids:
        msgs = [{"role": "user", "content": f"Count from {cid[1:]} to {int(cid[1:]) + 20}."}]
        gen = generate(m, m.tokenizer.encode(m.chat.render(msgs)), tokens, Sampler(GREEDY))
        want[cid] = m.tokenizer.decode([t for t in gen if t not in m.tokenizer.eot_ids])
    m.close()
    return want


def test_bad_lines_go_to_the_error_file_and_the_rest_runs(
    smollm2_path: Path, tmp_path: Path
) -> None:
    completion = {"custom_id": "c", "method": "POST", "url": "/v1/completions",
                  "body": {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 8,
                           "temperature": 0}}  # fmt: skip
    inp = tmp_path / "in.jsonl"
    inp.write_text(
        "\n".join([
            _chat("a", "The capital of France is"),
            '{"custom_id": "torn", ',  # 2: not JSON
            json.dumps({"custom_id": "u", "method": "POST", "url": "/v1/moderations", "body": {}}),
            _chat("a", "A repeated custom_id"),  # 4
            _chat("b", "Name three planets."),
            json.dumps(completion),
            _chat("t", "hi", top_p=7),  # 7: a body the API rejects (400)
            _chat("m", "hi") .replace(MODEL_ID, "gpt-4o"),  # 8: a model this server lacks (404)
            json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),  # 9: no id
        ]) + "\n"
    )  # fmt: skip
    out = tmp_path / "out.jsonl"
    done = _batch(inp, out)
    _, said = done.communicate(timeout=300)
    assert done.returncode == 0, said
    results = {line["custom_id"]: line for line in _lines(out)}
    assert sorted(results) == ["a", "b", "c"]
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in results.values())
    for r in results.values():  # serve's usage, cached prompt tokens included
        usage = r["response"]["body"]["usage"]
        assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]
    errors = {e["error"]["line"]: e for e in _lines(tmp_path / "out.errors.jsonl")}
    codes = {line: e["error"]["code"] for line, e in errors.items()}
    assert codes == {2: "invalid_json", 3: "invalid_url", 4: "duplicate_custom_id",
                     7: "http_400", 8: "http_404", 9: "missing_custom_id"}  # fmt: skip
    assert "top_p" in errors[7]["error"]["message"] and errors[7]["response"]["status_code"] == 400
    assert "gpt-4o" in errors[8]["error"]["message"]
    # greedy text as one process gives it alone (potluck run's path)
    m = load_model(smollm2_path, compute=ONE_THREAD)
    ids = m.tokenizer.encode(
        m.chat.render([{"role": "user", "content": "The capital of France is"}])
    )
    gen = generate(m, ids, 12, Sampler(GREEDY))
    want = m.tokenizer.decode([t for t in gen if t not in m.tokenizer.eot_ids])
    assert _content(results["a"]) == want
    # the same command again: nothing left to do, nothing written twice
    again = _batch(inp, out)
    _, said = again.communicate(timeout=300)
    assert again.returncode == 0 and "every request is done" in said, said
    assert len(_lines(out)) == 3 and len(_lines(tmp_path / "out.errors.jsonl")) == 6


@pytest.mark.slow  # a killed run + a resumed run
def test_a_killed_batch_resumes_with_every_request_exactly_once(
    smollm2_path: Path, tmp_path: Path
) -> None:
    """SIGKILL in the middle of the job (and a line cut short, as a kill in a write leaves it);
    the same command again finishes it: every custom_id once, each answer as one process alone
    gives it."""
    n = 10
    inp = _count_input(tmp_path, n, tokens=16)
    want = _alone(smollm2_path, [f"q{i}" for i in range(n)], tokens=16)
    out = tmp_path / "out.jsonl"
    proc = _batch(inp, out, "-np", "2")
    deadline = time.monotonic() + 300
    while len(_lines(out)) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    kept = len(_lines(out))
    assert 3 <= kept < n
    with open(out, "a") as f:
        f.write('{"id": "batch_req_cut", "custom_')  # a write the kill cut short
    again = _batch(inp, out, "-np", "2")
    _, said = again.communicate(timeout=600)
    assert again.returncode == 0, said
    assert f"resuming: {kept} of {n} requests are done" in said
    lines = _lines(out)
    ids = [line["custom_id"] for line in lines]
    assert sorted(ids) == sorted(want) and len(ids) == n
    assert {line["custom_id"]: _content(line) for line in lines} == want
    assert not (tmp_path / "out.errors.jsonl").exists() or not _lines(tmp_path / "out.errors.jsonl")


def test_the_journal_reruns_what_failed_for_the_servers_sake(tmp_path: Path) -> None:
    """An error line of HTTP 5xx (a pool lost) leaves the error file and its item runs again; a
    4xx stays; a torn last line is dropped."""
    inp = tmp_path / "in.jsonl"
    inp.write_text(_chat("x", "a") + "\n" + _chat("y", "b") + "\n")
    items, bad = read_input(inp)
    assert [it.custom_id for it in items] == ["x", "y"] and not bad
    errors = tmp_path / "e.jsonl"
    errors.write_text(
        json.dumps({"custom_id": "x", "error": {"code": "http_503", "message": "", "line": 1}})
        + "\n"
        + json.dumps({"custom_id": "y", "error": {"code": "http_400", "message": "", "line": 2}})
        + "\n"
        + '{"custom_id": "z", "err'
    )
    journal = Journal(tmp_path / "o.jsonl", errors)
    assert journal.retried == 1
    assert not journal.is_done(items[0]) and journal.is_done(items[1])
    assert [e["custom_id"] for e in _lines(errors)] == ["y"]


@pytest.mark.slow  # a run with a replica killed and back
def test_replicas_on_two_workers_survive_one_killed(
    spawn_worker: Spawn, smollm2_path: Path, tmp_path: Path
) -> None:
    """Two workers, each holding the whole model, are two replicas (the head holds none:
    --mem 0); one is SIGKILLed mid-job: its requests go to the other; started again on its
    port, it joins the job again; the output has every custom_id once, each answer as one
    process alone gives it (a sample: the first done, with both replicas, and the last, once a
    is back)."""
    n = 40  # enough to last until a is back and loaded again
    inp = _count_input(tmp_path, n, tokens=24)
    a, b = spawn_worker(), spawn_worker()
    addr_a, addr_b = a.address, b.address
    plan = subprocess.run(
        [sys.executable, "-m", "potluck.cli", "plan", "--batch", "-m", str(smollm2_path),
         "--peer", addr_a, "--peer", addr_b, "--mem", "0", "--no-mdns", "-np", "2"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "POTLUCK_MDNS": "0", "COLUMNS": "200"},
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    assert addr_a in plan.stdout and addr_b in plan.stdout, plan.stdout
    assert "best single machine: 127.0.0.1:" in plan.stdout and "the pool:" in plan.stdout
    out = tmp_path / "out.jsonl"
    proc = _batch(inp, out, "--peer", addr_a, "--peer", addr_b, "--mem", "0", "-np", "2")
    deadline = time.monotonic() + 300
    while len(_lines(out)) < 4:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    a.kill()
    again = spawn_worker(port=a.port)  # the same machine, back
    assert again.address == addr_a
    _, said = proc.communicate(timeout=600)
    assert proc.returncode == 0, said
    assert (
        f"replica {addr_a}: the whole model" in said
        and f"replica {addr_b}: the whole model" in said
    )
    assert f"replica {addr_a} failed" in said, said
    assert f"replica {addr_a} is back" in said, said
    lines = _lines(out)
    assert sorted(line["custom_id"] for line in lines) == sorted(f"q{i}" for i in range(n))
    sample = [*lines[:4], *lines[-4:]]
    want = _alone(smollm2_path, [line["custom_id"] for line in sample], tokens=24)
    assert {line["custom_id"]: _content(line) for line in sample} == want
    assert not _lines(tmp_path / "out.errors.jsonl")
