"""Locations: local directories and object-store prefixes, with the few file operations a
checkpoint needs (small files, existence, atomic commit, deletion).

Local paths get real fsyncs and a directory rename; object stores (``s3://``, ``gs://``)
have no rename, so there the commit marker written last is the truth.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlparse

import tensorstore as ts

from ..errors import StorageError

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
    def name(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    def join(self, *parts: str) -> Location:
        return Location("/".join([self.url.rstrip("/"), *parts]))

    def parent(self) -> Location:
        return Location(self.url.rstrip("/").rsplit("/", 1)[0])

    def kvstore(self) -> dict:
        """TensorStore kvstore spec for this directory (trailing slash: a prefix).

        ``s3://`` takes its endpoint, region and credentials from the environment the way
        the AWS CLI does (see :func:`s3_options`).
        """
        if self.is_local:
            return {"driver": "file", "path": self.url + "/"}
        parsed = urlparse(self.url)
        spec = {"driver": "s3" if parsed.scheme == "s3" else "gcs", "bucket": parsed.netloc}
        prefix = parsed.path.lstrip("/")
        spec["path"] = prefix + "/" if prefix else ""
        if parsed.scheme == "s3":
            spec.update(s3_options())
        return spec

    def open_kvstore(self) -> ts.KvStore:
        """This location as an open TensorStore kvstore (keys relative to it)."""
        return ts.KvStore.open(self.kvstore()).result()

    # --- small files -----------------------------------------------------------------

    def write_bytes(self, name: str, data: bytes, *, create_dir: bool = True) -> None:
        """Writes a small file durably (fsync of file and directory on local disks).

        ``create_dir=False`` fails if the directory is gone (a commit must not recreate a
        directory that somebody deleted under it).
        """
        if self.is_local:
            if create_dir:
                os.makedirs(self.url, exist_ok=True)
            with open(os.path.join(self.url, name), "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(self.url)
            return
        self.open_kvstore().write(name, data).result()

    def read_bytes(self, name: str) -> bytes | None:
        """The file's contents, or None when it does not exist."""
        if self.is_local:
            try:
                with open(os.path.join(self.url, name), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None
        result = self.open_kvstore().read(name).result()
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
            except (FileNotFoundError, NotADirectoryError):
                return []
        return sorted({name for k in self.list_keys() if (name := k.split("/", 1)[0])})

    def list_keys(self) -> list[str]:
        """Every key under this object-store prefix, relative to it (local: []).

        Object stores have no directories and TensorStore's list has no delimiter: this lists
        every key under the prefix (one ListObjectsV2 request per 1000 keys), never keys
        outside it. A step holds a handful of objects, so a run of N steps costs ~N * 10 keys.
        """
        if self.is_local:
            return []
        return [k.decode() for k in self.open_kvstore().list().result()]

    def delete_file(self, name: str) -> None:
        if self.is_local:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.url, name))
            return
        self.open_kvstore().delete_range(ts.KvStore.KeyRange(name, name + "\0")).result()

    def remove(self) -> None:
        """Deletes this directory / prefix and everything under it."""
        if self.is_local:
            shutil.rmtree(self.url, ignore_errors=True)
            return
        if not urlparse(self.url).path.strip("/"):
            raise StorageError(f"refusing to delete {self.url}: it is a whole bucket")
        self.open_kvstore().delete_range(ts.KvStore.KeyRange()).result()

    def makedirs(self) -> None:
        if self.is_local:
            os.makedirs(self.url, exist_ok=True)


def location(path: str | os.PathLike | Location) -> Location:
    """Parses a local path, ``file://`` URL, ``s3://bucket/prefix`` or ``gs://bucket/prefix``."""
    if isinstance(path, Location):
        return path
    text = os.fspath(path).removeprefix("file://")
    parsed = urlparse(text)
    if "://" in text:
        if parsed.scheme not in _REMOTE_SCHEMES:
            raise StorageError(
                f"{text!r}: unsupported scheme {parsed.scheme!r}; use a local path, "
                "file://, s3:// or gs://"
            )
        return Location(text.rstrip("/"))
    return Location(os.path.abspath(text).rstrip("/") or "/")


OWNER_FILE = ".owner"  # in a save in progress: "<host> <pid>", flocked by that process


