"""The pool secret: making one, checking it, and keeping it in the config directory.

Every machine of a pool holds the same secret; nodes prove they know it (transport/auth.py) without
ever sending it. It is read from `--secret`, `POTLUCK_SECRET` or the file `<config dir>/secret`
(mode 0600; the config dir is POTLUCK_CONFIG, else ~/.config/potluck), in that order; only the CLI
reads the flags and the environment and passes the values here.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from potluck.errors import PotluckError

MIN_SECRET_CHARS = 16  # a guessable secret could be found offline from one observed handshake
MAX_SECRET_CHARS = 1024
SECRET_FILE = "secret"


class SecretError(PotluckError):
    """A pool secret that is missing, too weak, or kept in a file others can read."""


def new_secret() -> str:
    """256 random bits, URL-safe base64 (43 characters): safe to paste into a shell or a file."""
    return secrets.token_urlsafe(32)


def check_secret(text: str, source: str) -> str:
    """The secret without surrounding whitespace, or a SecretError that says what to do."""
    s = text.strip()
    if len(s) < MIN_SECRET_CHARS:
        raise SecretError(
            f"the pool secret from {source} has {len(s)} characters, fewer than {MIN_SECRET_CHARS}: "
            "a short secret can be guessed offline from one recorded handshake; make one with "
            "`potluck secret`"
        )
    if len(s) > MAX_SECRET_CHARS or any(c in s for c in "\r\n\0"):
        raise SecretError(
            f"the pool secret from {source} is not one line of at most {MAX_SECRET_CHARS} characters"
        )
    return s


def read_secret_file(path: Path) -> str | None:
    """The secret kept in `path`, None if there is no such file. Like ssh with its keys, refuses a
    file that other users can read or write."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    if os.name == "posix" and st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(
            f"{path} is readable or writable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
            f"run `chmod 600 {path}`"
        )
    return check_secret(path.read_text(encoding="utf-8"), str(path))


def save_secret(path: Path, secret: str, replace: bool = False) -> None:
    """Write the secret with mode 0600 (the directory 0700). Refuses to replace an existing secret
    unless asked: every machine of the pool would then need the new one."""
    secret = check_secret(secret, "the secret to save")
    if path.exists() and not replace:
        raise SecretError(
            f"{path} already holds a pool secret; pass --force to replace it (then give every "
            "machine of the pool the new one)"
        )
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(secret + "\n")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
