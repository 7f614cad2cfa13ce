"""Reading JSON from files jaxckpt did not necessarily write intact (manifests, ``local.json``,
export signatures): ``parse_json`` and ``Fields``, which check each field into a typed value
or raise a :class:`ManifestError` naming the file, the field and the value found."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from ..errors import ManifestError

MAX_PROCESSES = 1 << 20
MAX_NDIM = 64
MAX_BYTES = 1 << 62  # no array is bigger; larger counts are damage


def parse_json(text: str | bytes, *, where: str, what: str) -> Any:
    """``text`` as JSON; damage (not UTF-8, not JSON, nested too deep) is a ManifestError."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise ManifestError(
            f"{where}: {what} is not valid JSON ({type(e).__name__}: {str(e)[:200]}); the file "
            "is truncated or damaged: restore another step, or re-save"
        ) from e


def numpy_dtype(name: Any) -> np.dtype | None:
    """The dtype a non-empty string names (ml_dtypes' names too, once imported), else None."""
    try:
        return np.dtype(name) if isinstance(name, str) and name else None
    except (TypeError, ValueError, SyntaxError):  # SyntaxError: a name like "(2,"
        return None


@dataclass(frozen=True)
class Fields:
    """Checks fields of a JSON document read from ``where``; every failure is a
    :class:`ManifestError` naming the file, the field and the value found."""

    where: str

    def bad(self, at: str, why: str, value: Any) -> NoReturn:
        text = repr(value)
        text = text if len(text) <= 80 else text[:77] + "..."
        raise ManifestError(
            f"{self.where}: field {at} {why}, got {text}; the file is damaged or was not "
            "written by jaxckpt: restore another step, or re-save"
        )

    def need(self, doc: dict, key: str, at: str = "") -> Any:
        if key not in doc:
            self.bad(f"{at}{key}", "is missing", None)
        return doc[key]

    def integer(self, v: Any, at: str, lo: int = 0, hi: int = MAX_BYTES) -> int:
        if type(v) is not int:
            self.bad(at, "must be an integer", v)
        if not lo <= v <= hi:
            self.bad(at, f"must be in [{lo}, {hi}]", v)
        return v

    def text(self, v: Any, at: str) -> str:
        if not isinstance(v, str):
            self.bad(at, "must be a string", v)
        return v

    def obj(self, v: Any, at: str) -> dict:
        if not isinstance(v, dict):
            self.bad(at, "must be an object", v)
        return v

    def items(
        self, v: Any, at: str, item: Callable[[Any, str], Any], length: int | None = None
    ) -> list:
        if not isinstance(v, list):
            self.bad(at, "must be a list", v)
        if length is not None and len(v) != length:
            self.bad(at, f"must have {length} entries", v)
        return [item(x, f"{at}[{i}]") for i, x in enumerate(v)]

    def opt_list(
        self, doc: dict, key: str, item: Callable[[Any, str], Any], length: int | None = None
    ) -> list | None:
        v = doc.get(key)
        return None if v is None else self.items(v, key, item, length)

    def opt_dict(self, doc: dict, key: str) -> dict | None:
        v = doc.get(key)
        return None if v is None else self.obj(v, key)

    def shape(self, v: Any, at: str, lo: int = 0) -> list[int]:
        got = self.items(v, at, lambda x, a: self.integer(x, a, lo=lo))
        if len(got) > MAX_NDIM:
            self.bad(at, f"has more than {MAX_NDIM} dimensions", v)
        return got

    def dtype(self, v: Any, at: str) -> np.dtype:
        dt = numpy_dtype(self.text(v, at))
        if dt is None:
            self.bad(at, "is not a dtype", v)
        if dt.kind not in "biufc" and not dt.type.__module__.startswith("ml_dtypes"):
            self.bad(at, "is not a numeric dtype jaxckpt stores", v)
        return dt

    def spec(self, v: Any, at: str, axes: list[str], ndim: int) -> list:
        """A PartitionSpec as JSON: entries null, an axis name or a list of names."""
        spec = self.items(v, at, lambda e, a: e if e is None else self._axes(e, a))
        used = [n for e in spec if e is not None for n in ([e] if isinstance(e, str) else e)]
        if len(spec) > ndim:
            self.bad(at, f"has more entries than the {ndim} dimensions", v)
        if any(n not in axes for n in used) or len(set(used)) != len(used):
            self.bad(at, f"must name each of the mesh axes {axes} at most once", v)
        return spec

    def _axes(self, e: Any, at: str) -> str | list[str]:
        return self.text(e, at) if not isinstance(e, list) else self.items(e, at, self.text)
