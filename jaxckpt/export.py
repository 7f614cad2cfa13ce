"""Export a sharded function for serving without its model code: :func:`save` and :func:`load`.

``save`` writes one directory: the parameters once as a jaxckpt checkpoint (``params/``), one
serialized ``jax.export.Exported`` per serving device count (``artifacts/``) and, last,
``signature.json`` (its records, layout and checks: :mod:`jaxckpt._src.export.format`).
``save`` lives in :mod:`jaxckpt._src.export.save`; ``load`` and the callable it returns in
:mod:`jaxckpt._src.export.serving`; ``signature`` reads ``signature.json`` (as a dict).

Each artifact is lowered over a :class:`jax.sharding.AbstractMesh` with the export mesh's axis
names, so exporting needs no serving devices. The axis sizes for ``n`` devices, unless given
explicitly: walking the axes from the last to the second, each keeps ``gcd(size, rest)``
where ``rest`` is what is left of ``n``; the first axis takes the remainder. A (4, 2) mesh
gives 8 -> (4, 2), 4 -> (2, 2), 2 -> (1, 2), 1 -> (1, 1), 16 -> (8, 2).

>>> jaxckpt.export.save("/exports/mlp", apply, params, x_spec, mesh=mesh,
...                     in_specs=(P("data"),), out_specs=P("data"), device_counts=[1, 4, 8])
>>> served = jaxckpt.export.load("/exports/mlp")  # in the serving process
>>> y = served(x)
"""

from ._src.export.format import signature as signature
from ._src.export.save import axis_sizes_for as axis_sizes_for
from ._src.export.save import save as save
from ._src.export.serving import Served as Served
from ._src.export.serving import load as load

__all__ = [
    "Served",
    "axis_sizes_for",
    "load",
    "save",
    "signature",
]