def hold_owner_lock(loc: Location) -> int | None:
    """Marks a local directory as being written by this process (an flock that the kernel
    releases when the process dies, even by SIGKILL). Returns the descriptor to release."""
    if not loc.is_local:
        return None
    fd = os.open(os.path.join(loc.url, OWNER_FILE), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"{socket.gethostname()} {os.getpid()}".encode())
    except BaseException:  # (a full disk refuses even these few bytes)
        os.close(fd)
        raise
    return fd


def release_owner_lock(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


def being_written(loc: Location, other_host_grace_s: float) -> bool:
    """Whether a process still writes this directory (holds its owner lock).

    flock does not reach across hosts on every shared filesystem, so a directory whose owner
    is another host also counts as being written while younger than ``other_host_grace_s``.
    """
    path = os.path.join(loc.url, OWNER_FILE)
    if not loc.is_local or not os.path.exists(path):
        return False
    try:
        f = open(path, "rb")  # noqa: SIM115 - the with below closes it
    except FileNotFoundError:
        return False
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        host = f.read(256).decode(errors="replace").partition(" ")[0]
        if host and host != socket.gethostname():
            return time.time() - os.path.getmtime(path) < other_host_grace_s
        return False


_ERRNO_MEANS = {
    errno.EROFS: "the filesystem is mounted read-only; save to a writable directory",
    errno.ENOSPC: "no space left on the device; free space (mgr.delete(step), a smaller "
    "max_to_keep) or save elsewhere",
    errno.EDQUOT: "the disk quota is exceeded; free space or raise the quota",
    errno.EACCES: "permission denied; give this user write access to the directory",
    errno.EPERM: "operation not permitted; give this user write access to the directory",
}


def storage_error(e: OSError, where: Location | str, doing: str) -> StorageError:
    """A :class:`StorageError` for ``e`` raised while ``doing`` in ``where``: it names the
    checkpoint directory (not a hidden file of jaxckpt's) and says what the errno means and
    what to do. Other errors keep their own text."""
    url = where.url if isinstance(where, Location) else where
    means = _ERRNO_MEANS.get(e.errno or 0)
    code = f"[Errno {e.errno}] " if e.errno else ""
    text = means or (e.strerror or str(e))
    out = StorageError(f"{doing} {url} failed: {code}{text}")
    out.errno = e.errno
    return out


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rename_dir(src: Location, dst: Location) -> None:
    """Atomically moves a local directory and makes the move durable.

    Never replaces a directory that holds anything: rename(2) fails with EEXIST or
    ENOTEMPTY then (POSIX), a check the kernel makes atomically with the move."""
    os.rename(src.url, dst.url)
    fsync_dir(dst.parent().url)


def s3_options(environ: Mapping[str, str] | None = None) -> dict:
    """The parts of an ``s3`` kvstore spec that TensorStore does not take from the environment.

    TensorStore's s3 driver reads the credentials itself (``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, else ``AWS_PROFILE`` and the
    ``~/.aws`` files, else the EC2/ECS metadata services) but not the endpoint or the
    region, so these are put into the spec:

    * ``endpoint``: ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL`` (neither when
      ``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS`` is true), for S3-compatible servers
      (MinIO, Ceph, LocalStack, moto...), addressed path-style: ``<endpoint>/<bucket>/<key>``.
    * ``aws_region``: ``AWS_REGION``, else ``AWS_DEFAULT_REGION``, used with an endpoint
      (without one TensorStore asks the server, falling back to us-east-1). On AWS itself
      (no endpoint) TensorStore finds the bucket's own region, which a wrong region in the
      environment could not break.
    * ``aws_credentials``: ``{"type": "environment"}`` when ``AWS_ACCESS_KEY_ID`` is set,
      which is what the default chain would pick first anyway, minus its probing of the
      ``~/.aws`` files (logged as errors when absent) and of the metadata services.
    """
    env = os.environ if environ is None else environ
    out: dict = {}
    ignore = env.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").strip().lower() == "true"
    endpoint = "" if ignore else env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        endpoint = endpoint.strip().rstrip("/")
        if urlparse(endpoint).scheme not in ("http", "https"):
            raise StorageError(
                f"S3 endpoint {endpoint!r} (from AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL) must "
                "be an http:// or https:// URL"
            )
        out["endpoint"] = endpoint
        if region := env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"):
            out["aws_region"] = region.strip()
    if env.get("AWS_ACCESS_KEY_ID"):
        out["aws_credentials"] = {"type": "environment"}
    return out
