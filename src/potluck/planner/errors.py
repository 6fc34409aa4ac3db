"""The planner's typed errors: each message is one line with the numbers and what to change."""

from __future__ import annotations

from potluck.errors import PotluckError


class PlanError(PotluckError):
    """The pool cannot run the model as asked: inputs that make no sense (duplicate node names,
    a --tensor-split of the wrong length, a node that reports no speed)."""


class NotEnoughMemoryError(PlanError):
    """No split of the model fits the memory the nodes have free.

    needed_bytes / available_bytes: the shortfall the message names; node: the node that lacks
    memory when one does (a --tensor-split share), None when the whole pool is short.
    """

    def __init__(
        self, message: str, needed_bytes: int, available_bytes: int, node: str | None = None
    ) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        self.node = node


def fmt_bytes(n: float) -> str:
    """1.2 GiB / 40.5 MiB / 3.0 KiB: binary units, one decimal, as memory tools print them."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def fmt_seconds(s: float) -> str:
    """0.4 s / 36 s / 4 min 10 s: how long a transfer takes, as a person says it."""
    if s < 1:
        return f"{s:.1f} s"
    if s < 60:
        return f"{s:.0f} s"
    minutes, secs = divmod(round(s), 60)
    return f"{minutes} min {secs} s" if secs else f"{minutes} min"
