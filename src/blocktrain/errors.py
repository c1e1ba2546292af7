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
