"""quantpack-core: the EXL3 format without vLLM.

The reference trellis codec (:mod:`.codebook`, :mod:`.trellis`, :mod:`.hadamard`, :mod:`.codec`), the pack reader
(:mod:`.pack`) and its check (:mod:`.check`), the naming rules between checkpoints and vLLM (:mod:`.names`) and a
writer of small packs (:mod:`.synthetic`). The names below are loaded on first use (PEP 562), so that importing the
package, or its ``quantpack`` command line, imports no torch until a command needs it; using one imports torch and
safetensors only.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: public name -> the submodule that defines it
_EXPORTS = {
    **dict.fromkeys(
        (
            "LEGAL_K", "Codebook", "Exl3Tensors", "codebook_table", "codebook_values", "decode_matrix",
            "decode_tiles", "dequantize", "had128", "hadamard_matrix", "k_from_width", "reference_linear",
            "unpack_signs", "width_from_k",
        ),
        ".codec",
    ),
    **dict.fromkeys(("CodecError", "GeometryError", "PackError", "Problem", "QuantpackError"), ".errors"),
    **dict.fromkeys(("ModuleInfo", "TensorInfo"), ".inventory"),
    "Pack": ".pack",
}  # fmt: skip

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
