"""Moving checkpoint data between processes through JAX collectives.

* ``send_shards``: peer copies of local checkpoints, device to device. Each array's owned
  shards go, as they are, to the device at the same place on process ``p + j``: one
  ``ppermute`` per shift inside a single jitted program, *dispatched* on the calling thread
  (so every process issues its collectives in the same order as its training steps) and
  waited for by the writer thread. ``save`` therefore does not wait for the transfer.
  Floating-point shards travel as unsigned integers of their width and 1- and 2-bit
  integers as packed rows (``bits``): no bit changes on the way.
* ``send_rows``: packed byte rows (:mod:`jaxckpt._src.emergency.wire`), one device per
  process, in ``ppermute`` rounds of (partial) permutations: on save, the peer copies of
  leaves that cannot go device to device (arrays on a subset of the processes, or uneven
  shards); on restore, missing slices, only to the process that needs them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, Sharding
from jax.sharding import PartitionSpec as P

from .. import bits, multihost
from ..boxes import Index, extent, from_slices
from ..io import arrays
from ..io.layout import ADOPT_ALIGN
from .local import Slices, Writers
from .planner import SliceKey


def peer_shifts(hosts: list[str], k: int) -> tuple[tuple[int, ...], list[int]]:
    """The ``k`` shifts ``j`` (process ``p`` copies to ``(p + j) % count``) for peer copies,
    given each process's host: the shifts that put the fewest copies on their own host (none,
    when processes are spread evenly), smallest first. Returns (shifts, processes whose
    copies share their host under them) — all processes on one host leave no choice.
    """
    count = len(hosts)
    if count < 2 or k < 1:
        return (), []

    def shared(j: int) -> int:
        return sum(hosts[(p + j) % count] == hosts[p] for p in range(count))

    shifts = tuple(sorted(range(1, count), key=lambda j: (shared(j), j))[:k])
    same = sorted({p for j in shifts for p in range(count) if hosts[(p + j) % count] == hosts[p]})
    return shifts, same


@dataclass(frozen=True)
class _Route:
    """Where one array's owned shards go, for an array laid out on ``devices``."""

    devices: tuple[Any, ...]  # every device holding the array, in the sharding's order
    perms: tuple[tuple[tuple[int, int], ...], ...]  # per shift: (source, dest) positions
    receives: tuple[tuple[tuple[Any, Index, int], ...], ...]  # per shift: (my device, index,
    # sending process)


_Moving = tuple[str, np.dtype, _Route, list[jax.Array | None]]  # an array's transfers, by shift
_Buffers = dict[tuple[Any, ...], list[jax.Array]]  # received buffers, by program


@functools.lru_cache(maxsize=1024)
def _route(
    sharding: Sharding, shape: tuple[int, ...], shifts: tuple[int, ...], me: int, count: int
) -> _Route | None:
    """The ``_Route`` of an array, or None when it cannot go device to device: its devices
    leave out a process or differ in number between processes, or its shards differ in shape.

    Each process sends every distinct index it holds, once (from its first device holding
    it), to the device at the same place on process ``(p + j) % count``, unless that process
    already holds the index. Every process computes the same routes from the same sharding.
    """
    imap = sharding.devices_indices_map(shape)
    devices: tuple[Any, ...] = tuple(imap)  # (jaxlib has no stubs for its Device)
    by_proc: dict[int, list[Any]] = {}
    for d in devices:
        by_proc.setdefault(d.process_index, []).append(d)
    if sorted(by_proc) != list(range(count)) or len({len(v) for v in by_proc.values()}) != 1:
        return None
    index = {d: from_slices(imap[d], shape) for d in devices}
    if len({extent(i) for i in index.values()}) != 1:
        return None
    pos = {d: i for i, d in enumerate(devices)}
    perms, receives = [], []
    for j in shifts:
        pairs, mine = [], []
        for p in range(count):
            q = (p + j) % count
            skip = {index[d] for d in by_proc[q]}  # held there, or sent already
            for k, d in enumerate(by_proc[p]):
                if index[d] in skip:
                    continue
                skip.add(index[d])
                pairs.append((pos[d], pos[by_proc[q][k]]))
                if q == me:
                    mine.append((by_proc[q][k], index[d], p))
        perms.append(tuple(pairs))
        receives.append(tuple(mine))
    return _Route(devices, tuple(perms), tuple(receives))


