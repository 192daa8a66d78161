"""Reference EXL3 codec: one quantized linear layer's tensors -> its dense weight, and the reference forward.

``W = diag(suh) . H . What . H . diag(svh)`` with ``What`` the decoded trellis and ``H`` the 128-block Hadamard
transform; equivalently ``y = had128(had128(x * suh) @ What) * svh``. Follows docs/exl3-format.md ("The math") and
exllamav3's ``LinearEXL3`` (``exllamav3/modules/quant/exl3.py``: ``get_weight_tensor``, ``forward``,
``unpack_bf`` for the legacy packed sign vectors).

Everything here is plain torch and runs on any device; it is the oracle every kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import CodecError
from .codebook import Codebook, codebook_table
from .hadamard import HAD_BLOCK, had128
from .trellis import TILE, check_k_codebook, check_trellis, decode_matrix, decode_rows

if TYPE_CHECKING:  # tp imports the Hadamard block from this package
    from ..tp import TpCut


#: the format's name: the ``quant_method`` exllamav3 writes into config.json, and how the pack reader names a module
#: stored as these tensors
FORMAT = "exl3"


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """Unpack a legacy ``su`` / ``sv`` sign bitfield (pre-release packs) to a +-1 vector.

    Args:
        packed: int16 tensor ``(m/16,)``; bit j of word i (least significant first) is element ``16*i + j``,
            set meaning -1.

    Returns:
        float16 tensor ``(m,)`` of +-1.

    Raises:
        CodecError: wrong dtype or rank.
    """
    if packed.dtype != torch.int16 or packed.dim() != 1:
        raise CodecError(f"packed sign vector must be 1-D int16, got {packed.dtype} {tuple(packed.shape)}")
    words = packed.to(torch.int64) & 0xFFFF
    bits = (words[:, None] >> torch.arange(16, device=packed.device)) & 1
    return (1 - 2 * bits).flatten().to(torch.float16)


@dataclass(frozen=True)
class Exl3Tensors:
    """The tensors of one EXL3-quantized linear layer, as stored in a pack.

    Attributes:
        trellis: int16 ``(k/16, n/16, 16*K)``; k, n are the padded in/out features (multiples of 128).
        suh: float16 ``(k,)``, input-side sign*scale.
        svh: float16 ``(n,)``, output-side sign*scale.
        codebook: which codebook (from the ``.mcg`` / ``.mul1`` marker; none = 3INST).
        bias: optional ``(n,)`` (or shorter, logical length) bias.
    """

    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    codebook: Codebook = Codebook.INST3
    bias: torch.Tensor | None = None

    def __post_init__(self):
        object.__setattr__(self, "codebook", Codebook.parse(self.codebook))
        k = check_trellis(self.trellis)
        check_k_codebook(k, self.codebook)
        kp, np_ = self.padded_shape
        if tuple(self.suh.shape) != (kp,):
            raise CodecError(
                f"suh has shape {tuple(self.suh.shape)}, the trellis {tuple(self.trellis.shape)} needs ({kp},)"
            )
        if tuple(self.svh.shape) != (np_,):
            raise CodecError(
                f"svh has shape {tuple(self.svh.shape)}, the trellis {tuple(self.trellis.shape)} needs ({np_},)"
            )
        for name, v in (("suh", self.suh), ("svh", self.svh)):
            if not v.is_floating_point():
                raise CodecError(f"{name} has dtype {v.dtype}, expected float16")
            if not bool(torch.isfinite(v).all()):
                raise CodecError(f"{name} holds {int((~torch.isfinite(v)).sum())} NaN or infinite values")

    @property
    def k_bits(self) -> float:
        """Bits per weight K."""
        return check_trellis(self.trellis)

    @property
    def padded_shape(self) -> tuple[int, int]:
        """(k, n): stored input and output features."""
        return self.trellis.shape[0] * TILE, self.trellis.shape[1] * TILE

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> Exl3Tensors:
        """Build from a ``{suffix: tensor}`` dict as read from a pack (``trellis``, ``suh``/``su``, ``svh``/``sv``,
        optional ``mcg`` / ``mul1`` markers and ``bias``).

        Raises:
            CodecError: a missing tensor, both markers, or a marker whose value is not its codebook's multiplier.
        """
        for need, legacy in (("trellis", None), ("suh", "su"), ("svh", "sv")):
            if need not in tensors and (legacy is None or legacy not in tensors):
                raise CodecError(f"missing .{need}" + (f" (or legacy .{legacy})" if legacy else ""))
        codebook = Codebook.from_markers("mcg" in tensors, "mul1" in tensors)
        if codebook.marker is not None:
            check_marker(tensors[codebook.marker], codebook)
        suh = tensors["suh"] if "suh" in tensors else unpack_signs(tensors["su"])
        svh = tensors["svh"] if "svh" in tensors else unpack_signs(tensors["sv"])
        return cls(tensors["trellis"], suh, svh, codebook, tensors.get("bias"))


def check_marker(marker: torch.Tensor, codebook: Codebook) -> None:
    """A marker tensor holds its codebook's multiplier as a 0-d int32; another value is a codebook this code does
    not know.

    Raises:
        CodecError: wrong shape, dtype or value.
    """
    if marker.dim() != 0 or marker.dtype != torch.int32:
        raise CodecError(
            f".{codebook.marker} marker must be a 0-d int32 tensor, got {marker.dtype} {tuple(marker.shape)}"
        )
    value = int(marker.item()) & 0xFFFFFFFF
    if value != codebook.multiplier:
        raise CodecError(
            f".{codebook.marker} marker holds 0x{value:08X}, the {codebook.value} codebook's multiplier "
            f"is 0x{codebook.multiplier:08X}: this pack uses a codebook variant this version cannot "
            "decode"
        )


#: columns of the blocks :func:`dequantize` works in: a 128 x 2048 float32 block is 1 MiB, so it and its scratch
#: stay in the CPU's caches and are reused from block to block, where whole-layer intermediates (for 2048 x 8192 two
#: float16 and three float32 arrays of 32-64 MiB) were fresh pages every time (17.9 M page faults and 75 s of system
#: time in the load of benchmarks/cpu_load.py's pack). 2048 x 8192 at K=4 on 2 idle cores: 0.45 s -> 0.15 s;
#: 4096 or 8192 columns measured the same within noise
DEQUANT_BLOCK_COLUMNS = 2048


def dequantize(t: Exl3Tensors, dtype: torch.dtype = torch.float32, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dense weight of one EXL3 layer, computed in blocks of 128 rows (one Hadamard block) by
    :data:`DEQUANT_BLOCK_COLUMNS` columns.

    Each block follows the whole-matrix formula step by step (decoded values in ``dtype``, the Hadamard transform
    over rows, then over columns, then ``suh``, then ``svh``); in float32 the result is the same bits as transforming
    the whole matrix at once (checked on every shape of the tests and of the benchmarks), in float64 the BLAS may
    order a Hadamard sum differently for a block than for the whole matrix (a last-bit difference).

    Args:
        t: the layer's tensors.
        dtype: compute dtype (float32 or float64; float16 for a kernel-like rounding).
        out: optional destination of shape ``(rows, cols)`` with ``rows <= k`` and ``cols <= n``, any dtype and
            strides (e.g. the transpose of an ``(out_features, in_features)`` buffer); it receives ``W[:rows, :cols]``
            converted to its dtype (a trimmed padded layer, a model-dtype weight), and no full-size ``dtype`` copy of
            the weight is ever made.

    Returns:
        ``out``, or ``W`` of shape ``(k, n)`` in ``dtype`` (input features x output features, padded), so that
        ``y = x @ W``; the ``nn.Linear`` weight is ``W.T``.

    Raises:
        CodecError: an ``out`` larger than the stored matrix.
    """
    kp, np_ = t.padded_shape
    device = t.trellis.device
    if out is None:
        out = torch.empty((kp, np_), dtype=dtype, device=device)
    rows, cols = out.shape
    if rows > kp or cols > np_:
        raise CodecError(f"out has shape {tuple(out.shape)}, larger than the stored {kp}x{np_} matrix")
    k = t.k_bits
    table = codebook_table(t.codebook, device).to(dtype)
    suh, svh = t.suh.to(dtype), t.svh.to(dtype)
    band = HAD_BLOCK // TILE
    for r0 in range(0, rows, HAD_BLOCK):
        rb = min(HAD_BLOCK, rows - r0)
        for c0 in range(0, cols, DEQUANT_BLOCK_COLUMNS):
            cb = min(DEQUANT_BLOCK_COLUMNS, cols - c0)
            c1 = c0 + -(-cb // HAD_BLOCK) * HAD_BLOCK  # whole Hadamard blocks
            trellis = t.trellis[r0 // TILE : r0 // TILE + band, c0 // TILE : c1 // TILE]
            w = had128(had128(decode_rows(trellis, table, k), 0), 1)
            w.mul_(suh[r0 : r0 + HAD_BLOCK, None]).mul_(svh[None, c0:c1])
            out[r0 : r0 + rb, c0 : c0 + cb].copy_(w[:rb, :cb])
    return out


def reference_linear(
    x: torch.Tensor, t: Exl3Tensors, dtype: torch.dtype = torch.float32, out_features: int | None = None
) -> torch.Tensor:
    """Reference forward of one EXL3 layer, transforming the activations: ``had(had(x * suh) @ What) * svh + bias``.

    Args:
        x: ``(..., in)`` with ``in <= k``; a narrower input (a padded layer) is zero-extended to k.
        t: the layer's tensors.
        dtype: compute dtype (float32 or float64).
        out_features: trim the output to this many columns (a padded layer); default all n.

    Returns:
        ``(..., out_features or n)`` tensor of ``dtype``.

    Raises:
        CodecError: when ``x`` is wider than the stored input features.
    """
    k = t.padded_shape[0]
    if x.shape[-1] > k:
        raise CodecError(f"input has {x.shape[-1]} features, the layer stores {k}")
    xf = x.to(dtype)
    if x.shape[-1] < k:
        xf = torch.nn.functional.pad(xf, (0, k - x.shape[-1]))
    what = decode_matrix(t.trellis, t.codebook).to(dtype)
    y = had128(had128(xf * t.suh.to(dtype)) @ what) * t.svh.to(dtype)
    if t.bias is not None:
        y[..., : t.bias.shape[0]] += t.bias.to(dtype)
    return y if out_features is None else y[..., :out_features]


# ------------------------------------------------------------------------------------ tensor-parallel cut


def cut_tensors(t: Exl3Tensors, cut: TpCut) -> Exl3Tensors:
    """The rank's EXL3 tensors: the whole blocks of its :attr:`TpCut.spans` (for a sliced cut, exactly its share).

    Args:
        t: the tensor's full EXL3 tensors (as the pack stores them).
        cut: from :func:`plan_cut` or :func:`make_cut`.

    Returns:
        column cut: the trellis tile columns of every span concatenated, with svh alongside; row cut: the trellis
        tile rows of the span with suh alongside; ``t`` itself when the spans are the whole stored width.

    Source: docs/architecture.md ("Tensor parallelism").
    """
    spans = cut.spans
    stored = t.svh.shape[0] if cut.column else t.suh.shape[0]
    if spans == ((0, stored),):
        return t
    if cut.column:
        trellis = torch.cat([t.trellis[:, a // TILE : b // TILE] for a, b in spans], 1).contiguous()
        svh = torch.cat([t.svh[a:b] for a, b in spans]).contiguous()
        return Exl3Tensors(trellis, t.suh, svh, t.codebook)
    (a, b) = spans[0]
    return Exl3Tensors(t.trellis[a // TILE : b // TILE].contiguous(), t.suh[a:b].contiguous(), t.svh, t.codebook)


def rank_forward(x: torch.Tensor, kept: Exl3Tensors, cut: TpCut, dtype=torch.float64) -> torch.Tensor:
    """Reference forward of one rank's part (the oracle of the TP tests and the rule the kernels follow).

    Args:
        x: column cut: the full input ``(..., in)``; row cut: the rank's input slice ``(..., stop - start)``.
        kept: :func:`cut_tensors`' result. cut: the rank's cut.
        dtype: compute dtype.

    Returns:
        column cut: the rank's output columns ``(..., cut.width)``, selected from the spans' product
        (:meth:`TpCut.kept_positions`) for a fallback; row cut: the rank's partial sum over all output columns, its
        input zero-extended to the span (:meth:`TpCut.row_pad`) for a fallback (summing the ranks' results gives the
        layer's output).
    """
    if cut.column:
        y = reference_linear(x, kept, dtype, out_features=cut.kept_features)
        return y if cut.sliced else y[..., cut.kept_positions()]
    return reference_linear(torch.nn.functional.pad(x, cut.row_pad()), kept, dtype)
