"""Typed errors. Each message is one line a user can act on, with the numbers that matter."""


class PotluckError(Exception):
    """Base of every error Potluck raises on purpose; the CLI prints its message and exits 1."""


class ModelFileError(PotluckError):
    """The file is not a GGUF model we can read: truncated, foreign, corrupt or missing keys."""


class UnsupportedError(PotluckError):
    """The model uses an architecture, quantization type or feature we do not support."""


class UnicodeTextError(PotluckError, ValueError):
    """Text that is not valid Unicode (a lone surrogate) given to the tokenizer."""


class ContextError(PotluckError):
    """A prompt or requested context does not fit the model's or the session's context."""


class ModelNotFoundError(PotluckError):
    """A model name or path that resolves to no file."""


class NodeError(PotluckError):
    """A node could not be reached or refused a call; the message names the node and the reason."""


class StepRefused(NodeError):
    """A node that answers refused a step itself (a request its state cannot take: a rewind it
    cannot make, a grammar it cannot compile, a context it cannot hold): the same step sent
    again, or to a re-planned pool, gets the same answer, so the request fails with the reason.
    `code`: the grpc.StatusCode name the node gave."""

    REFUSALS = frozenset({"INVALID_ARGUMENT", "FAILED_PRECONDITION", "OUT_OF_RANGE"})

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class PoolLostError(PotluckError):
    """The nodes that are left cannot run the model (pool/failover.py); a server answers 503."""
