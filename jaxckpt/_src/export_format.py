"""The export directory on disk: its layout, writing and committing it, reading it back.

An export is one directory::

    path/
      signature.json                  inputs, outputs, mesh axes, variants, versions, checksums
      params/                         the parameters: one jaxckpt checkpoint, stored once
      artifacts/devices_<n>.jaxexport a serialized ``jax.export.Exported`` per device count

:func:`write` writes ``signature.json`` last, so its presence marks a finished export;
:func:`prepare_target` refuses a finished one and clears what an unfinished one left. Reading
checks the format version (:func:`signature`) and, per artifact, the calling convention and
serialization versions, the SHA-256 and the platform (:func:`read_artifact`). The signature's
contents are built by :mod:`jaxckpt.export`; :mod:`jaxckpt._src.serving` loads an export.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from typing import Any

import jax

from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ExportChecksumError,
    ExportError,
    ExportVersionError,
    FormatVersionError,
    ManifestError,
)
from . import checkpoint, multihost
from .manifest import FORMAT_VERSION, check_format_version
from .storage import Location, location

EXPORT_FORMAT = "jaxckpt.export"
EXPORT_FORMAT_VERSION = FORMAT_VERSION  # one version scheme for every file jaxckpt writes
SIGNATURE_FILE = "signature.json"
PARAMS_DIR = "params"
ARTIFACTS_DIR = "artifacts"

# The only symbolic dimension that may be sharded: a plain symbol such as "b" (not "2*b").
PLAIN_SYMBOL = re.compile(r"[A-Za-z_]\w*")
_BARRIER_TIMEOUT_S = 600.0


def artifact_file(count: int) -> str:
    """The artifact's path, relative to the export, for the ``count``-device variant."""
    return f"{ARTIFACTS_DIR}/devices_{count}.jaxexport"


def shape_json(shape: Sequence[Any]) -> list[int | str]:
    """A shape as written in the signature: ints, and strings for symbolic dimensions."""
    return [str(d) if jax.export.is_symbolic_dim(d) else int(d) for d in shape]


def package_version(name: str) -> str:
    """The installed version of the distribution ``name`` ("?" when it is not installed)."""
    try:
        return dist_version(name)
    except PackageNotFoundError:
        return "?"


def schema_version() -> int | None:
    """The installed jax.export flatbuffer schema version (None when jax hides it)."""
    try:
        from jax._src.export import serialization
    except ImportError:
        return None
    return getattr(serialization, "_SERIALIZATION_VERSION", None)


def require_flatbuffers(loc: Location) -> None:
    """Raises ExportError unless jax.export can (de)serialize: it needs ``flatbuffers``."""
    try:
        import flatbuffers  # noqa: F401
    except ImportError as e:
        raise ExportError(
            f"{loc.url}: jax.export needs the 'flatbuffers' package to (de)serialize "
            "artifacts; install it (pip install flatbuffers)"
        ) from e


# --- writing --------------------------------------------------------------------------------


def prepare_target(loc: Location) -> None:
    """Refuses a finished export; clears what an unfinished one left."""
    if loc.exists(SIGNATURE_FILE):
        raise CheckpointExistsError(
            f"{loc.url} already holds an export ({SIGNATURE_FILE}); choose a new path or delete it"
        )
    children = loc.list_children()
    others = sorted(set(children) - {PARAMS_DIR, ARTIFACTS_DIR})
    if others:
        raise ExportError(
            f"{loc.url} is not empty ({others[:5]}); export into a new or empty directory"
        )
    if children and multihost.process_index() == 0:  # an export that never finished
        loc.join(PARAMS_DIR).remove()
        loc.join(ARTIFACTS_DIR).remove()
    multihost.barrier(multihost.unique_name("export-prepared"), _BARRIER_TIMEOUT_S)


def variant_record(
    count: int, sizes: Sequence[int], exp: jax.export.Exported, blob: bytes, divisors: list
) -> dict:
    """The signature's entry for the ``count``-device artifact ``blob`` (serialized ``exp``)."""
    return {
        "device_count": count,
        "axis_sizes": list(sizes),
        "file": artifact_file(count),
        "sha256": hashlib.sha256(blob).hexdigest(),
        "bytes": len(blob),
        "calling_convention_version": exp.calling_convention_version,
        "serialization_version": schema_version(),
        "platforms": list(exp.platforms),
        "input_divisors": divisors,
    }


