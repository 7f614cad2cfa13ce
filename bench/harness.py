"""What the benchmarks share: worker processes (one, or a jax.distributed job on 127.0.0.1)
that hand back one ``RESULT <json>`` line, page-cache dropping and warming, medians and GB/s,
peak RSS, CPU seconds, tables and PASS/FAIL words, and the results JSON under bench/results/;
and the machine's limits every library is judged against: raw writes + fsync, raw reads,
verified reads (a read plus a hardware CRC32C of every byte) and ``fio`` (``raw_io``,
``read_files``, ``cold_reads``, ``fio``).

A script with workers ends in ``harness.entry(main, worker)``: ``worker(**kwargs)`` runs in
the processes ``run_worker`` / ``run_job`` start and returns what they collect.
Nothing here imports jax (NumPy only): a script sets its devices (``cpu_devices``) before it does.
"""

from __future__ import annotations

import contextlib
import gc
import json
import mmap
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
GB = 1e9
TAG = "RESULT "
sys.path.insert(0, os.path.join(ROOT, "tests"))

import multiproc  # noqa: E402  (tests/: jax.distributed jobs of N processes on 127.0.0.1)
from iostats import drop_page_cache, io, ts_file_bytes_read  # noqa: E402, F401

# --- processes -----------------------------------------------------------------------------


def cpu_devices(n: int) -> None:
    """``n`` virtual CPU devices for jax in this process (before jax is imported)."""
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
    os.environ["XLA_FLAGS"] = flags.strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def entry(main: Callable[[], None], worker: Callable[..., dict]) -> None:
    """``main()``, or in a worker process ``worker(**kwargs)``, its result printed for the
    parent; a worker of ``run_job`` joins its jax.distributed job first."""
    if sys.argv[1:2] != ["--worker"]:
        return main()
    if "JAXCKPT_COORD" in os.environ:
        multiproc.init()
    print(TAG + json.dumps(worker(**json.loads(sys.argv[2]))), flush=True)


def result(output: str) -> dict:
    """The last ``RESULT`` line of a worker's output."""
    return json.loads([ln for ln in output.splitlines() if ln.startswith(TAG)][-1][len(TAG) :])


def run_worker(
    script: str, timeout_s: float = 3600, env: dict[str, str] | None = None, **kwargs
) -> dict:
    """``script``'s worker run with ``kwargs`` in a fresh process, ``env`` added to its
    environment: what it returned."""
    cmd = [sys.executable, script, "--worker", json.dumps(kwargs)]
    full_env = {**os.environ, **env} if env else None
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=full_env)
    if proc.returncode != 0 or TAG not in proc.stdout:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise RuntimeError(f"worker {cmd[3]} failed (exit {proc.returncode})")
    return result(proc.stdout)


def run_job(
    script: str, n: int, devices: int = 2, timeout_s: float = 600, env=None, **kwargs
) -> list[dict]:
    """``script``'s worker run with ``kwargs`` as the ``n`` processes of one jax.distributed
    job, ``devices`` CPU devices each: what each returned, by process index."""
    res = multiproc.run(
        script,
        n,
        devices_per_process=devices,
        args=["--worker", json.dumps(kwargs)],
        timeout_s=timeout_s,
        env=env,
    ).check()
    return [result(out) for out in res.outputs]


@contextlib.contextmanager
def scratch(prefix: str = "jaxckpt-bench-", parent: str | None = "/tmp") -> Iterator[str]:
    """A temporary directory, deleted on the way out."""
    with tempfile.TemporaryDirectory(prefix=prefix, dir=parent, ignore_cleanup_errors=True) as d:
        yield d


