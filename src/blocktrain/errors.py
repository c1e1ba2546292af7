"""Exception hierarchy.

Every error a user can trigger derives from :class:`BlockTrainError`; the CLI
turns these into a one-line message and a non-zero exit, without a traceback.
Messages say what is wrong *and* what to do about it.
"""

from __future__ import annotations


class BlockTrainError(Exception):
    """Base class for all user-facing BlockTrain errors."""


class ConfigError(BlockTrainError, ValueError):
    """A configuration value is invalid or inconsistent."""


class DataError(BlockTrainError):
    """A data directory or split is missing, empty or corrupt."""


class CheckpointError(BlockTrainError):
    """A checkpoint is missing, corrupt, or belongs to another configuration."""


class RunError(BlockTrainError):
    """A run directory is missing pieces or is inconsistent."""


class ProtocolError(BlockTrainError):
    """A coordinator/worker exchange broke the protocol (bad update, stale version, auth, ...).

    ``status`` is the HTTP status the coordinator answers with; the message says
    what was wrong and what the sender should do.
    """

    def __init__(self, status: int, message: str, reason: str = "invalid") -> None:
        super().__init__(message)
        self.status = status  # HTTP status code (4xx)
        self.reason = reason  # short machine-readable reason, used as a metrics label


class ServeError(BlockTrainError):
    """Pipelined serving failed: a stage, the network or a request is at fault."""


class WireError(ServeError):
    """A serving frame broke the wire protocol (bad header, payload, shapes or request id)."""

    request_id: str = ""  # the request a bad frame named, where its header could be read that far ("" if not)


class FramingError(WireError):
    """The byte stream lost its framing (bad magic or oversized frame); the connection must close."""


class StageUnavailableError(ServeError):
    """A stage could not be reached, died mid-request, or did not answer within the timeout."""
