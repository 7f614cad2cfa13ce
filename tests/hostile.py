"""Hostile values: every dtype jaxckpt claims, filled with random bit patterns.

Random bits give NaNs with payloads, signed zeros, infinities and subnormals wherever the
dtype has them; ``random_bits`` also puts a few of those at the front of every float array,
so a small array still holds them. Compare with ``assert_same_bits``: values compare NaN
unequal and -0.0 equal to 0.0, bytes don't lie.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

_STANDARD = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
]  # fmt: skip
_ML = [
    "bfloat16", "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn",
    "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn",
    "int1", "int2", "int4", "uint1", "uint2", "uint4",
]  # fmt: skip

DTYPES: list[np.dtype] = [np.dtype(n) for n in _STANDARD] + [
    np.dtype(getattr(ml_dtypes, n)) for n in _ML
]
"""Every dtype a jax.Array holds and jaxckpt stores (64-bit ones need jax_enable_x64)."""

NARROW = [d for d in DTYPES if d.itemsize <= 2 and d.kind != "b"]
"""The dtypes whose bits moved through devices have been seen to change (and a few more)."""


def bits(dtype: np.dtype) -> int:
    """The dtype's width in bits (int4: 4, though NumPy stores it in a byte)."""
    dtype = np.dtype(dtype)
    try:
        return int(ml_dtypes.iinfo(dtype).bits)
    except (ValueError, TypeError):
        pass
    try:
        return int(ml_dtypes.finfo(dtype).bits)
    except (ValueError, TypeError):
        return dtype.itemsize * 8


def direct_dtype(dtype: np.dtype) -> bool:
    """Stored with every bit of every byte its own: what jaxckpt's direct path reads (bool,
    and the sub-byte types XLA packs, go through TensorStore)."""
    return dtype.kind != "b" and dtype.name not in ("int2", "int4", "float4_e2m1fn")


def is_float(dtype: np.dtype) -> bool:
    """A real floating-point dtype, NumPy's or ml_dtypes' (whose ``kind`` is 'V')."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or (dtype.kind == "V" and bits(dtype) and _ml_float(dtype))


def _ml_float(dtype: np.dtype) -> bool:
    try:
        ml_dtypes.finfo(dtype)
        return True
    except (ValueError, TypeError):
        return False


_SPECIAL_F32 = np.array([np.nan, -0.0, np.inf, -np.inf, 1e-45, -1e-40], np.float32)


def random_bits(shape, dtype, rng: np.random.Generator) -> np.ndarray:
    """An array of ``shape`` and ``dtype`` whose every element is a random bit pattern (a
    valid one for sub-byte types); floats start with NaN payloads, -0.0, inf and subnormals."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    if dtype.kind == "b":
        return rng.integers(0, 2, n).astype(bool).reshape(shape)
    width = bits(dtype)
    if width < 8:
        codes = rng.integers(0, 1 << width, n, dtype=np.int64)
        if dtype.kind == "i":  # two's complement: codes above the sign bit are negative
            codes = np.where(codes >= 1 << (width - 1), codes - (1 << width), codes)
            return codes.astype(np.int8).astype(dtype).reshape(shape)
        if dtype.kind == "u":
            return codes.astype(np.uint8).astype(dtype).reshape(shape)
        return codes.astype(np.uint8).view(dtype).reshape(shape)
    out = np.frombuffer(rng.bytes(n * dtype.itemsize), dtype).copy()
    if is_float(dtype) and n:
        with np.errstate(over="ignore", invalid="ignore"):
            head = _SPECIAL_F32[: min(n, len(_SPECIAL_F32))].astype(dtype)
        payload = np.frombuffer(rng.bytes(dtype.itemsize), np.uint8)  # a NaN with a payload
        out[: len(head)] = head
        raw = out.view(np.uint8).reshape(n, dtype.itemsize)
        with np.errstate(over="ignore", invalid="ignore"):
            nan_at = np.flatnonzero(np.isnan(out.astype(np.float32)))
        if len(nan_at):  # flip low mantissa bits of one NaN; keep it a NaN if it stays one
            i = nan_at[0]
            trial = raw[i].copy()
            trial[0] ^= payload[0] | 1
            with np.errstate(over="ignore", invalid="ignore"):
                still_nan = np.isnan(trial.view(dtype).astype(np.float32))[0]
            if still_nan:
                raw[i] = trial
    return out.reshape(shape)


def assert_same_bits(expected, actual, where: str = "") -> None:
    """``actual`` holds exactly ``expected``'s dtype, shape and bytes."""
    e, a = np.asarray(expected), np.asarray(actual)
    assert e.dtype == a.dtype, f"{where}: dtype {a.dtype}, expected {e.dtype}"
    assert e.shape == a.shape, f"{where}: shape {a.shape}, expected {e.shape}"
    eb = np.ascontiguousarray(e).view(np.uint8).reshape(e.size, -1) if e.size else e
    ab = np.ascontiguousarray(a).view(np.uint8).reshape(a.size, -1) if a.size else a
    if e.tobytes() != a.tobytes():
        bad = np.flatnonzero((eb != ab).any(axis=-1))
        raise AssertionError(
            f"{where}: {len(bad)} of {e.size} {e.dtype} elements differ, first at flat index "
            f"{bad[0]}: {eb[bad[0]].tobytes().hex()} -> {ab[bad[0]].tobytes().hex()}"
        )


NAN_PAYLOADS_F32 = [0x7FC00001, 0xFFC0BEEF, 0x7F800001, 0xFFBFFFFF]  # quiet and signalling
NAN_PAYLOADS_BF16 = [0x7FC1, 0xFF81, 0x7F81]


def step_values(step: int, rows: int, cols: int) -> dict:
    """A training state that is a deterministic function of ``step`` (the fault tests and
    the soak compare every restored step with it): the bit patterns ``default_rng(step)``
    draws as a (rows, cols) float32 with NaN payloads, a bfloat16, both float8s and a
    NumPy int32 leaf, and the step."""
    rng = np.random.default_rng(step)
    w = rng.integers(0, 2**32, (rows, cols), dtype=np.uint32)
    w[0, : len(NAN_PAYLOADS_F32)] = NAN_PAYLOADS_F32
    bf = rng.integers(0, 2**16, (256, 256), dtype=np.uint16)
    bf[0, : len(NAN_PAYLOADS_BF16)] = NAN_PAYLOADS_BF16
    return {
        "w": w.view(np.float32),
        "bf16": bf.view(ml_dtypes.bfloat16),
        "e4m3": rng.integers(0, 2**8, (128, 256), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn),
        "e5m2": rng.integers(0, 2**8, (128, 256), dtype=np.uint8).view(ml_dtypes.float8_e5m2),
        "host": rng.integers(-(2**31), 2**31, (64,), dtype=np.int32),  # a NumPy leaf
        "step": step,
    }