def log(msg: str) -> None:
    """Progress on stderr, timestamped."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- the VM's memory ------------------------------------------------------------------------

PAGE_REPORTING = "/sys/module/page_reporting/parameters"
NO_REPORTING_ORDER = 11  # past the buddy allocator's largest block (order 10): none reported


def _reporting(name: str) -> int | None:
    try:
        with open(os.path.join(PAGE_REPORTING, name)) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def reported_kib() -> int | None:
    """KiB of free guest memory the kernel has reported to its hypervisor so far (virtio-
    balloon free page reporting; this VM's kernel counts it), or None where not exposed.

    The hypervisor drops what is reported; the next first touch of those pages costs a
    host fault on top of the guest's. On this VM that makes the memory a fresh process
    fills (a restore's result, a raw read into new buffers) cost 0.5-3 CPU s/GB depending
    on how long ago it was freed: a page freed within the last seconds is not reported yet."""
    return _reporting("reported_kib")


def reporting_order() -> int | None:
    """The smallest block (2**order pages) the kernel reports free, or None (no reporting)."""
    return _reporting("page_reporting_order")


@contextlib.contextmanager
def page_reporting(enabled: bool) -> Iterator[None]:
    """With ``enabled`` False: the kernel's free page reporting stopped while the block
    runs (its order set past the largest block, as root), then put back, and the free
    memory touched once first (``back_free_memory``: what was reported before stays
    unbacked until then); a figure then shows what fresh memory costs on a host whose
    memory the hypervisor does not take back (bare metal). Raises where it can't be
    stopped."""
    was = reporting_order()
    if enabled or was is None:
        yield
        return
    path = os.path.join(PAGE_REPORTING, "page_reporting_order")
    try:
        with open(path, "w") as f:
            f.write(str(NO_REPORTING_ORDER))
    except OSError as e:
        raise SystemExit(f"can't stop free page reporting ({path}: {e}); run as root") from e
    try:
        back_free_memory()
        yield
    finally:
        with open(path, "w") as f:
            f.write(str(was))


def back_free_memory(margin: int = 1 << 30) -> float:
    """Touches the machine's free memory once, less ``margin`` (one mapping faulted in by
    ``jaxckpt``'s ``arrays.populate``, then unmapped), so that the hypervisor backs what
    reporting had taken back; returns the seconds it took (17 GiB here: 42 s). Imports
    jaxckpt, hence jax: for the orchestrating process, not a worker before its devices."""
    import mmap

    from jaxckpt._src.io.arrays import populate

    with open("/proc/meminfo") as f:
        free = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemFree:"))
    size = (free - margin) // (1 << 30) * (1 << 30)
    if size <= 0:
        return 0.0
    start = time.perf_counter()
    region = mmap.mmap(-1, size)
    try:
        view = np.frombuffer(region, np.uint8)
        populate(view)
        del view
    finally:
        region.close()
    return time.perf_counter() - start


# --- measuring -----------------------------------------------------------------------------

median = statistics.median


def gbps(nbytes: float, seconds: Iterable[float]) -> float:
    """GB/s (1e9 bytes) of ``nbytes`` in the median of ``seconds``."""
    return nbytes / GB / median(seconds)


def alternate(items: Sequence, rep: int) -> list:
    """``items`` in order on even repeats, reversed on odd ones: none always goes first."""
    return list(items if rep % 2 == 0 else items[::-1])


def rotated(items: Sequence, by: int) -> list:
    """``items`` rotated left by ``by``: each takes its turn first."""
    by %= len(items)
    return [*items[by:], *items[:by]]


CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, all its threads (ended ones too):
    utime and stime, fields 14 and 15 of /proc/self/stat, in clock ticks."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the name in (...) may hold spaces
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Clock:
    """Wall seconds and CPU seconds (``cpu_seconds``) of a ``with`` block."""

    seconds: float = 0.0
    cpu: float = 0.0

    def __enter__(self) -> Clock:
        self._cpu, self._t0 = cpu_seconds(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._t0
        self.cpu = cpu_seconds() - self._cpu

    def record(self) -> dict[str, float]:
        """What a worker hands back: {"seconds": wall, "cpu": user + sys}."""
        return {"seconds": self.seconds, "cpu": self.cpu}


def page_cache_bytes() -> int:
    """The page cache as /proc/meminfo counts it: ``Cached`` + ``Dirty`` (bytes)."""
    got = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("Cached", "Dirty"):
                got[key] = int(value.split()[0]) * 1024
    return got.get("Cached", 0) + got.get("Dirty", 0)


class PeakRss:
    """Peak RSS over the RSS at entry: a sampling thread plus the kernel's VmHWM mark; and
    the page cache's peak growth over its size at entry (``cache_over``, machine-wide).

    ``sampler_cpu``: the CPU seconds the sampling thread took, to subtract from a
    ``Clock``'s figure taken inside the block. ``cache`` False (a restore's figures): no
    page cache peak, and no sampling thread where the kernel's mark can be reset, so the
    timed operation runs as the limits it is held against do (a thread waking every 2 ms
    took the GIL from it: a warm 1 GB restore 0.284 against 0.272 s, medians of 6 pairs).
    """

    sampler_cpu: float = 0.0

    def __init__(self, interval_s: float = 0.002, cache: bool = True):
        import psutil

        self.interval_s, self.proc, self.cache = interval_s, psutil.Process(), cache

    def __enter__(self) -> PeakRss:
        gc.collect()
        self.baseline = self.peak = self.proc.memory_info().rss
        self.cache_baseline = self.cache_peak = page_cache_bytes()
        try:  # resets the kernel's peak-RSS mark (VmHWM); not allowed everywhere
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm = True
        except OSError:
            self.hwm = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        if self.cache or not self.hwm:
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self.proc.memory_info().rss)
            if self.cache:
                self.cache_peak = max(self.cache_peak, page_cache_bytes())
        self.sampler_cpu = time.thread_time()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        self.cache_peak = max(self.cache_peak, page_cache_bytes())
        if self.hwm:
            with open("/proc/self/status") as f:
                hwm = next((int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")), 0)
            self.peak = max(self.peak, hwm * 1024)

    @property
    def over(self) -> int:
        return self.peak - self.baseline

    @property
    def cache_over(self) -> int:
        return self.cache_peak - self.cache_baseline


# --- the machine's limits ------------------------------------------------------------------

RAW_THREADS = (2, 4, 8)  # raw ways besides one file on one thread: one file per array
READ_BLOCK = 16 << 20  # raw reads read at most this many bytes per call


def crc32c() -> tuple[str, Callable[[bytes], int]]:
    """The CRC32C function of the installed package and its name, with "(software)" where it
    is not hardware-accelerated: ``crc32c`` (jaxckpt's own dependency, the one its direct
    read path checks chunks with), else ``google-crc32c``."""
    try:
        import crc32c as crc

        return "crc32c" + ("" if crc.hardware_based else " (software)"), crc.crc32c
    except ImportError:
        pass
    try:
        import google_crc32c

        soft = "" if google_crc32c.implementation == "c" else " (software)"
        return "google-crc32c" + soft, google_crc32c.value
    except ImportError:
        raise RuntimeError(
            "no CRC32C package for the verified-read limit: pip install crc32c"
        ) from None


def files_under(path: str) -> list[str]:
    """Every file under ``path`` (or ``path`` itself), in a stable order."""
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(root, n) for root, _, names in os.walk(path) for n in names)


def drop_cold(path: str) -> None:
    """Every file under ``path`` fsynced, then evicted from the page cache: the next read
    comes from the disk (``posix_fadvise(DONTNEED)`` only evicts clean pages)."""
    for name in files_under(path):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_page_cache(path: str) -> None:
    """Every file under ``path`` read once, so the next read is served by the page cache."""
    read_files(files_under(path), threads=4)


def write_way(path: str, arrays: Sequence, threads: int) -> None:
    """``arrays`` written under the directory ``path`` one raw way: all in ``one.bin`` on
    this thread (``threads`` 1), or each in ``a<i>.bin`` on ``threads`` threads."""
    if threads == 1:
        write_file(os.path.join(path, "one.bin"), arrays)
        return
    files = [os.path.join(path, f"a{i}.bin") for i in range(len(arrays))]
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda p, a: write_file(p, [a]), files, arrays))


def write_file(path: str, arrays: Sequence) -> None:
    """``arrays`` (anything with the buffer protocol) written to ``path`` and fsynced."""
    with open(path, "wb") as f:
        for a in arrays:
            f.write(memoryview(a).cast("B"))
        f.flush()
        os.fsync(f.fileno())


def read_files(
    paths: Sequence[str],
    threads: int = 1,
    check: Callable[[bytes], int] | None = None,
    keep: list | None = None,
    copies: Sequence[float] = (),
    direct_io: bool = False,
) -> int:
    """Every byte of ``paths`` read into fresh memory, one buffer per file that the reads
    fill in blocks of ``READ_BLOCK`` (as a restore fills the arrays it returns: every page
    touched for the first time, none reused), spread over ``threads`` threads, each block
    passed to ``check`` (a CRC) if given, then copied ``copies[i]`` more times for the i-th
    file, into fresh buffers of its own (as a restore onto CPU devices fills each replica;
    a fraction: that share of each block, into one more buffer: the replicas of a file
    that holds several arrays); the buffers go to ``keep`` (freed by the caller, outside
    its clock) or are dropped on return. ``direct_io``: the files opened with ``O_DIRECT``
    (no page cache: the device's DMA fills the buffers, page-aligned, each read a whole
    number of ``DIRECT_ALIGN`` blocks); OSError where the file system refuses it. Returns
    the bytes read."""
    flags = os.O_RDONLY | (os.O_DIRECT if direct_io else 0)
    sizes = {p: os.path.getsize(p) for p in paths}
    buffers = {p: _fresh(sizes[p], direct_io) for p in paths}
    pairs = zip(paths, copies, strict=True) if copies else ()
    dups: dict[str, list[tuple[np.ndarray, float]]] = {}
    for p, n in pairs:
        size, whole = sizes[p], int(n)
        dups[p] = [(np.empty(size, np.uint8), 1.0) for _ in range(whole)]
        if n > whole:
            dups[p].append((np.empty(int(size * (n - whole)), np.uint8), n - whole))
    if keep is not None:
        keep.extend(buffers.values())
        keep.extend(d for ds in dups.values() for d, _ in ds)
    blocks = [
        (p, off, min(READ_BLOCK, size - off))
        for p, size in sizes.items()
        for off in range(0, size, READ_BLOCK)
    ]

    def read(block: tuple[str, int, int]) -> int:
        path, offset, n = block
        whole = -(-n // DIRECT_ALIGN) * DIRECT_ALIGN if direct_io else n  # (the last: padded)
        view = memoryview(buffers[path])[offset : offset + whole]
        fd = os.open(path, flags)
        try:
            done = 0
            while done < n:  # a short read: rare, but allowed (O_DIRECT: only at the end)
                got = os.preadv(fd, [view[done:]], offset + done)
                if not got or direct_io and got < n:
                    raise OSError(f"{path} ended at {offset + done + got}, {n} bytes expected")
                done += got
        finally:
            os.close(fd)
        view = view[:n]
        if check is not None:
            check(view)
        for dup, share in dups.get(path, ()):
            lo, hi = int(offset * share), min(dup.size, int((offset + n) * share))
            dup[lo:hi] = buffers[path][offset : offset + hi - lo]
        return n

    if threads == 1:
        return sum(map(read, blocks))
    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(read, blocks))


DIRECT_ALIGN = 4096  # O_DIRECT: buffer addresses, offsets and lengths in whole blocks


def _fresh(nbytes: int, aligned: bool) -> np.ndarray:
    """``nbytes`` of fresh memory (uint8); ``aligned``: page-aligned, with room for the last
    block padded to ``DIRECT_ALIGN`` (an anonymous mapping of its own), as O_DIRECT wants.
    (Not ``arrays.aligned_empty``: its huge pages would make the O_DIRECT read's memory
    cheaper to fault in than the buffered read's, and the two are compared.)"""
    if not aligned:
        return np.empty(nbytes, np.uint8)
    padded = max(1, -(-nbytes // DIRECT_ALIGN)) * DIRECT_ALIGN
    return np.frombuffer(mmap.mmap(-1, padded), np.uint8)


def way_name(threads: int, files: int) -> str:
    """A raw way's name: one file on one thread, or ``files`` files on ``threads`` threads."""
    return "1 file" if threads == 1 else f"{files} files, {threads} threads"


def _filled(n: int, block: np.ndarray) -> np.ndarray:
    out = np.empty(n, np.uint8)
    for start in range(0, n, block.size):
        out[start : start + block.size] = block[: n - start]
    return out


def raw_io(
    path: str, sizes: Sequence[int], rotate: int = 0, copies: Sequence[int] = ()
) -> dict[str, dict[str, dict]]:
    """The limits for a state of arrays of ``sizes`` bytes: NumPy write + fsync, read, and
    verified read (read + CRC32C) of the same bytes, several ways, from the page cache;
    with ``copies`` (per array), also "replicas": the verified read of the per-array files
    with each array's bytes then copied that many more times into fresh memory.

    The ways: one file on one thread, or one file per array on 2, 4 or 8 threads; their
    order rotates with ``rotate`` so none always comes first, and the reads alternate.
    Returns {"write" | "read" | "verified" [| "replicas"]: {way: Clock.record()}}.
    """
    block = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    arrays = [_filled(n, block) for n in sizes]
    os.makedirs(path)
    one = [os.path.join(path, "one.bin")]
    per_array = [os.path.join(path, f"a{i}.bin") for i in range(len(sizes))]
    ways = rotated([1, *RAW_THREADS], rotate)
    name = {n: way_name(n, len(sizes)) for n in ways}
    out: dict[str, dict[str, dict]] = {"write": {}, "read": {}, "verified": {}}
    if copies:
        out["replicas"] = {}
    for n in ways:
        for p in per_array if n > 1 else []:
            if os.path.exists(p):
                os.remove(p)
        with Clock() as clock:
            write_way(path, arrays, n)
        out["write"][name[n]] = clock.record()
    del arrays
    warm_page_cache(path)
    crc = crc32c()[1]
    for i, n in enumerate(ways):
        kinds = ["read", "verified"] + (["replicas"] if copies and n > 1 else [])
        for kind in alternate(kinds, rotate + i):
            gc.collect()
            kept: list = []
            with Clock() as clock:
                read_files(one if n == 1 else per_array, n, None if kind == "read" else crc,
                           kept, copies if kind == "replicas" else ())  # fmt: skip
            del kept  # freed outside the clock, as a restore's result outlives its clock
            out[kind][name[n]] = clock.record()
    shutil.rmtree(path)
    return out


def first_write(path: str, sizes: Sequence[int], threads: int) -> dict:
    """The raw write in a save's own conditions: the arrays built in this (fresh) process,
    a tiny write + fsync to warm up, then the one timed write + fsync of every byte, one
    file (``threads`` 1) or one file per array on ``threads`` threads. On a VM whose idle
    memory is slow to touch again (a balloon driver), later writes in one process run
    faster than the first; a save is a first write, so this is its like-for-like limit.
    Returns ``Clock.record()``."""
    block = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    arrays = [_filled(n, block) for n in sizes]
    os.makedirs(path)
    write_file(os.path.join(path, "warm.bin"), [block[: 1 << 20]])
    os.remove(os.path.join(path, "warm.bin"))
    gc.collect()
    with Clock() as clock:
        write_way(path, arrays, threads)
    shutil.rmtree(path)
    return clock.record()


def cold_reads(path: str, rotate: int = 0) -> dict[str, dict[str, dict]]:
    """Plain and verified reads of the files under ``path`` (a checkpoint) from the disk, on
    1, 2, 4 and 8 threads, the files fsynced and dropped from the page cache before each:
    {"read" | "verified": {way: Clock.record()}}."""
    paths, crc = files_under(path), crc32c()[1]
    out: dict[str, dict[str, dict]] = {"read": {}, "verified": {}}
    for i, n in enumerate(rotated([1, *RAW_THREADS], rotate)):
        for kind in alternate(["read", "verified"], rotate + i):
            gc.collect()
            drop_cold(path)
            kept: list = []
            with Clock() as clock:
                read_files(paths, n, crc if kind == "verified" else None, kept)
            del kept
            way = f"{len(paths)} file{'s' * (len(paths) > 1)}, {n} thread{'s' * (n > 1)}"
            out[kind][way] = clock.record()
    return out


@dataclass(frozen=True)
class FioRun:
    """One fio job: a sequential ``rw`` ("read" | "write") of ``direct`` (0: through the page
    cache, 1: O_DIRECT) I/O by ``engine``; its GB/s, or the error that stopped it."""

    rw: str
    direct: int
    engine: str
    gbps: float | None
    error: str = ""


def fio(path: str, nbytes: int) -> list[FioRun] | None:
    """Sequential write (fsynced at the end) then read of a ``nbytes`` file at ``path`` by
    fio, through the page cache and O_DIRECT, with psync and io_uring (where fio has it;
    reads drop the file from the page cache first): None if fio is not installed."""
    exe = shutil.which("fio")
    if exe is None:
        return None
    engines = subprocess.run([exe, "--enghelp"], capture_output=True, text=True).stdout
    size = max(1, nbytes >> 20) << 20  # whole 1 MiB blocks, as O_DIRECT wants
    runs = []
    for engine in ["psync"] + (["io_uring"] if "io_uring" in engines else []):
        for direct in (0, 1):
            for rw in ("write", "read"):
                cmd = [exe, "--name=bench", f"--filename={path}", f"--size={size}", "--bs=1M"]
                cmd += [f"--rw={rw}", f"--ioengine={engine}", f"--direct={direct}"]
                cmd += ["--end_fsync=1"] if rw == "write" else ["--invalidate=1"]
                cmd += ["--iodepth=16"] if engine == "io_uring" else []
                proc = subprocess.run(
                    [*cmd, "--output-format=json"], capture_output=True, text=True
                )
                runs.append(_fio_run(proc, rw, direct, engine))
    if os.path.exists(path):
        os.remove(path)
    return runs


def _fio_run(proc: subprocess.CompletedProcess, rw: str, direct: int, engine: str) -> FioRun:
    """The GB/s fio reported (its JSON follows any notes it prints), or why there is none."""
    text = proc.stdout
    try:
        job = json.loads(text[text.index("{") :])["jobs"][0]
    except ValueError:
        err = (proc.stderr or text).strip().splitlines()
        return FioRun(rw, direct, engine, None, err[-1] if err else f"exit {proc.returncode}")
    if job.get("error"):
        return FioRun(rw, direct, engine, None, f"error {job['error']}")
    return FioRun(rw, direct, engine, job[rw]["bw_bytes"] / GB)


@dataclass(frozen=True)
class Limit:
    """The best way of one kind of raw measurement: its name, GB/s and CPU s per GB."""

    way: str
    gbps: float
    cpu_per_gb: float


def best_ways(raw: dict[str, dict[str, list[dict]]], nbytes: int) -> dict[str, Limit]:
    """Each kind's best way (``raw``: {kind: {way: [Clock.record(), ...]}}), by median
    time, GB/s and CPU s per GB over ``nbytes``; kinds with no measurement are left out."""
    out = {}
    for kind, ways in raw.items():
        found = [
            Limit(way, gbps(nbytes, [r["seconds"] for r in recs]),
                  median(r["cpu"] for r in recs) / (nbytes / GB))
            for way, recs in ways.items()
        ]  # fmt: skip
        if found:
            out[kind] = max(found, key=lambda lim: lim.gbps)
    return out


def print_ways(raw: dict[str, dict[str, list[dict]]], nbytes: int, names: dict[str, str]) -> None:
    """Every way of each kind in ``names`` (kind: what to call it), and the best one."""
    best = best_ways(raw, nbytes)
    for kind, name in names.items():
        rates = {w: gbps(nbytes, [r["seconds"] for r in rs]) for w, rs in raw[kind].items()}
        print(f"{name} (median GB/s): " + ", ".join(f"{w} {v:.3f}" for w, v in rates.items()))
        if kind in best:
            b = best[kind]
            print(f"  limit = best: {b.gbps:.3f} GB/s ({b.way}), {b.cpu_per_gb:.3f} CPU s/GB")


def print_fio(runs: list[FioRun] | None, skipped: bool = False) -> None:
    """``fio``'s figures, or why there are none."""
    if runs is None:
        print("fio: " + ("skipped" if skipped else "not installed (apt-get install fio)"))
        return
    print("fio, sequential 1 MiB blocks of a file of the state's size (GB/s; reads cold):")
    for engine in dict.fromkeys(r.engine for r in runs):
        for direct in (0, 1):
            got = [r for r in runs if r.engine == engine and r.direct == direct]
            figs = [f"{r.rw} {r.gbps:.3f}" if r.gbps else f"{r.rw} failed ({r.error})" for r in got]
            print(f"  {engine:<9}{'O_DIRECT' if direct else 'buffered':<10}" + ", ".join(figs))


# --- reporting -----------------------------------------------------------------------------


def verdict(ok: bool | None) -> str:
    """PASS, FAIL, or SKIP where there was nothing to judge (None)."""
    return "SKIP" if ok is None else "PASS" if ok else "FAIL"


@dataclass(frozen=True)
class Table:
    """Fixed-width columns: (heading, format spec such as ``"<24"`` or ``">9.3f"``) each.

    A cell that is None prints as ``-``, a string as it is, a number with its column's spec.
    """

    columns: tuple[tuple[str, str], ...]
    sep: str = ""
    markdown: bool = False  # | a | b |, with a |---|---| rule under the headings

    def row(self, *cells) -> str:
        out = []
        for (_, spec), cell in zip(self.columns, cells, strict=False):
            text = cell is None or isinstance(cell, str)
            out.append(format("-" if cell is None else cell, _pad(spec) if text else spec))
        return f"| {' | '.join(out)} |" if self.markdown else self.sep.join(out)

    def head(self, rule: bool = False) -> str:
        """The headings, and under them a rule if asked (a markdown table always has one)."""
        head = self.row(*(name for name, _ in self.columns))
        if self.markdown:
            cells = [format(name, _pad(spec)) for name, spec in self.columns]
            return head + "\n|" + "|".join("-" * (len(c) + 2) for c in cells) + "|"
        return head + ("\n" + "-" * len(head) if rule else "")

    def print(self, rows: Iterable[Sequence], rule: bool = False) -> None:
        print(self.head(rule))
        for cells in rows:
            print(self.row(*cells))


def _pad(spec: str) -> str:
    """The alignment and width of a format spec (">9" of ">9.3f")."""
    return re.match(r"[<>^]?\d*", spec).group()


def write_json(path: str, data) -> None:
    """``data`` as JSON at ``path`` (results of record go under ``RESULTS``)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
