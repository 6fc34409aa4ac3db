"""Weights travel once: content hashes, a blob cache on disk, and a WeightSource over it.

A worker that has the model file (same sha256) memory-maps it. Otherwise the head sends only the
stage's tensors; each is verified against its sha256 and kept under the cache by that hash, so a
later plan (or a restart) finds it again without any transfer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from potluck.errors import ModelFileError, PotluckError
from potluck.files import locked, private_tmp
from potluck.modelfile.gguf_file import TensorInfo
from potluck.modelfile.sources import Places, find_models

_HASH_BLOCK = 8 * 2**20
_memo_lock = threading.Lock()  # the hash memos' read-merge-write (sha256_file, tensor_digests)


class IntegrityError(PotluckError):
    """Received bytes whose hash is not the one announced."""


def sha256_bytes(data: bytes | memoryview | np.ndarray) -> str:
    if isinstance(data, bytes):
        return hashlib.sha256(data).hexdigest()
    view = data.data if isinstance(data, np.ndarray) else data
    return hashlib.sha256(view.cast("B")).hexdigest()


def _hash_key(path: Path) -> str:
    """What a remembered hash is kept under: the file's path, size and modification time."""
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def _remembered(cache: Path | None) -> dict[str, str]:
    """path|size|mtime -> sha256 hex, as sha256_file remembered them in `cache`."""
    if cache is None:
        return {}
    with contextlib.suppress(OSError, ValueError):
        known: dict[str, str] = json.loads((cache / "file-hashes.json").read_text())
        return known
    return {}


