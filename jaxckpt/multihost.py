"""Process index/count, barriers and key-value agreement through ``jax.distributed``.

All use of JAX's coordination-service client lives here. With one process every call is a
cheap no-op, so single-host code pays nothing.
"""

from __future__ import annotations

import itertools

import jax

from .errors import CoordinationError

_counter = itertools.count()


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise CoordinationError(
            "jax.process_count() > 1 but jax.distributed is not initialized; call "
            "jax.distributed.initialize() before saving or restoring"
        )
    return client


def unique_name(prefix: str) -> str:
    """A name that is the same on every process for the n-th call with this prefix."""
    return f"jaxckpt/{prefix}/{next(_counter)}"


def barrier(name: str, timeout_s: float) -> None:
    """Waits until every process reaches ``name``; raises CoordinationError on timeout."""
    if process_count() == 1:
        return
    try:
        _client().wait_at_barrier(name, int(timeout_s * 1000))
    except Exception as e:  # the client raises XlaRuntimeError / JaxRuntimeError
        raise CoordinationError(
            f"barrier {name!r}: not every process arrived within {timeout_s:.0f}s "
            f"(this is process {process_index()} of {process_count()}): {e}. A process "
            "may have died or be saving a different step; check every process's log"
        ) from e


def broadcast(name: str, value: str | None, timeout_s: float) -> str:
    """Process 0's ``value`` on every process (through the key-value store)."""
    if process_count() == 1:
        assert value is not None
        return value
    client = _client()
    if process_index() == 0:
        assert value is not None
        client.key_value_set(name, value)
        return value
    try:
        return client.blocking_key_value_get(name, int(timeout_s * 1000))
    except Exception as e:
        raise CoordinationError(
            f"waiting for process 0 to publish {name!r} timed out after {timeout_s:.0f}s: "
            f"{e}. Process 0 may have died or not called save/restore"
        ) from e
