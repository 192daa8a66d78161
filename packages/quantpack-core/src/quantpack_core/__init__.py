"""quantpack-core: the EXL3 format without vLLM.

The reference trellis codec (:mod:`.codebook`, :mod:`.trellis`, :mod:`.hadamard`, :mod:`.codec`), the pack reader and
validator (:mod:`.pack`), the naming rules between checkpoints and vLLM (:mod:`.names`) and a writer of small packs
(:mod:`.synthetic`). Importing it imports torch and safetensors only.
"""

from .codebook import Codebook, codebook_table, codebook_values
from .codec import Exl3Tensors, dequantize, reference_linear, unpack_signs
from .errors import CodecError, GeometryError, PackError, Problem, QuantpackError
from .hadamard import had128, hadamard_matrix
from .pack import ModuleInfo, Pack, TensorInfo
from .trellis import LEGAL_K, decode_matrix, decode_tiles, k_from_width, width_from_k

__version__ = "0.1.0"

__all__ = [
    "LEGAL_K",
    "Codebook",
    "CodecError",
    "Exl3Tensors",
    "GeometryError",
    "ModuleInfo",
    "Pack",
    "PackError",
    "Problem",
    "QuantpackError",
    "TensorInfo",
    "codebook_table",
    "codebook_values",
    "decode_matrix",
    "decode_tiles",
    "dequantize",
    "had128",
    "hadamard_matrix",
    "k_from_width",
    "reference_linear",
    "unpack_signs",
    "width_from_k",
]
