"""Exception classes. Every message names the path, the leaf and what to do.

A class says what went wrong, whatever wrote the data: a corrupt export artifact is a
``ChecksumError`` like a corrupt chunk, an export of a newer version a ``FormatVersionError``
like a manifest. Files written by other tools have one class for everything wrong with
them or with what they are read into (``SafetensorsError``; ``OrbaxFormatError``, a
``ManifestError``). Catch ``CheckpointError`` for all of them.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every jaxckpt error."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint is already at the path being saved to."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint at the path (absent, or a save never finished)."""


class FormatVersionError(CheckpointError):
    """A newer, incompatible format version wrote it: a manifest, an export's
    ``signature.json``, or an exported function's jax calling convention or serialization
    (the message names both versions and what to upgrade)."""


class ManifestError(CheckpointError):
    """The manifest is missing fields or cannot be parsed."""


class UnsupportedLeafError(CheckpointError, TypeError):
    """A value jaxckpt cannot store: a pytree leaf of a type it does not know, or a
    ``per_process`` value that is neither JSON, bytes nor a pytree of NumPy arrays."""


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
    """Stored data does not match its checksum (a chunk's CRC32C, an exported artifact's
    SHA-256, a per-process record's digest): it is corrupt."""


class StorageError(CheckpointError, OSError):
    """Reading or writing the underlying storage failed."""


class ReadStalledError(StorageError):
    """A read made no progress for the stall bound (``stall_timeout_s``): the message names
    the process and its host, the file or object it waited for and how long. The read is
    given up (TensorStore's is cancelled; a thread blocked in the kernel is left behind)."""


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


class ExportArgumentError(ExportError, ValueError):
    """An argument given to a served function does not match the exported signature."""


class OptionsError(CheckpointError, ValueError):
    """An option file or value is invalid."""


class SafetensorsError(CheckpointError):
    """A safetensors file or index is missing, truncated or malformed, does not hold what
    the target needs (a tensor for a leaf, a shape through the transforms), or a tree
    cannot be written as one (a leaf that is not an array, or a PRNG key)."""


class OrbaxFormatError(ManifestError):
    """An Orbax checkpoint jaxckpt cannot read (a layout or value type it does not know)."""


class ProcessCountChangedError(CheckpointError):
    """Per-process values were asked for by index after the process count changed."""


class RunLogError(CheckpointError):
    """A run log (``<dir>/runlog/``) is absent, unreadable or holds no readable event."""


class MissingDependencyError(CheckpointError, ImportError):
    """An optional package a feature needs is not installed (the message names it and the
    extra that installs it, e.g. msgpack: ``jaxckpt[orbax]``)."""


class SaveCancelledError(CheckpointError):
    """A save stopped by ``cancel()`` (this process's, or another process's of the job)
    before it committed; nothing of it is listed."""
