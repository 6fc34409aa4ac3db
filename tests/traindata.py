"""Small training files for the fine-tuning tests."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
         "lambda", "mu"]  # fmt: skip


def write_lines(path: Path, objs: list) -> Path:
    """One line per object (JSON), or the string itself (a broken line, on purpose)."""
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return path


def write_rotations(path: Path, n: int = 10) -> Path:
    """n text lines, each the word list rotated by one more: a pattern a tiny model can learn."""
    return write_lines(path, [{"text": " ".join(WORDS[i:] + WORDS[:i])} for i in range(n)])
