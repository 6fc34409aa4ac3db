"""`potluck batch`: an OpenAI Batch API input file, run through the same handlers as `potluck serve`.

Each input line is `{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions" | "/v1/embeddings", "body"}`. A line goes, in-process, to the very code that
answers HTTP requests (the FastAPI app over an ASGI transport: the same validation, chat template,
sampling and response body as the server), `parallel` at a time through one scheduler (continuous
batching). Output lines are OpenAI's:
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`.

Nothing lost, nothing done twice: the output and error files are the journal. A line is written
whole and fsynced once its item is finished; on start, the items already in either file are
skipped (a line cut short by a kill is dropped first), so running the same command again after
the process was killed finishes the job with every custom_id exactly once. Items that failed for
the server's sake (HTTP 5xx: a pool that lost its nodes) leave the error file and run again.
Bad lines (not JSON, no or a repeated custom_id, another method or URL, a body the API rejects)
go to the error file with the reason and their line number; the rest of the job runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

EMBEDDINGS = "/v1/embeddings"
URLS = ("/v1/chat/completions", "/v1/completions", EMBEDDINGS)
REVIVE_S = 5.0  # how often replicas are recruited while a job runs (seconds)


async def _nobody() -> list[tuple[str, Any]]:
    return []


@dataclass(frozen=True)
class Recruit:
    """How a running job gains replicas, asked every REVIVE_S while items are left.
    revive(label): a failed replica's app again once its machine is back (else None);
    join(): replicas on machines found since the job began, (label, app) each."""

    revive: Callable[[str], Awaitable[Any | None]]
    join: Callable[[], Awaitable[list[tuple[str, Any]]]] = _nobody


@dataclass(frozen=True)
class Item:
    line: int  # 1-based, in the input file
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class BadLine:
    line: int
    custom_id: str | None
    code: str
    message: str


def read_input(path: Path) -> tuple[list[Item], list[BadLine]]:
    """The items of a batch input file, and the lines that cannot run (with the reason)."""
    items: list[Item] = []
    bad: list[BadLine] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except ValueError as exc:
                bad.append(BadLine(n, None, "invalid_json", f"line {n} is not JSON ({exc})"))
                continue
            if not isinstance(obj, dict):
                bad.append(BadLine(n, None, "invalid_line", f"line {n} is not a JSON object"))
                continue
            cid = obj.get("custom_id")
            problem = _problem(obj, cid, seen)
            if problem is not None:
                bad.append(BadLine(n, cid if isinstance(cid, str) else None, *problem))
                continue
            assert isinstance(cid, str)  # _problem refuses any other
            seen.add(cid)
            items.append(Item(n, cid, obj["url"], obj["body"]))
    return items, bad


def _problem(obj: dict[str, Any], cid: object, seen: set[str]) -> tuple[str, str] | None:
    """(code, message) for a line that cannot run, else None."""
    if not isinstance(cid, str) or not cid:
        return "missing_custom_id", "custom_id must be a non-empty string"
    if cid in seen:
        return "duplicate_custom_id", f"custom_id {cid!r} is used by an earlier line"
    if obj.get("method") != "POST":
        return "invalid_method", f"method {obj.get('method')!r}: only POST is supported"
    if obj.get("url") not in URLS:
        return "invalid_url", f"url {obj.get('url')!r}: use {', '.join(URLS)}"
    body = obj.get("body")
    if not isinstance(body, dict):
        return "invalid_body", "body must be a JSON object (the request the URL takes)"
    if body.get("stream"):
        return "invalid_body", "stream is not allowed in a batch"
    return None


class Journal:
    """The output and error files: what they hold is done. Lines are written whole and fsynced,
    one writer at a time."""

    def __init__(self, output: Path, errors: Path) -> None:
        self.output, self.errors = output, errors
        self.done_ids: set[str] = set()  # custom_ids in the output
        self.done_lines: set[int] = set()  # input lines in the error file
        self.retried = 0  # items whose earlier failure may pass now: run again
        for obj in _read_whole_lines(output):
            if isinstance(obj.get("custom_id"), str):
                self.done_ids.add(obj["custom_id"])
        failed = _read_whole_lines(errors)
        final = [o for o in failed if not _retryable(o)]
        if len(final) != len(failed):  # the server's failures (a pool lost): not the item's
            self.retried = len(failed) - len(final)
            tmp = errors.with_name(errors.name + ".tmp")
            tmp.write_text("".join(json.dumps(o, ensure_ascii=False) + "\n" for o in final))
            os.replace(tmp, errors)
        for obj in final:
            line = (obj.get("error") or {}).get("line")
            if isinstance(line, int):
                self.done_lines.add(line)
        self._lock = threading.Lock()

    def is_done(self, item: Item | BadLine) -> bool:
        if isinstance(item, Item) and item.custom_id in self.done_ids:
            return True
        return item.line in self.done_lines

    def write(self, path: Path, obj: dict[str, Any]) -> None:
        data = (json.dumps(obj, ensure_ascii=False) + "\n").encode()
        with self._lock, open(path, "ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def _retryable(obj: dict[str, Any]) -> bool:
    """An error line that says the server failed (5xx, or no answer), not the request."""
    code = str((obj.get("error") or {}).get("code", ""))
    return code == "server_error" or code.startswith("http_5")


def _read_whole_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a journal file; a last line cut short (a kill in the middle of a write)
    is removed from the file."""
    if not path.exists():
        return []
    data = path.read_bytes()
    keep = data if data.endswith(b"\n") or not data else data[: data.rfind(b"\n") + 1]
    if len(keep) != len(data):
        with open(path, "r+b") as f:
            f.truncate(len(keep))
    out = []
    for raw in keep.decode("utf-8", errors="replace").splitlines():
        try:
            obj = json.loads(raw)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


