"""jaxckpt: fast, crash-safe checkpoints of sharded JAX pytrees, restorable onto any mesh.

>>> import jaxckpt
>>> jaxckpt.save("/ckpt/step_100", state)
>>> state = jaxckpt.restore("/ckpt/step_100", target=abstract_state)
"""

from . import errors as errors
from . import export as export
from . import safetensors as safetensors
from ._src.emergency.manager import EmergencyCheckpointManager as EmergencyCheckpointManager
from ._src.emergency.recovery import RecoveryReport as RecoveryReport
from ._src.goodput import Goodput as Goodput
from ._src.goodput import goodput as goodput
from ._src.manager import CheckpointManager as CheckpointManager
from ._src.manifest import FORMAT_VERSION as FORMAT_VERSION
from ._src.manifest import ArrayInfo as ArrayInfo
from ._src.monitoring import Figures as Figures
from ._src.options import EmergencyOptions as EmergencyOptions
from ._src.options import Options as Options
from ._src.readers import custom_metadata as custom_metadata
from ._src.readers import metadata as metadata
from ._src.readers import per_process as per_process
from ._src.restoring import restore as restore
from ._src.saving import save as save
from ._src.staging import Staged as Staged
from ._src.staging import stage as stage

__version__ = "0.1.0"  # the package's only version: pyproject.toml reads it from here

__all__ = [
    "ArrayInfo",
    "CheckpointManager",
    "custom_metadata",
    "EmergencyCheckpointManager",
    "EmergencyOptions",
    "Figures",
    "Goodput",
    "Options",
    "RecoveryReport",
    "Staged",
    "FORMAT_VERSION",
    "errors",
    "export",
    "goodput",
    "safetensors",
    "metadata",
    "per_process",
    "restore",
    "save",
    "stage",
]
