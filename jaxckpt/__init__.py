"""jaxckpt: fast, crash-safe checkpoints of sharded JAX pytrees, restorable onto any mesh.

>>> import jaxckpt
>>> jaxckpt.save("/ckpt/step_100", state)
>>> state = jaxckpt.restore("/ckpt/step_100", target=abstract_state)
"""

from . import errors, export, safetensors
from .checkpoint import custom_metadata, metadata, save, user_metadata
from .emergency import EmergencyCheckpointManager, RecoveryReport
from .manager import CheckpointManager
from .manifest import FORMAT_VERSION, ArrayInfo
from .options import EmergencyOptions, Options
from .restoring import restore
from .staging import Staged, stage

__version__ = "0.1.0"

__all__ = [
    "ArrayInfo",
    "CheckpointManager",
    "custom_metadata",
    "EmergencyCheckpointManager",
    "EmergencyOptions",
    "Options",
    "RecoveryReport",
    "Staged",
    "FORMAT_VERSION",
    "errors",
    "export",
    "safetensors",
    "metadata",
    "restore",
    "save",
    "stage",
    "user_metadata",
]