@dataclass
class Progress:
    total: int
    done: int = 0
    failed: int = 0
    tokens: int = 0
    t0: float = 0.0
    by_replica: dict[str, int] = field(default_factory=dict)  # requests each replica finished
    lost: list[str] = field(default_factory=list)  # replicas that failed, in order
    back: list[str] = field(default_factory=list)  # failed replicas that joined again, in order
    joined: list[str] = field(default_factory=list)  # replicas new since the job began, in order


def _error_line(
    line: int, cid: str | None, code: str, message: str, response: Any = None
) -> dict[str, Any]:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": cid,
        "response": response,
        "error": {"code": code, "message": message, "line": line},
    }


class _ServerFailed(Exception):
    """The replica, not the request, failed (HTTP 5xx or no answer): `line` is the error line."""

    def __init__(self, line: dict[str, Any]) -> None:
        super().__init__(line["error"]["message"])
        self.line = line


async def _run_item(
    client: httpx.AsyncClient, item: Item, extra: dict[str, str]
) -> tuple[bool, dict[str, Any]]:
    """POST one item: (True, output line) on 200, (False, error line) on a 4xx; raises
    _ServerFailed when the replica failed."""
    rid = f"req_{uuid.uuid4().hex}"
    try:
        headers = {"X-Request-Id": rid, "X-Potluck-Priority": "batch", **extra}
        resp = await client.post(item.url, json=item.body, headers=headers)
        body = resp.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise _ServerFailed(
            _error_line(item.line, item.custom_id, "server_error", str(exc))
        ) from exc
    response = {"status_code": resp.status_code, "request_id": rid, "body": body}
    if resp.status_code == 200:
        line = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": item.custom_id,
                "response": response, "error": None}  # fmt: skip
        return True, line
    message = (body.get("error") or {}).get("message") if isinstance(body, dict) else None
    err = _error_line(
        item.line, item.custom_id, f"http_{resp.status_code}", message or "", response
    )
    if resp.status_code >= 500:
        raise _ServerFailed(err)
    return False, err


