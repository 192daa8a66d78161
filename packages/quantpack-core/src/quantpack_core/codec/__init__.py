"""The trellis codec of the EXL3 family: codebooks, trellis tiles, the 128-block Hadamard transform, and EXL3's
tensors of one linear layer (decode, reference forward, tensor-parallel cut).

Kept apart from the format-free parts of quantpack-core (names, tensor-parallel ranges, the kernel contract, the
pack reader) so that a second trellis format (escha: EXL3 trellis codes with its own scales) reuses
:mod:`.codebook`, :mod:`.trellis` and :mod:`.hadamard` rather than forking them; :mod:`.exl3` is EXL3's own layer
(``suh`` / ``svh`` around the decoded trellis). Plain torch on any device; the oracle every kernel is tested against.
See docs/exl3-format.md.
"""

from .codebook import Codebook, codebook_table, codebook_values
from .exl3 import Exl3Tensors, check_marker, cut_tensors, dequantize, rank_forward, reference_linear, unpack_signs
from .hadamard import HAD_BLOCK, had128, hadamard_matrix
from .trellis import LEGAL_K, TILE, decode_matrix, decode_tiles, k_from_width, width_from_k

__all__ = [
    "HAD_BLOCK",
    "LEGAL_K",
    "TILE",
    "Codebook",
    "Exl3Tensors",
    "check_marker",
    "codebook_table",
    "codebook_values",
    "cut_tensors",
    "decode_matrix",
    "decode_tiles",
    "dequantize",
    "had128",
    "hadamard_matrix",
    "k_from_width",
    "rank_forward",
    "reference_linear",
    "unpack_signs",
    "width_from_k",
]
