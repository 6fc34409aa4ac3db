"""The blob store shared by processes: two workers on one machine share one cache, and both may
receive the same tensor at once (SmolLM2's tied embedding is the first stage's and the last's).
Real processes write one store here; tests/test_pool.py has the same with real workers."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from potluck.node.weights import BlobStore, IntegrityError

DATA = bytes(range(256)) * 4096  # 1 MiB
DIGEST = hashlib.sha256(DATA).hexdigest()


def _slowly(data: bytes, step: int = 64 * 1024, pause: float = 0.01) -> Iterator[bytes]:
    for off in range(0, len(data), step):
        time.sleep(pause)
        yield data[off : off + step]


def _writer(root: str, start: mp.synchronize.Event, results: mp.Queue) -> None:  # type: ignore[type-arg]
    start.wait()
    try:
        BlobStore(Path(root)).put(DIGEST, len(DATA), _slowly(DATA))
        results.put("ok")
    except Exception as exc:  # reported to the test, which shows it
        results.put(f"{type(exc).__name__}: {exc}")


def test_two_processes_store_the_same_tensor_at_once(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    start, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), start, results)) for _ in range(3)]
    for p in procs:
        p.start()
    start.set()  # all three write at once: each one's pieces take ≈ 0.16 s
    got = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert got == ["ok"] * 3
    blob = tmp_path / DIGEST
    assert blob.read_bytes() == DATA
    assert not list(tmp_path.glob(".part-*"))  # nothing half-written left behind


def test_a_finished_blob_is_taken_and_the_stream_read_past_it(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    store.put(DIGEST, len(DATA), iter([DATA]))
    read: list[int] = []

    def pieces() -> Iterator[bytes]:
        for off in range(0, len(DATA), 4096):
            read.append(off)
            yield DATA[off : off + 4096]

    store.put(DIGEST, len(DATA), pieces())  # another writer's blob, already in place
    assert len(read) == len(DATA) // 4096  # the stream's bytes of this tensor were consumed
    assert store.has(DIGEST) and (tmp_path / DIGEST).read_bytes() == DATA


def test_a_damaged_blob_is_replaced(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    (tmp_path / DIGEST).write_bytes(b"x" * len(DATA))  # right size, wrong bytes
    store.put(DIGEST, len(DATA), iter([DATA]))
    assert (tmp_path / DIGEST).read_bytes() == DATA


def test_a_resume_after_another_writer_went_further(tmp_path: Path) -> None:
    """Asked to resume at byte 1000 while another writer of this cache has since kept 5000 (and
    broken off): the part is cut back to 1000 and completed from the stream."""
    store = BlobStore(tmp_path)
    store.partial_path(DIGEST).write_bytes(DATA[:5000])
    store.put(DIGEST, len(DATA), iter([DATA[1000:]]), offset=1000)
    assert (tmp_path / DIGEST).read_bytes() == DATA
    # a resume from beyond what is kept cannot be completed: said, nothing stored
    store2 = BlobStore(tmp_path / "other")
    store2.partial_path(DIGEST).write_bytes(DATA[:100])
    with pytest.raises(IntegrityError, match="asked to resume at byte 1,000, 100 bytes are kept"):
        store2.put(DIGEST, len(DATA), iter([DATA[1000:]]), offset=1000)
