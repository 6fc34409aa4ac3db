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


class PoolLostError(PotluckError):
    """The nodes that are left cannot run the model (pool/failover.py); a server answers 503."""
