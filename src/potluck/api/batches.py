"""OpenAI's Files and Batches API on `potluck serve`: upload a batch input file, create a batch, poll
it, download its output and error files. Batches run on the server's own model, behind the
interactive requests (their requests carry X-Potluck-Priority: batch), and survive a restart.

    POST /v1/files (multipart: purpose=batch, file)    GET /v1/files/{id}    GET /v1/files
    GET /v1/files/{id}/content                          DELETE /v1/files/{id}
    POST /v1/batches {input_file_id, endpoint, completion_window: "24h", metadata}
    GET /v1/batches/{id}    POST /v1/batches/{id}/cancel    GET /v1/batches?after=&limit=

State: batch_store.py's `BatchStore` (a SQLite database and the files, under the cache's
`batches/`). A batch goes validating → in_progress → finalizing → completed; cancel makes it
cancelling → cancelled once its running requests end; one not done 24 h after it was created is
expired. Its requests run through api/batch.py's runner with its journal (an output and an error
file per batch), so a server killed mid-batch continues it on restart, every request once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, File, Form, UploadFile, params
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from potluck.api import errors
from potluck.api.batch import (
    EMBEDDINGS,
    URLS,
    BadLine,
    Item,
    Journal,
    Progress,
    Recruit,
    read_input,
    run_batch,
    write_bad_lines,
)
from potluck.api.batch_store import ACTIVE, BatchStore

log = logging.getLogger(__name__)
WINDOW_S = 24 * 3600  # "24h", the one completion window OpenAI offers
MAX_FILE_BYTES = 200 * 2**20  # OpenAI's limit for a batch input file
LANES_BEHIND_CHATS = 1  # sequences a batch leaves free for interactive requests (of -np)


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


class BatchRunner:
    """Runs the store's active batches one after the other, in the server's event loop, on its
    replicas: (label, app) each, the server's own app first (then workers the server leaves
    idle, each running the whole model); `wake()` after a batch is created or cancelled."""

    def __init__(
        self,
        store: BatchStore,
        apps: list[tuple[str, Any]],
        lanes: int,
        headers: dict[str, str],
        recruit: Recruit | None = None,
    ) -> None:
        self.store, self.apps, self.lanes, self.headers = store, apps, lanes, headers
        self.recruit = recruit  # replicas back or new while a batch runs (kept for the next ones)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            todo = [b for b in reversed(self.store.batches()) if b["status"] in ACTIVE]
            if not todo:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._run(todo[0])
            except Exception:  # a bug must not stop every later batch: fail this one, go on
                log.exception("batch %s failed", todo[0]["id"])
                b = self.store.batch(todo[0]["id"]) or todo[0]
                self.store.put({**b, "status": "failed", "failed_at": int(time.time()),
                                "errors": _errors("internal_error", "the batch runner failed")})  # fmt: skip

    async def _run(self, b: dict[str, Any]) -> None:
        bid = b["id"]
        source = self.store.path(b["input_file_id"])
        if not source.is_file():
            self.store.put({**b, "status": "failed", "failed_at": int(time.time()),
                            "errors": _errors("missing_file", f"input file {b['input_file_id']} is gone")})  # fmt: skip
            return
        items, bad = read_input(source)
        for it in items:  # every line goes to the batch's own endpoint
            if it.url != b["endpoint"]:
                bad.append(_wrong_url(it, b["endpoint"]))
        items = [it for it in items if it.url == b["endpoint"]]
        out, err = self.store.journal_paths(bid)
        journal = Journal(out, err)
        write_bad_lines(bad, journal)
        total = len(items) + len(bad)
        if b["status"] == "validating":
            b = {**b, "status": "in_progress", "in_progress_at": int(time.time())}
            self.store.put(b)

        def counts() -> dict[str, int]:
            return {"total": total, "completed": _lines(out), "failed": _lines(err)}

        said = [0, 0, 0]  # replicas lost / back / joined so far, as logged

        def on_progress(p: Progress) -> None:
            for label in p.lost[said[0] :]:
                log.warning(
                    "batch %s: replica %s failed; its requests go to the others", bid, label
                )
            for label in p.back[said[1] :]:
                log.warning("batch %s: replica %s is back", bid, label)
            for label in p.joined[said[2] :]:
                log.warning("batch %s: replica %s joins", bid, label)
            said[:] = [len(p.lost), len(p.back), len(p.joined)]
            fresh = self.store.batch(bid) or b
            self.store.put({**fresh, "request_counts": counts()})

        def stop() -> bool:
            fresh = self.store.batch(bid) or b
            status: str = fresh["status"]
            expires_at: int = fresh["expires_at"]
            return status == "cancelling" or time.time() > expires_at

        if b["status"] == "in_progress":
            self.store.put({**b, "request_counts": counts()})
            # embeddings on the server's own app alone: the replicas on idle workers hold the
            # chat model over a pool (no hidden states come back) and no embedding model beside
            embeds = b["endpoint"] == EMBEDDINGS
            apps, recruit = (self.apps[:1], None) if embeds else (self.apps, self._recruit())
            await run_batch(
                apps, items, journal, self.lanes, on_progress, stop, self.headers, recruit
            )
        self._finish(bid, journal, counts())

    def _recruit(self) -> Recruit | None:
        """self.recruit, keeping what it brings for the next batches too."""
        if self.recruit is None:
            return None
        recruit = self.recruit

        async def revive(label: str) -> Any | None:
            app = await recruit.revive(label)
            if app is not None:
                self.apps = [(lb, app if lb == label else a) for lb, a in self.apps]
            return app

        async def join() -> list[tuple[str, Any]]:
            new = await recruit.join()
            self.apps = [*self.apps, *new]
            return new

        return Recruit(revive, join)

    def _finish(self, bid: str, journal: Journal, counts: dict[str, int]) -> None:
        b = self.store.batch(bid)
        assert b is not None
        now = int(time.time())
        if b["status"] == "cancelling":
            end = {"status": "cancelled", "cancelled_at": now}
        elif now > b["expires_at"] and counts["completed"] + counts["failed"] < counts["total"]:
            end = {"status": "expired", "expired_at": now}
        else:
            self.store.put({**b, "status": "finalizing", "finalizing_at": now})
            end = {"status": "completed", "completed_at": int(time.time())}
        files = {}
        for key, path, suffix in (("output_file_id", journal.output, "output"),
                                  ("error_file_id", journal.errors, "errors")):  # fmt: skip
            if path.exists() and path.stat().st_size:
                f = self.store.add_file_at(f"file-{bid}-{suffix}", path.read_bytes(),
                                           f"{bid}_{suffix}.jsonl", f"batch_{suffix}")  # fmt: skip
                files[key] = f["id"]
        b = self.store.batch(bid) or b
        self.store.put({**b, **end, **files, "request_counts": counts})
        log.info("batch %s %s: %s", bid, end["status"], counts)


def _lines(path: Path) -> int:
    return sum(1 for _ in open(path, "rb")) if path.exists() else 0


def _errors(code: str, message: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"code": code, "message": message, "param": None,
                                        "line": None}]}  # fmt: skip


def _wrong_url(it: Item, endpoint: str) -> BadLine:
    return BadLine(it.line, it.custom_id, "invalid_url",
                   f"url {it.url!r} is not the batch's endpoint {endpoint!r}")  # fmt: skip


def new_batch(req: BatchCreate) -> dict[str, Any]:
    now = int(time.time())
    return {
        "id": f"batch_{uuid.uuid4().hex[:24]}", "object": "batch", "endpoint": req.endpoint,
        "errors": None, "input_file_id": req.input_file_id,
        "completion_window": req.completion_window, "status": "validating",
        "output_file_id": None, "error_file_id": None, "created_at": now,
        "in_progress_at": None, "expires_at": now + WINDOW_S, "finalizing_at": None,
        "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None,
        "cancelled_at": None, "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": req.metadata,
    }  # fmt: skip


def add_batch_routes(
    app: FastAPI, store: BatchStore, runner: BatchRunner, guarded: list[params.Depends]
) -> None:
    """The Files and Batches endpoints on `app` (guarded: the API key check)."""

    @app.post("/v1/files", dependencies=guarded)
    async def upload(file: UploadFile = File(...), purpose: str = Form(...)) -> dict[str, Any]:  # noqa: B008
        if purpose != "batch":
            raise errors.bad_request(
                f"purpose {purpose!r}: this server takes 'batch' files", "purpose"
            )
        data = await file.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise errors.bad_request(
                f"the file is larger than {MAX_FILE_BYTES // 2**20} MiB; split the batch", "file"
            )
        return store.add_file(data, file.filename or "upload.jsonl", purpose)

    @app.get("/v1/files", dependencies=guarded)
    async def list_files() -> dict[str, Any]:
        return {"object": "list", "data": store.files(), "has_more": False}

    @app.get("/v1/files/{fid}", dependencies=guarded)
    async def get_file(fid: str) -> dict[str, Any]:
        return _found(store.file(fid), "file", fid)

    @app.get("/v1/files/{fid}/content", dependencies=guarded)
    async def file_content(fid: str) -> Response:
        _found(store.file(fid), "file", fid)
        return Response(store.path(fid).read_bytes(), media_type="application/jsonl")

    @app.delete("/v1/files/{fid}", dependencies=guarded)
    async def delete_file(fid: str) -> dict[str, Any]:
        _found(store.file(fid), "file", fid)
        store.delete_file(fid)
        return {"id": fid, "object": "file", "deleted": True}

    @app.post("/v1/batches", dependencies=guarded)
    async def create(body: BatchCreate) -> dict[str, Any]:
        if body.endpoint not in URLS:
            raise errors.bad_request(
                f"endpoint {body.endpoint!r}: use {', '.join(URLS)}", "endpoint"
            )
        if body.completion_window != "24h":
            raise errors.bad_request("completion_window must be '24h'", "completion_window")
        f = store.file(body.input_file_id)
        if f is None or f["purpose"] != "batch":
            raise errors.bad_request(
                f"input_file_id {body.input_file_id!r} is not an uploaded batch file",
                "input_file_id",
            )
        batch = new_batch(body)
        store.put(batch)
        runner.wake()
        return batch

    @app.get("/v1/batches/{bid}", dependencies=guarded)
    async def get_batch(bid: str) -> dict[str, Any]:
        return _found(store.batch(bid), "batch", bid)

    @app.post("/v1/batches/{bid}/cancel", dependencies=guarded)
    async def cancel(bid: str) -> dict[str, Any]:
        b = _found(store.batch(bid), "batch", bid)
        if b["status"] in ("validating", "in_progress"):
            b = {**b, "status": "cancelling", "cancelling_at": int(time.time())}
            store.put(b)
            runner.wake()
        return b

    @app.get("/v1/batches", dependencies=guarded)
    async def list_batches(after: str | None = None, limit: int = 20) -> dict[str, Any]:
        all_ = store.batches()
        if after is not None:
            ids = [b["id"] for b in all_]
            all_ = all_[ids.index(after) + 1 :] if after in ids else []
        limit = max(1, min(limit, 100))
        page = all_[:limit]
        return {"object": "list", "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(all_) > limit}  # fmt: skip


def _found(obj: dict[str, Any] | None, what: str, oid: str) -> dict[str, Any]:
    if obj is None:
        raise errors.ApiError(404, f"no {what} with id {oid!r}", "invalid_request_error", "id",
                              f"{what}_not_found")  # fmt: skip
    return obj
