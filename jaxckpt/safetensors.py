r"""Hugging Face safetensors in and out of sharded pytrees, without gathering on one host.

``load`` reads, on each process, only the byte ranges of the tensors its devices need;
``save`` writes the HF sharded layout (``model-0000i-of-0000N.safetensors`` and
``model.safetensors.index.json``) with every process writing the slices it owns straight
into the files. ``names`` maps a leaf's path (its keys joined by ``.``) to a tensor name;
``transforms`` say how a tensor's layout differs from the leaf's. Both are lists of
``(regex, ...)`` rules where the first rule whose regex matches the path applies (or a
callable of the path). A names replacement is ``re.sub``'s (``\1`` is a group); ``{i}`` in
it is the layer number of a ``Stack`` leaf, the only placeholder. A chain's ``Reshape`` and
``Transpose`` steps all apply, in order, from the file towards the leaf (``save`` inverts
them); ``Stack`` and ``Cast`` are markers:

>>> llama = [
...     (r"layers\.(q|k|v|o)_proj\.kernel$", [jaxckpt.safetensors.Stack(), Transpose((1, 0))]),
... ]
>>> params = jaxckpt.safetensors.load("hf_model/", abstract_params, names=rules, transforms=llama)

The ``safetensors`` package is not needed (it cannot read byte ranges from object stores nor
let several processes write slices of one file); files written here read back bit-exactly
with ``safetensors.numpy.load_file``.
"""

from ._src.safetensors.format import TensorInfo as TensorInfo
from ._src.safetensors.load import Files as Files
from ._src.safetensors.load import load as load
from ._src.safetensors.load import metadata as metadata
from ._src.safetensors.mapping import Cast as Cast
from ._src.safetensors.mapping import Reshape as Reshape
from ._src.safetensors.mapping import Stack as Stack
from ._src.safetensors.mapping import Transpose as Transpose
from ._src.safetensors.save import save as save
from .errors import SafetensorsError as SafetensorsError

__all__ = [
    "Cast",
    "Files",
    "Reshape",
    "SafetensorsError",
    "Stack",
    "TensorInfo",
    "Transpose",
    "load",
    "metadata",
    "save",
]