class PeerCopies:
    """Shards in flight from other processes (``send_shards``); ``collect`` waits for them.

    On CPU devices its received buffers can be handed to the next ``send_shards`` (``reuse``):
    they are donated to the next transfer, which then writes into memory already mapped
    (fresh buffers are page-faulted in by the transfer, which reusing them saves:
    docs/MEASURED.md).
    """

    def __init__(self, moving: list[_Moving], buffers: _Buffers) -> None:
        self._moving = moving
        self._buffers = buffers

    def collect(self) -> tuple[Slices, Writers]:
        """The shards received (host arrays), and each one's sender."""
        slices: Slices = {}
        senders: Writers = {}
        for name, dtype, route, outs in self._moving:
            for received, out in zip(route.receives, outs, strict=True):
                if out is None:
                    continue
                on = {s.device: s.data for s in out.addressable_shards}
                for device, index, sender in received:
                    key = SliceKey(name, index)
                    if key not in slices:  # a view on CPU, of the bits sent
                        slices[key] = np.asarray(on[device]).view(dtype)
                        senders[key] = sender
        self._moving = []
        return slices, senders


def send_shards(
    arrays_by_name: dict[str, jax.Array],
    shifts: tuple[int, ...],
    reuse: PeerCopies | None = None,
) -> tuple[PeerCopies, list[str]]:
    """Starts sending each array's owned shards to processes ``p + j`` for ``j`` in ``shifts``
    (a collective call: every process passes the same names, shardings and shifts).

    Returns at once, with the transfers in flight, and the names of the arrays that must go
    as packed rows instead (see ``_route``). ``reuse``: the previous result, collected and
    no longer read (its host arrays dropped): its CPU buffers receive this transfer.
    """
    me, count = jax.process_index(), jax.process_count()
    by_devices: dict[tuple[Any, ...], list[tuple[str, jax.Array, _Route]]] = {}
    rows_instead: list[str] = []
    for name, arr in arrays_by_name.items():
        route = _route(arr.sharding, tuple(arr.shape), shifts, me, count)
        if route is None or bits.carrier(arr.dtype) is None:
            rows_instead.append(name)
        elif any(route.perms):
            by_devices.setdefault(route.devices, []).append((name, arr, route))
    old = reuse._buffers if reuse is not None else {}
    moving: list[_Moving] = []
    buffers: _Buffers = {}
    for devices, members in by_devices.items():
        # Arrays laid out by a mesh over exactly these devices go in as they are (their own
        # spec); others are first restacked, uncopied, over a flat mesh of the devices.
        named = [s for _, a, _ in members if isinstance(s := a.sharding, NamedSharding)]
        meshes = {s.mesh for s in named}
        mesh = meshes.pop() if len(named) == len(members) and len(meshes) == 1 else None
        if isinstance(mesh, Mesh) and tuple(mesh.devices.flat) == devices:
            args = [arr for _, arr, _ in members]
            specs = tuple(s.spec for s in named)
        else:
            mesh = _flat_mesh(devices)
            args = [_flat(arr, mesh) for _, arr, _ in members]
            specs = (P("d"),) * len(args)
        perms = tuple(r.perms for _, _, r in members)
        key = (mesh, specs, perms, tuple((x.shape, x.dtype) for x in args))
        into = old.pop(key, None)
        if into is not None and any(b.is_deleted() for b in into):
            into = None  # (a host view still alive only makes XLA allocate, as without)
        outs = _shift_fn(mesh, specs, perms, into is not None)(*args, *(into or ()))
        del args, into  # the program holds its inputs; a donating train step may take them
        if all(d.platform == "cpu" for d in devices):
            buffers[key] = list(outs)
        each = iter(outs)
        for name, arr, route in members:
            outs_i = [next(each) if p else None for p in route.perms]
            moving.append((name, np.dtype(arr.dtype), route, outs_i))
    old.clear()
    return PeerCopies(moving, buffers), rows_instead


@functools.lru_cache(maxsize=64)
def _flat_mesh(devices: tuple[Any, ...]) -> Mesh:
    return Mesh(np.array(devices), ("d",))


def _flat(arr: jax.Array, mesh: Mesh) -> jax.Array:
    """``arr``'s shards, unchanged and uncopied, stacked along axis 0 in ``mesh`` order."""
    shards = {s.device: s.data for s in arr.addressable_shards}
    mine = [shards[d] for d in mesh.devices.flat if d in shards]
    shape = tuple(mine[0].shape)  # >= 1-d: a 0-d array is held whole by every process
    return jax.make_array_from_single_device_arrays(
        (mesh.devices.size * shape[0], *shape[1:]), NamedSharding(mesh, P("d")), mine
    )


