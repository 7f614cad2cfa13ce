"""The ``jaxckpt`` command: look at checkpoints from a shell, no accelerator, no model code.

    jaxckpt ls DIR                 the steps of a manager directory (and leftovers)
    jaxckpt info PATH [--json]     what a checkpoint holds
    jaxckpt verify PATH [--all]    read every chunk, check CRC32Cs, fingerprints (exit 1 on damage)
    jaxckpt diff A B [--atol X --rtol Y]   per-leaf differences; equal fingerprints: not read
    jaxckpt convert SRC DST [--to jaxckpt|safetensors]   Orbax/safetensors <-> jaxckpt
    jaxckpt goodput RUN [--process N] [--json] [--plot out.png]   ETTR, failures, costs

Paths may be local, ``s3://`` or ``gs://``. A user mistake prints one line and exits 2.
(argparse: four subcommands need no dependency; the progress bar is tqdm's when it is
installed and stderr is a terminal.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any

import numpy as np

from ... import errors
from ..emergency.local import LOCAL_FILE, parse_step
from ..manifest import COMMIT_FILE, LeafRecord, Manifest, read_manifest
from ..sharding import spec_from_json
from ..storage import Location, location


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxckpt", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", help="the steps of a manager directory")
    p.add_argument("dir")
    p = sub.add_parser("info", help="what a checkpoint holds")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="machine-readable (docs/CLI.md)")
    p = sub.add_parser("verify", help="read every chunk and check its CRC32C")
    p.add_argument("path")
    p.add_argument("--all", action="store_true", help="every step of a manager directory")
    p = sub.add_parser("convert", help="Orbax/safetensors -> jaxckpt, jaxckpt -> safetensors")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--to", choices=["jaxckpt", "safetensors"], default="jaxckpt")
    p = sub.add_parser("diff", help="per-leaf differences of two checkpoints")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--atol", type=float, default=0.0)
    p.add_argument("--rtol", type=float, default=0.0)
    p = sub.add_parser("goodput", help="ETTR, failures and costs from a run's log")
    p.add_argument("run", help="a manager's directory (it holds runlog/)")
    p.add_argument("--process", type=int, default=0, help="whose view of the run (default 0)")
    p.add_argument("--json", action="store_true", help="machine-readable (docs/CLI.md)")
    p.add_argument("--plot", metavar="OUT.png", help="draw the timeline (needs matplotlib)")
    args = parser.parse_args(argv)
    try:
        commands = {"ls": ls, "info": info, "verify": verify, "diff": diff, "convert": convert,
                    "goodput": goodput}  # fmt: skip
        return commands[args.command](args)
    except (errors.CheckpointError, OSError, ValueError) as e:
        print(f"jaxckpt {args.command}: {_one_line(e)}", file=sys.stderr)
        return 2


def _one_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


# --- ls ----------------------------------------------------------------------------------------


def _steps(d: Location) -> list[tuple[str, Location, bool]]:
    """(name, location, committed) of every step directory and leftover under ``d``."""
    out = []
    for name in d.list_children():
        base = name.split(".tmp-")[0]
        if not base.isdigit():
            continue
        loc = d.join(name)
        out.append((name, loc, ".tmp-" not in name and loc.exists(COMMIT_FILE)))
    return sorted(out, key=lambda t: (int(t[0].split(".tmp-")[0]), t[0]))


def ls(args: argparse.Namespace) -> int:
    d = location(args.dir)
    rows = _steps(d)
    if not rows:
        raise errors.CheckpointNotFoundError(
            f"{d.url} holds no step directories; pass a CheckpointManager's or an "
            "EmergencyCheckpointManager's local directory"
        )
    print(f"{'step':>10}  {'written':<25} {'size':>12}  {'tier':<7} metrics")
    for name, loc, committed in rows:
        if not committed:
            print(f"{name:>10}  {'-':<25} {'-':>12}  {'-':<7} (uncommitted leftover)")
            continue
        text = loc.read_bytes(LOCAL_FILE)
        if text is not None:  # an emergency local step (checked: a damaged one is an error)
            doc = parse_step(text, where=f"{loc.url}/{LOCAL_FILE}")
            size = sum(r.nbytes for r in doc.leaves)
            print(f"{int(name):>10}  {'-':<25} {_size(size):>12}  {'local':<7} -")
            continue
        try:  # a step the managers skip: say so, and list the rest
            m = read_manifest(loc)
        except (errors.ManifestError, errors.CheckpointNotFoundError) as e:
            print(f"{int(name):>10}  {'-':<25} {'-':>12}  {'-':<7} (broken: {_one_line(e)})")
            continue
        size = sum(r.nbytes for r in m.leaves)
        print(
            f"{int(name):>10}  {m.created:<25} {_size(size):>12}  {'remote':<7} {m.metrics or '-'}"
        )
    return 0


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# --- info --------------------------------------------------------------------------------------


def leaf_json(rec: LeafRecord, manifest: Manifest) -> dict[str, Any]:
    sharding = rec.sharding or {}
    out: dict[str, Any] = {
        "path": rec.name,
        "kind": rec.kind,
        "shape": list(rec.shape),
        "dtype": rec.dtype,
        "bytes": rec.nbytes,
    }
    if sharding.get("type") == "named":
        mesh = manifest.meshes[sharding["mesh"]]
        out["mesh"] = dict(zip(mesh["axis_names"], mesh["shape"], strict=True))
        out["spec"] = list(sharding["spec"])
    elif sharding:
        out["sharding"] = sharding
    if rec.kind == "python":
        out["value"] = rec.value
    if rec.fingerprint is not None:
        out["fingerprint"] = rec.fingerprint
    return out


def info_json(loc: Location) -> dict[str, Any]:
    m = read_manifest(loc)
    return {
        "path": loc.url,
        "format_version": list(m.format_version),
        "created": m.created,
        "writer": m.writer,
        "process_count": m.process_count,
        "bytes": sum(r.nbytes for r in m.leaves),
        "bytes_per_process": m.bytes_per_process,
        "custom_metadata": m.metadata,
        "metrics": m.metrics,
        "per_process": m.per_process,
        "leaves": [leaf_json(r, m) for r in m.leaves],
    }


def info(args: argparse.Namespace) -> int:
    doc = info_json(location(args.path))
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    print(f"{doc['path']}: format {'.'.join(map(str, doc['format_version']))}, written "
          f"{doc['created']} by jaxckpt {doc['writer'].get('jaxckpt', '?')} (jax "
          f"{doc['writer'].get('jax', '?')}), {doc['process_count']} process(es)")  # fmt: skip
    for leaf in doc["leaves"]:
        where = ""
        if "mesh" in leaf:
            where = f"  mesh {leaf['mesh']} spec {spec_from_json(leaf['spec'])}"
        value = f" = {leaf['value']!r}" if "value" in leaf else ""
        value += f"  fingerprint {leaf['fingerprint']}" if "fingerprint" in leaf else ""
        print(f"  {leaf['path']:<40} {leaf['kind']:<8} {str(tuple(leaf['shape'])):<16} "
              f"{leaf['dtype'] or '':<10} {_size(leaf['bytes']):>10}{where}{value}")  # fmt: skip
    print(f"total {_size(doc['bytes'])} in {len(doc['leaves'])} leaves; bytes per process "
          f"{doc['bytes_per_process']}")  # fmt: skip
    if doc["custom_metadata"] is not None:
        print(f"custom_metadata: {json.dumps(doc['custom_metadata'])}")
    if doc["metrics"]:
        print(f"metrics: {json.dumps(doc['metrics'])}")
    if doc["per_process"]:
        print(f"per-process values saved by processes {doc['per_process']}")
    return 0


# --- verify ------------------------------------------------------------------------------------


def verify(args: argparse.Namespace) -> int:
    from .verify import verify as verify_one

    loc = location(args.path)
    if args.all:
        paths = [step for _, step, committed in _steps(loc) if committed]
        if not paths:
            raise errors.CheckpointNotFoundError(f"{loc.url} holds no committed step")
    else:
        paths = [loc]
    bad = 0
    for path in paths:
        total = sum(r.nbytes for r in read_manifest(path).leaves if r.has_array)
        with _progress(total, path.name) as bar:
            report = verify_one(path.url, progress=None if bar is None else bar.update)
        for p in report.problems:
            chunk = "whole leaf" if p.chunk is None else f"chunk {list(p.chunk)}"
            print(f"DAMAGED {path.url}: leaf {p.leaf!r} {chunk} in {p.where}: {p.why}")
        if report.ok:
            print(
                f"ok {path.url}: {report.chunks} chunks, {_size(report.bytes)}, every CRC32C checked"
            )
        bad += len(report.problems)
    return 1 if bad else 0


def _progress(total: int, what: str) -> contextlib.AbstractContextManager[Any]:
    """tqdm's bar on a terminal (if tqdm is installed), else a context of None."""
    if sys.stderr.isatty():
        with contextlib.suppress(ImportError):
            from tqdm import tqdm

            return tqdm(total=total, unit="B", unit_scale=True, desc=what, leave=False)
    return contextlib.nullcontext()


