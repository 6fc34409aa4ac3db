"""Where the Files and Batches API keeps its state (batches.py serves it): a SQLite database (the
standard library's) and the files' bytes, under one folder (the cache's `batches/`). Files are rows
plus a file each; a batch is OpenAI's JSON object, stored whole and replaced on each change."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")  # the statuses not yet ended

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
  id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
  created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
  id TEXT PRIMARY KEY, seq INTEGER NOT NULL, body TEXT NOT NULL);
"""


class BatchStore:
    """Files and batches on disk: <root>/potluck.sqlite3 and <root>/files/<file id>. One lock: the
    server's loop and the runner both use it."""

    def __init__(self, root: Path) -> None:
        self.root, self.files_dir = root, root / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(root / "potluck.sqlite3", check_same_thread=False)
        self.db.executescript(_SCHEMA)
        self.lock = threading.Lock()

    # files
    def add_file(self, data: bytes, filename: str, purpose: str) -> dict[str, Any]:
        fid = f"file-{uuid.uuid4().hex[:24]}"
        return self.add_file_at(fid, data, filename, purpose)

    def add_file_at(self, fid: str, data: bytes, filename: str, purpose: str) -> dict[str, Any]:
        tmp = self.files_dir / f".{fid}.tmp"
        tmp.write_bytes(data)
        tmp.replace(self.files_dir / fid)
        with self.lock, self.db:
            self.db.execute(
                "INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?)",
                (fid, purpose, filename, len(data), int(time.time())),
            )
        return self.file(fid)  # type: ignore[return-value]

    def file(self, fid: str) -> dict[str, Any] | None:
        with self.lock:
            row = self.db.execute("SELECT * FROM files WHERE id = ?", (fid,)).fetchone()
        if row is None:
            return None
        fid, purpose, filename, nbytes, created = row
        return {"id": fid, "object": "file", "bytes": nbytes, "created_at": created,
                "filename": filename, "purpose": purpose, "status": "processed",
                "expires_at": None, "status_details": None}  # fmt: skip

    def files(self) -> list[dict[str, Any]]:
        with self.lock:
            ids = [r[0] for r in self.db.execute("SELECT id FROM files ORDER BY created_at")]
        return [f for i in ids if (f := self.file(i)) is not None]

    def delete_file(self, fid: str) -> bool:
        with self.lock, self.db:
            gone = self.db.execute("DELETE FROM files WHERE id = ?", (fid,)).rowcount
        (self.files_dir / fid).unlink(missing_ok=True)
        return bool(gone)

    def path(self, fid: str) -> Path:
        return self.files_dir / fid

    # batches
    def put(self, batch: dict[str, Any]) -> None:
        with self.lock, self.db:
            seq = self.db.execute(
                "SELECT COALESCE((SELECT seq FROM batches WHERE id = ?), "
                "(SELECT COALESCE(MAX(seq), 0) + 1 FROM batches))",
                (batch["id"],),
            ).fetchone()[0]
            self.db.execute(
                "INSERT OR REPLACE INTO batches VALUES (?, ?, ?)",
                (batch["id"], seq, json.dumps(batch)),
            )

    def batch(self, bid: str) -> dict[str, Any] | None:
        with self.lock:
            row = self.db.execute("SELECT body FROM batches WHERE id = ?", (bid,)).fetchone()
        return json.loads(row[0]) if row else None

    def batches(self) -> list[dict[str, Any]]:
        """Newest first, as OpenAI lists them."""
        with self.lock:
            rows = self.db.execute("SELECT body FROM batches ORDER BY seq DESC").fetchall()
        return [json.loads(r[0]) for r in rows]

    def journal_paths(self, bid: str) -> tuple[Path, Path]:
        return self.root / f"{bid}.output.jsonl", self.root / f"{bid}.errors.jsonl"


def batch_progress(store: BatchStore, recent: int = 3) -> list[dict[str, Any]]:
    """The dashboard's view: every active batch and the last few finished ones, oldest first."""
    shown, done = [], 0
    for b in store.batches():  # newest first
        if b["status"] not in ACTIVE:
            done += 1
            if done > recent:
                continue
        counts = b.get("request_counts") or {}
        shown.append({"id": b["id"], "status": b["status"], "total": counts.get("total", 0),
                      "completed": counts.get("completed", 0), "failed": counts.get("failed", 0)})  # fmt: skip
    return shown[::-1]