@functools.lru_cache(maxsize=64)
def _shift_fn(
    mesh: Mesh,
    specs: tuple[P, ...],
    perms: tuple[tuple[tuple[tuple[int, int], ...], ...], ...],
    into: bool,
) -> Callable[..., tuple[jax.Array, ...]]:
    """One program moving every array (laid out by ``specs`` over ``mesh``): ``perms[i][j]``
    for array ``i`` and shift ``j``, device positions in ``mesh`` order. Each output holds,
    stacked along axis 0 in that order, what each device received.

    ``into``: the outputs follow as donated arguments (same shapes), and land in them.
    """
    n_in = len(perms)
    n_out = sum(1 for ps in perms for p in ps if p)
    axes = tuple(mesh.axis_names)
    stacked = P(axes if len(axes) > 1 else axes[0])

    def body(*xs: jax.Array) -> tuple[jax.Array, ...]:  # moves bits, not values (``bits``)
        # (no carrier is None here: ``send_shards`` sends those arrays as rows)
        as_bits = [
            jax.lax.bitcast_convert_type(x, bits.carrier(x.dtype) or x.dtype) for x in xs[:n_in]
        ]
        return tuple(
            jax.lax.ppermute(x, axes, list(p))
            for x, ps in zip(as_bits, perms, strict=True)
            for p in ps
            if p
        )

    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=specs + ((stacked,) * n_out if into else ()),
            out_specs=(stacked,) * n_out,
        ),
        donate_argnums=tuple(range(n_in, n_in + n_out)) if into else (),
        keep_unused=True,  # the donated outputs are not read: kept, so they can be aliased
    )


def _row_mesh() -> Mesh:
    """One device per process, in process order."""
    first: dict[int, Any] = {}
    for d in sorted(jax.devices(), key=lambda d: d.id):
        first.setdefault(d.process_index, d)
    return Mesh(np.array([first[p] for p in range(jax.process_count())]), ("p",))


def send_rows(
    row: np.ndarray,
    rounds: Sequence[tuple[tuple[int, int], ...]],
    *,
    name: str,
    timeout_s: float,
) -> list[np.ndarray | None]:
    """``ppermute`` rounds of partial permutations moving packed rows (a collective call:
    every process calls it with the same ``rounds``).

    Each round is ((sender, receiver), ...), each process at most once on each side; a
    sender's ``row`` goes to its receiver in every round (the others pass an empty row,
    never read). Returns, per round, the row this process receives (zero-padded to the
    longest row), or None when it receives nothing. The width is agreed and the row put on
    the device once for all rounds; only the pairs' rows move.
    """
    me = jax.process_index()
    # the widest row, decided by process 0: O(processes) key-value traffic, not O(N^2)
    widest = multihost.decided(
        f"{name}/len", str(row.size), lambda sizes: str(max(map(int, sizes))), timeout_s
    )
    width = int(widest)
    receives = [any(b == me for _, b in pairs) for pairs in rounds]
    if width == 0:
        return [np.zeros(0, np.uint8) if r else None for r in receives]
    mesh = _row_mesh()
    x = _global_row(mesh, row, width, zero=any(a == me for pairs in rounds for a, _ in pairs))
    out = []
    for pairs, receive in zip(rounds, receives, strict=True):
        y = _permute_fn(mesh, tuple(pairs))(x)
        out.append(np.asarray(y.addressable_shards[0].data)[0] if receive else None)
    return out


def _global_row(mesh: Mesh, row: np.ndarray, width: int, zero: bool) -> jax.Array:
    """This process's row, padded to ``width``, as its shard of a (count, width) array.

    ``zero=False``: the row is never read (not a sender), so its padding is left unwritten
    (the memory is never touched).
    """
    me = mesh.devices[jax.process_index()]
    if row.size == width and row.ctypes.data % ADOPT_ALIGN == 0:
        padded = row.reshape(1, width)  # the row itself: no copy
    else:
        padded = arrays.aligned_empty((1, width), np.dtype(np.uint8))
        padded[0, : row.size] = row
        if zero:
            padded[0, row.size :] = 0
    # may_alias: the device adopts the row instead of copying it (the caller drops the row;
    # collectives write their results into fresh buffers)
    return jax.make_array_from_single_device_arrays(
        (mesh.devices.size, width),
        NamedSharding(mesh, P("p")),
        [jax.device_put(padded, me, may_alias=True)],
    )


@functools.lru_cache(maxsize=32)
def _permute_fn(mesh: Mesh, perm: tuple[tuple[int, int], ...]) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(
        jax.shard_map(
            lambda b: jax.lax.ppermute(b, "p", list(perm)),
            mesh=mesh,
            in_specs=P("p"),
            out_specs=P("p"),
        )
    )