async def run_batch(
    apps: Sequence[tuple[str, Any]],
    items: list[Item],
    journal: Journal,
    parallel: int,
    on_progress: Callable[[Progress], None] = lambda p: None,
    stop: Callable[[], bool] = lambda: False,
    headers: dict[str, str] | None = None,
    recruit: Recruit | None = None,
) -> Progress:
    """Run the items not yet in the journal through the replicas' apps ((label, ASGI app) each),
    `parallel` at a time on each: a replica takes the next item whenever it has room (work
    stealing: long items do not hold the others back). A replica that fails hands the item back
    and takes no more; when none is left, the rest go to the error file (as 5xx, to run again).
    stop(): no more items are started once it says so (a cancelled batch); the ones running end.
    headers: sent with every item (the server's API key). recruit: every REVIVE_S while items are
    left, each failed replica whose machine is back joins the job again, and so does each new
    replica that recruit.join() brings."""
    todo = deque(it for it in items if not journal.is_done(it))
    progress = Progress(total=len(todo), t0=time.perf_counter())
    alive = {label for label, _ in apps}
    timeout = httpx.Timeout(None)  # an item takes as long as its generation does

    async def replica(label: str, app: Any) -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://batch", timeout=timeout
        ) as c:

            async def lane() -> None:
                while todo and label in alive and not stop():
                    item = todo.popleft()
                    try:
                        ok, line = await _run_item(c, item, headers or {})
                    except _ServerFailed as exc:
                        if label in alive:
                            alive.discard(label)
                            progress.lost.append(label)
                        if alive:  # another replica takes it
                            todo.appendleft(item)
                        else:
                            journal.write(journal.errors, exc.line)
                            progress.failed += 1
                        on_progress(progress)
                        return
                    if ok:
                        journal.write(journal.output, line)
                        progress.done += 1
                        progress.by_replica[label] = progress.by_replica.get(label, 0) + 1
                        usage = line["response"]["body"].get("usage") or {}
                        progress.tokens += int(usage.get("completion_tokens", 0))
                    else:
                        journal.write(journal.errors, line)
                        progress.failed += 1
                    on_progress(progress)

            await asyncio.gather(*(lane() for _ in range(parallel)))

    tasks = [asyncio.create_task(replica(label, app)) for label, app in apps]

    labels = [label for label, _ in apps]

    async def recruiter() -> None:
        assert recruit is not None
        while todo and not stop():
            await asyncio.sleep(REVIVE_S)
            for label in [lb for lb in labels if lb not in alive]:
                app = await recruit.revive(label)
                if app is not None and todo:
                    alive.add(label)
                    progress.back.append(label)
                    on_progress(progress)
                    tasks.append(asyncio.create_task(replica(label, app)))
            for label, app in await recruit.join():
                labels.append(label)
                alive.add(label)
                progress.joined.append(label)
                on_progress(progress)
                tasks.append(asyncio.create_task(replica(label, app)))

    watcher = asyncio.create_task(recruiter()) if recruit is not None else None
    while not all(t.done() for t in tasks):  # (the recruiter may add replicas meanwhile)
        await asyncio.wait([t for t in tasks if not t.done()])
    if watcher is not None:
        watcher.cancel()
    for t in tasks:
        t.result()  # a bug in a lane is said, not swallowed
    if todo and not stop():  # every replica failed with items left: they run again next time
        for item in todo:
            journal.write(journal.errors, _error_line(
                item.line, item.custom_id, "server_error", "every replica failed"
            ))  # fmt: skip
            progress.failed += 1
    return progress


def write_bad_lines(bad: list[BadLine], journal: Journal) -> int:
    """Put the lines that cannot run in the error file (once); how many were new."""
    new = [b for b in bad if not journal.is_done(b)]
    for b in new:
        journal.write(journal.errors, _error_line(b.line, b.custom_id, b.code, b.message))
    return len(new)
