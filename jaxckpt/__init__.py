"""jaxckpt: fast, crash-safe checkpoints of sharded JAX pytrees, restorable onto any mesh.

>>> import jaxckpt
>>> jaxckpt.save("/ckpt/step_100", state)
>>> state = jaxckpt.restore("/ckpt/step_100", target=abstract_state)
"""

from . import errors
from .checkpoint import metadata, restore, save, user_metadata
from .manifest import FORMAT_VERSION, ArrayInfo

__version__ = "0.1.0"

__all__ = [
    "ArrayInfo",
    "FORMAT_VERSION",
    "errors",
    "metadata",
    "restore",
    "save",
    "user_metadata",
]
