"""Exception classes. Every message names the path, the leaf and what to do."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every jaxckpt error."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint is already at the path being saved to."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint at the path (absent, or a save never finished)."""


class FormatVersionError(CheckpointError):
    """The manifest was written by a newer, incompatible format version."""


class ManifestError(CheckpointError):
    """The manifest is missing fields or cannot be parsed."""


class UnsupportedLeafError(CheckpointError, TypeError):
    """A pytree leaf has a type jaxckpt cannot store."""


class DeletedArrayError(CheckpointError, ValueError):
    """A jax.Array leaf was deleted or donated before the save read its bytes."""


class LeafNotFoundError(CheckpointError, KeyError):
    """The restore target names a leaf the checkpoint does not hold."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ShapeMismatchError(CheckpointError, ValueError):
    """The restore target's shape differs from the saved shape."""


class ShardingError(CheckpointError, ValueError):
    """A saved sharding cannot be bound to the requested mesh or devices."""


class ChecksumError(CheckpointError):
    """A chunk's CRC32C did not match: the data on disk is corrupt."""


class StorageError(CheckpointError, OSError):
    """Reading or writing the underlying storage failed."""


class DirectoryInUseError(CheckpointError):
    """Another job holds the writer's lease on the run directory (or took it over from this
    manager). ``holder``: its record (host, pid, job, since), when known."""

    def __init__(self, message: str, holder: object = None) -> None:
        super().__init__(message)
        self.holder = holder


class BackgroundSaveError(CheckpointError):
    """A save that ran in the background failed; raised at the next call."""


class CoordinationError(CheckpointError):
    """Processes failed to agree (timeout, mismatch) during a multi-process save."""


class ExportError(CheckpointError):
    """An exported function cannot be saved, found or served as asked."""


class ExportVersionError(ExportError, FormatVersionError):
    """The export was written by a format or jax.export version the installed code can't read."""


class ExportArgumentError(ExportError, ValueError):
    """An argument given to a served function does not match the exported signature."""


class ExportChecksumError(ExportError, ChecksumError):
    """An exported artifact's SHA-256 differs from the one in signature.json: it is corrupt."""


class OptionsError(CheckpointError, ValueError):
    """An option file or value is invalid."""


class SafetensorsError(CheckpointError):
    """A safetensors file or index is missing, truncated or malformed, or a tree cannot be
    written as one."""


class OrbaxFormatError(ManifestError):
    """An Orbax checkpoint jaxckpt cannot read (a layout or value type it does not know)."""


class PerProcessError(CheckpointError, TypeError):
    """A ``per_process`` value that is neither JSON, bytes nor a pytree of NumPy arrays."""


class ProcessCountChangedError(CheckpointError):
    """Per-process values were asked for by index after the process count changed."""


class OrbaxDependencyError(OrbaxFormatError, ImportError):
    """Reading this Orbax checkpoint needs an optional package (msgpack: ``jaxckpt[orbax]``)."""


class SafetensorsLeafNotFoundError(SafetensorsError, LeafNotFoundError):
    """A tensor a leaf of the target needs is in none of the safetensors files."""


class SafetensorsShapeError(SafetensorsError, ShapeMismatchError):
    """A safetensors tensor does not give the target leaf's shape through its transforms."""


class SafetensorsLeafError(SafetensorsError, UnsupportedLeafError):
    """A leaf ``jaxckpt.safetensors.save`` cannot write (not an array, or a PRNG key)."""


class RunLogError(CheckpointError):
    """A run log (``<dir>/runlog/``) is absent, unreadable or holds no readable event."""


class MissingDependencyError(CheckpointError, ImportError):
    """An optional package a feature needs is not installed (the message names it)."""


class SaveCancelledError(CheckpointError):
    """A save stopped by ``cancel()`` (this process's, or another process's of the job)
    before it committed; nothing of it is listed."""
