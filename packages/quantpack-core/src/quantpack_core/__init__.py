"""quantpack-core: the EXL3 format without vLLM.

The reference trellis codec (:mod:`.codebook`, :mod:`.trellis`, :mod:`.hadamard`, :mod:`.codec`), the pack reader and
validator (:mod:`.pack`), the naming rules between checkpoints and vLLM (:mod:`.names`) and a writer of small packs
(:mod:`.synthetic`). Importing it imports torch and safetensors only.
"""

from .codec import (
    LEGAL_K,
    Codebook,
    Exl3Tensors,
    codebook_table,
    codebook_values,
    decode_matrix,
    decode_tiles,
    dequantize,
    had128,
    hadamard_matrix,
    k_from_width,
    reference_linear,
    unpack_signs,
    width_from_k,
)
from .errors import CodecError, GeometryError, PackError, Problem, QuantpackError
from .pack import ModuleInfo, Pack, TensorInfo

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
