"""Locations: local directories and object-store prefixes, with the few file operations a
checkpoint needs (small files, existence, atomic commit, deletion).

Local paths get real fsyncs and a directory rename; object stores (``s3://``, ``gs://``)
have no rename, so there the commit marker written last is the truth.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from urllib.parse import urlparse

import tensorstore as ts

from .errors import StorageError

_REMOTE_SCHEMES = ("s3", "gs")


@dataclass(frozen=True)
class Location:
    """A directory (local) or key prefix (object store). Build with :func:`location`."""

    url: str  # absolute local path, or scheme://bucket/prefix (no trailing slash)

    @property
    def scheme(self) -> str:
        return urlparse(self.url).scheme if "://" in self.url else "file"

    @property
    def is_local(self) -> bool:
        return self.scheme == "file"

    @property
    def path(self) -> str:
        return self.url

    @property
    def name(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    def join(self, *parts: str) -> Location:
        return Location("/".join([self.url.rstrip("/"), *parts]))

    def parent(self) -> Location:
        return Location(self.url.rstrip("/").rsplit("/", 1)[0])

    def kvstore(self) -> dict:
        """TensorStore kvstore spec for this directory (trailing slash: a prefix)."""
        if self.is_local:
            return {"driver": "file", "path": self.url + "/"}
        parsed = urlparse(self.url)
        spec = {"driver": "s3" if parsed.scheme == "s3" else "gcs", "bucket": parsed.netloc}
        prefix = parsed.path.lstrip("/")
        spec["path"] = prefix + "/" if prefix else ""
        return spec

    # --- small files -----------------------------------------------------------------

    def write_bytes(self, name: str, data: bytes) -> None:
        """Writes a small file durably (fsync of file and directory on local disks)."""
        if self.is_local:
            os.makedirs(self.url, exist_ok=True)
            target = os.path.join(self.url, name)
            with open(target, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(self.url)
            return
        _kv(self).write(name, data).result()

    def read_bytes(self, name: str) -> bytes | None:
        """The file's contents, or None when it does not exist."""
        if self.is_local:
            try:
                with open(os.path.join(self.url, name), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None
        result = _kv(self).read(name).result()
        return bytes(result.value) if result.state == "value" else None

    def exists(self, name: str) -> bool:
        if self.is_local:
            return os.path.exists(os.path.join(self.url, name))
        return self.read_bytes(name) is not None

    def list_children(self) -> list[str]:
        """Names directly under this location (directories or key prefixes)."""
        if self.is_local:
            try:
                return sorted(os.listdir(self.url))
            except FileNotFoundError:
                return []
        keys = _kv(self).list().result()
        return sorted({k.decode().split("/", 1)[0] for k in keys})

    def delete_file(self, name: str) -> None:
        if self.is_local:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.url, name))
            return
        _kv(self).delete_range(ts.KvStore.KeyRange(name, name + "\0")).result()

    def remove(self) -> None:
        """Deletes this directory / prefix and everything under it."""
        if self.is_local:
            shutil.rmtree(self.url, ignore_errors=True)
            return
        _kv(self).delete_range(ts.KvStore.KeyRange()).result()

    def makedirs(self) -> None:
        if self.is_local:
            os.makedirs(self.url, exist_ok=True)


def location(path: str | os.PathLike | Location) -> Location:
    """Parses a local path, ``file://`` URL, ``s3://bucket/prefix`` or ``gs://bucket/prefix``."""
    if isinstance(path, Location):
        return path
    text = os.fspath(path)
    if text.startswith("file://"):
        text = text[len("file://") :]
    parsed = urlparse(text)
    if "://" in text:
        if parsed.scheme not in _REMOTE_SCHEMES:
            raise StorageError(
                f"{text!r}: unsupported scheme {parsed.scheme!r}; use a local path, "
                "file://, s3:// or gs://"
            )
        return Location(text.rstrip("/"))
    return Location(os.path.abspath(text).rstrip("/") or "/")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rename_dir(src: Location, dst: Location) -> None:
    """Atomically moves a local directory and makes the move durable."""
    os.rename(src.url, dst.url)
    fsync_dir(dst.parent().url)


def _kv(loc: Location) -> ts.KvStore:
    return ts.KvStore.open(loc.kvstore()).result()