# --- convert -----------------------------------------------------------------------------------


def convert(args: argparse.Namespace) -> int:
    from . import convert as conv

    if args.to == "safetensors":
        conv.to_safetensors(args.src, args.dst)
    else:
        conv.to_jaxckpt(args.src, args.dst)
    print(f"converted {location(args.src).url} -> {location(args.dst).url} ({args.to})")
    return 0


# --- goodput -----------------------------------------------------------------------------------


def goodput(args: argparse.Namespace) -> int:
    from .goodput import command

    return command(args)


# --- diff --------------------------------------------------------------------------------------


def diff(args: argparse.Namespace) -> int:
    from .convert import host_leaves

    a, b = location(args.a), location(args.b)
    ma, mb = read_manifest(a), read_manifest(b)
    ra, rb = {r.name: r for r in ma.leaves}, {r.name: r for r in mb.leaves}
    different = unchanged = 0
    same_layout = []
    for name in sorted(set(ra) | set(rb)):
        x, y = ra.get(name), rb.get(name)
        if x is None or y is None:
            print(f"{name}: only in {(a if y is None else b).url}")
            different += 1
        elif (x.kind, tuple(x.shape), x.dtype) != (y.kind, tuple(y.shape), y.dtype):
            print(
                f"{name}: {x.kind} {tuple(x.shape)} {x.dtype} -> {y.kind} {tuple(y.shape)} {y.dtype}"
            )
            different += 1
        elif not x.has_array:
            if x.value != y.value:
                print(f"{name}: {x.value!r} -> {y.value!r}")
                different += 1
        elif x.fingerprint is not None and x.fingerprint == y.fingerprint:
            unchanged += 1  # equal values (format 1.10): nothing to read
        else:
            same_layout.append(name)
    # the arrays: read a batch of each side at a time, never a whole checkpoint
    pairs = zip(
        host_leaves(a, [ra[n] for n in same_layout]),
        host_leaves(b, [rb[n] for n in same_layout]),
        strict=True,
    )
    for (x, va), (_, vb) in pairs:
        va, vb = np.asarray(va), np.asarray(vb)
        if va.tobytes() == vb.tobytes():
            continue
        fa, fb = va.astype(np.float64), vb.astype(np.float64)
        abs_diff = np.abs(fa - fb)
        # not empty: empty arrays of one shape and dtype have equal bytes
        max_abs = float(np.nanmax(abs_diff))
        max_rel = float(np.nanmax(abs_diff / np.maximum(np.abs(fb), np.finfo(np.float64).tiny)))
        close = np.allclose(fa, fb, atol=args.atol, rtol=args.rtol, equal_nan=True)
        print(f"{x.name}: max abs diff {max_abs:.6g}, max rel diff {max_rel:.6g}"
              f"{' (within tolerance)' if close else ''}")  # fmt: skip
        different += not close
    print(f"{'differ' if different else 'equal'}: {different} leaf(s) differ"
          f"{f' beyond atol={args.atol} rtol={args.rtol}' if args.atol or args.rtol else ''}"
          f"; {unchanged} array leaf(s) unchanged by fingerprint (not read), "
          f"{len(same_layout)} read")  # fmt: skip
    return 1 if different else 0