def sha256_file(path: Path, cache: Path | None = None) -> str:
    """sha256 of a whole file, remembered in `cache` (Places.cache; None: not remembered) by
    (path, size, mtime) — big GGUFs take seconds."""
    key = _hash_key(path)
    known = _remembered(cache)
    if key in known:
        return known[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    digest = h.hexdigest()
    if cache is None:
        return digest
    # threads (a worker's background hashing, a Load) and processes sharing the cache add
    # entries at once: each merges what it found into what is there
    memo = cache / "file-hashes.json"
    with _memo_lock, locked(cache / ".file-hashes.lock"):
        known = {**_remembered(cache), key: digest}
        tmp = private_tmp(memo)
        tmp.write_text(json.dumps(known))
        tmp.replace(memo)
    return digest


def tensor_digests(
    model_sha256: str,
    raw: Callable[[str], npt.NDArray[np.uint8]],
    names: Iterable[str],
    cache: Path | None = None,
) -> dict[str, str]:
    """sha256 of each named tensor (raw(name): its bytes), remembered in `cache` (Places.cache;
    None: not remembered) per model hash: a 14B's tensors take seconds to hash, and the same file
    always gives the same ones. Threads (one per node being loaded) may call it at once: each
    merges what it hashed."""
    names = list(names)
    if cache is None:
        return {name: sha256_bytes(raw(name)) for name in names}
    memo = cache / "tensor-hashes" / f"{model_sha256}.json"

    def known() -> dict[str, str]:
        try:
            digests: dict[str, str] = json.loads(memo.read_text())  # tensor name -> sha256 hex
        except (OSError, ValueError):
            return {}
        return digests

    out = known()
    fresh = {name: sha256_bytes(raw(name)) for name in names if name not in out}
    if fresh:
        with _memo_lock, locked(memo.with_name(f".{memo.name}.lock")):
            merged = {**known(), **fresh}
            tmp = private_tmp(memo)
            tmp.write_text(json.dumps(merged))
            tmp.replace(memo)
        out.update(fresh)
    return {name: out[name] for name in names}


@dataclass(frozen=True)
class LocalModels:
    """The model files a node may open: those found in `places` (Potluck's cache, Ollama, LM
    Studio, Hugging Face) and in `extra_dirs` (the worker's --model-dir). A node never opens a
    path it is sent: it finds a file by size and hash itself."""

    places: Places
    extra_dirs: tuple[Path, ...] = ()

    def find(self, sha256: str, size: int) -> Path | None:
        """A GGUF with this size and sha256 (only same-size files are hashed; the hashes are
        remembered in places.cache)."""
        for p in self.files():
            with contextlib.suppress(OSError):  # (a file that went meanwhile)
                if p.stat().st_size == size and sha256_file(p, self.places.cache) == sha256:
                    return p
        return None

    def files(self) -> list[Path]:
        """Every GGUF this node may open: the caches' and those in extra_dirs."""
        found = [m.path for m in find_models(self.places)]
        for d in self.extra_dirs:
            found += [p for p in Path(d).glob("*.gguf") if p.is_file()]
        return list(dict.fromkeys(found))

    def known(self) -> list[str]:
        """sha256 of the model files here whose hash is already remembered (reads no file): what
        a Hello tells the pool this node has."""
        memo, out = _remembered(self.places.cache), set()
        for p in self.files():
            with contextlib.suppress(OSError):
                if (digest := memo.get(_hash_key(p))) is not None:
                    out.add(digest)
        return sorted(out)

    def hash_extra_dirs(self) -> None:
        """Hash (and remember) the files of extra_dirs, the worker's --model-dir, so that its
        Hello names them: seconds per GB, once per file. The caches' files (Ollama's may hold
        hundreds of GB) are hashed only when a Load asks for a file of their size."""
        for d in self.extra_dirs:
            for p in sorted(Path(d).glob("*.gguf")):
                with contextlib.suppress(OSError):
                    sha256_file(p, self.places.cache)

    def blobs(self) -> BlobStore:
        """The tensors this node received, kept by hash under places.cache."""
        return BlobStore(self.places.cache / "blobs")


class BlobStore:
    """Tensors kept on disk by content hash: <root>/<sha256>."""

    def __init__(self, root: Path) -> None:
        """root: a folder of its own (a worker's: Places.cache / "blobs")."""
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    def path(self, digest: str) -> Path:
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise IntegrityError(f"{digest!r} is not a sha256 hex digest")
        return self.root / digest

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def partial_path(self, digest: str) -> Path:
        return self.root / f".part-{self.path(digest).name}"

    def partial_bytes(self, digest: str) -> int:
        """Bytes kept of a transfer of `digest` that broke off (0: none)."""
        try:
            return self.partial_path(digest).stat().st_size
        except OSError:
            return 0

    def put(self, digest: str, total: int, pieces: Iterator[bytes], offset: int = 0) -> None:
        """Write the pieces (the tensor's bytes from `offset` on, after the `offset` bytes kept of
        an earlier transfer), check size and hash, then move into place: never a partial blob.
        A transfer that breaks off keeps what arrived (`partial_bytes`), to be resumed; bytes that
        fail the checks are thrown away.

        Other processes may write this store at once (two workers on one machine share its
        cache): one writer per blob at a time, between processes too (`locked`). A blob another
        writer finished meanwhile is taken once its hash checks, and the pieces are read and
        dropped; a kept part that another writer made longer than `offset` is cut back to it."""
        target, part = self.path(digest), self.partial_path(digest)
        with self._lock(digest), locked(self.root / f".lock-{digest}"):
            if self._intact(digest, total):
                for _ in pieces:  # the stream's bytes of this tensor: read, not needed
                    pass
                return
            kept = self.partial_bytes(digest)
            if offset > kept:
                raise IntegrityError(
                    f"tensor {digest[:12]}: asked to resume at byte {offset:,}, "
                    f"{kept:,} bytes are kept"
                )
            h, n = hashlib.sha256(), offset
            if offset:
                with open(part, "r+b") as f:
                    f.truncate(offset)  # another writer may have added to it since it was asked
                    while block := f.read(min(_HASH_BLOCK, offset - f.tell())):
                        h.update(block)
            with open(part, "ab" if offset else "wb") as f:
                for piece in pieces:
                    n += len(piece)
                    if n > total:
                        f.close()
                        part.unlink(missing_ok=True)
                        raise IntegrityError(
                            f"tensor {digest[:12]} is longer than the announced {total:,} bytes"
                        )
                    h.update(piece)
                    f.write(piece)
            if n != total:  # the sender ended early: keep what came, to resume
                raise IntegrityError(f"tensor {digest[:12]} ended after {n:,} of {total:,} bytes")
            if h.hexdigest() != digest:
                part.unlink(missing_ok=True)
                raise IntegrityError(
                    f"tensor {digest[:12]} arrived with a different sha256; the transfer was "
                    "corrupted"
                )
            os.replace(part, target)

    def _intact(self, digest: str, total: int) -> bool:
        """Whether the blob is in place with its size and hash (another writer's, finished while
        this one waited); a damaged one is removed."""
        target = self.path(digest)
        try:
            if target.stat().st_size == total and sha256_file(target) == digest:
                return True
        except OSError:
            return False
        target.unlink(missing_ok=True)
        return False

    def settle(self, digest: str, total: int) -> None:
        """A kept part that holds all `total` bytes (a transfer that broke off right after the
        tensor's last byte, before the check): moved into place if its hash is right, thrown
        away if not."""
        if self.partial_bytes(digest) >= total:
            with contextlib.suppress(IntegrityError):
                self.put(digest, total, iter(()), offset=self.partial_bytes(digest))

    def _lock(self, digest: str) -> threading.Lock:
        """One writer per blob (two heads may send the same tensor at once)."""
        with self._locks_lock:
            return self._locks.setdefault(digest, threading.Lock())


class BlobSource:
    """A WeightSource over blobs: the tensor index from the model's header, bytes from the store."""

    def __init__(
        self, tensors: dict[str, TensorInfo], digests: dict[str, str], store: BlobStore
    ) -> None:
        self.tensors, self.digests, self.store = tensors, digests, store

    def raw(self, name: str) -> np.ndarray:
        info = self.tensors.get(name)
        if info is None or name not in self.digests:
            raise ModelFileError(f"tensor {name!r} was not sent to this worker")
        flat = np.memmap(self.store.path(self.digests[name]), dtype=np.uint8, mode="r")
        if flat.shape[0] != info.nbytes:
            raise ModelFileError(
                f"tensor {name!r} blob has {flat.shape[0]:,} bytes, expected {info.nbytes:,}"
            )
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return flat.reshape(rows, info.nbytes // rows)


def lacking(
    store: BlobStore, names: list[str], digests: dict[str, str], tensors: dict[str, TensorInfo]
) -> tuple[list[str], dict[str, int], int]:
    """Of some tensors of a model, those not in the store: (names, bytes kept of each from a
    broken transfer, bytes still to receive)."""
    for n in names:
        if n in digests and n in tensors:
            store.settle(digests[n], tensors[n].nbytes)
    missing = [n for n in names if n not in digests or not store.has(digests[n])]
    partial = {
        n: kept for n in missing if n in digests and (kept := store.partial_bytes(digests[n]))
    }
    total = sum(tensors[n].nbytes for n in missing if n in tensors) - sum(partial.values())
    return missing, partial, total
