"""The error classes of muon_ckpt. Everything raised on purpose derives from CheckpointError."""

from __future__ import annotations

__all__ = [
    "CheckpointCollectiveError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointLeaseError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointStorageError",
    "CheckpointVersionError",
]


class CheckpointError(Exception):
    """Base class of every error muon_ckpt raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint (or not the requested step) at the URL."""


class CheckpointCorruptError(CheckpointError):
    """A file of a committed checkpoint is missing, truncated, or fails its checksum."""


class CheckpointMismatchError(CheckpointError):
    """The model/optimizer does not match the checkpoint (missing key, shape or dtype)."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """The step is already committed and the caller did not ask to overwrite it."""


class CheckpointStorageError(CheckpointError):
    """The storage failed (unreachable, refused, timed out, credentials...); the message
    names the URL and the cause."""


class CheckpointLeaseError(CheckpointError):
    """Another job holds the run's write lease: one writer per run."""


class CheckpointCollectiveError(CheckpointError):
    """A rank did not join a save/load in time, joined another call, or a collective failed."""


class CheckpointVersionError(CheckpointError):
    """A step was written by a newer muon-ckpt (a newer format): upgrade muon-ckpt. Such a
    step is never loaded, deleted or written beside by this version."""