def write(loc: Location, params: Any, blobs: dict[str, bytes], sig: dict) -> None:
    """Writes the parameters, then the artifacts, then ``signature.json``, which commits."""
    checkpoint.save(
        loc.join(PARAMS_DIR), params, custom_metadata={"jaxckpt.export": sig["function"]}
    )
    if multihost.process_index() == 0:
        for file, blob in blobs.items():
            folder, _, name = file.rpartition("/")
            loc.join(folder).write_bytes(name, blob)
        loc.write_bytes(SIGNATURE_FILE, json.dumps(sig, indent=1).encode())  # commit
    multihost.barrier(multihost.unique_name("export-committed"), _BARRIER_TIMEOUT_S)


# --- reading --------------------------------------------------------------------------------


def signature(path: str | os.PathLike) -> dict:
    """The ``signature.json`` of the export at ``path``, checked for format and version."""
    loc = location(path)
    text = loc.read_bytes(SIGNATURE_FILE)
    if text is None:
        raise CheckpointNotFoundError(
            f"{loc.url} holds no {SIGNATURE_FILE}: it is not a jaxckpt export, or its export "
            "never finished; pass the directory jaxckpt.export.save wrote"
        )
    try:
        sig = json.loads(text)
    except ValueError as e:
        raise ExportError(f"{loc.url}/{SIGNATURE_FILE} is not valid JSON: {e}; re-export") from e
    if not isinstance(sig, dict) or sig.get("format") != EXPORT_FORMAT:
        raise ExportError(f"{loc.url}/{SIGNATURE_FILE} is not a {EXPORT_FORMAT} signature")
    try:
        check_format_version(sig, where=f"{loc.url}/{SIGNATURE_FILE}")
    except FormatVersionError as e:
        raise ExportVersionError(str(e)) from e
    except ManifestError as e:
        raise ExportError(str(e)) from e
    return sig


def read_artifact(loc: Location, sig: dict, variant: dict) -> jax.export.Exported:
    """The variant's ``Exported``, once its versions, checksum and platform check out."""
    where = f"{loc.url}/{variant['file']}"
    writer = sig.get("versions", {}).get("jax", "?")
    lo = jax.export.minimum_supported_calling_convention_version
    hi = jax.export.maximum_supported_calling_convention_version
    ccv = variant["calling_convention_version"]
    if not lo <= ccv <= hi:
        raise ExportVersionError(
            f"{where}: written by jax {writer} with calling convention version {ccv}; the "
            f"installed jax {jax.__version__} supports versions {lo}..{hi}. Serve with a jax "
            "that supports it, or re-export with the installed jax"
        )
    schema, mine = variant.get("serialization_version"), schema_version()
    if schema is not None and mine is not None and schema > mine:
        raise ExportVersionError(
            f"{where}: written by jax {writer} with serialization version {schema}; the "
            f"installed jax {jax.__version__} reads up to version {mine}. Upgrade jax to at "
            f"least {writer}, or re-export with the installed jax"
        )
    require_flatbuffers(loc)
    blob = loc.read_bytes(variant["file"])
    if blob is None:
        raise ExportError(f"{where} is missing; the export is incomplete, re-export it")
    digest = hashlib.sha256(blob).hexdigest()
    if digest != variant["sha256"]:
        raise ExportChecksumError(
            f"{where} is corrupt: its SHA-256 is {digest}, {SIGNATURE_FILE} records "
            f"{variant['sha256']}; copy the export again or re-export it"
        )
    try:
        exported = jax.export.deserialize(bytearray(blob))
    except Exception as e:
        raise ExportError(f"{where}: jax.export cannot deserialize it: {e}") from e
    platform = jax.export.default_export_platform()
    if platform not in exported.platforms:
        raise ExportError(
            f"{where} was exported for platforms {list(exported.platforms)}, but this process "
            f"serves on {platform!r}; re-export with platforms=[..., {platform!r}]"
        )
    return exported
