"""Tensor-parallel cuts of one EXL3 linear layer: what a rank keeps, and how it runs when a cut misses a block.

An EXL3 weight is ``W = diag(suh) H What H diag(svh)`` with 128-wide Hadamard blocks on both sides, so a slice of
its rows (input features) or columns (output features) is again an EXL3 tensor exactly when the slice covers whole
128-feature blocks: the trellis is cut between 16x16 tiles and suh / svh are cut alongside. A rank's share that
falls inside a block cannot be cut out; then (seed 000, ``_cut_tp``):

* **column parallel** (the rank owns output features ``[o0, o1)``): the rank keeps the whole tensor and selects its
  columns of the full product;
* **row parallel** (the rank owns input features ``[i0, i1)`` and the ranks' outputs are summed): the rank keeps the
  whole matrix and zero-extends its input slice to the full width at ``[i0, i1)``, so its product is exactly its
  part of the sum.

vLLM splits evenly: rank ``r`` of ``tp`` owns features ``[r * n / tp, (r + 1) * n / tp)`` of a layer of ``n``
logical features (``n`` divisible by ``tp``). Plain torch; no vLLM import. Source: seed 000 (``tp_ranges``,
``_cut_tp``: block-aligned slices, whole-tensor fallbacks); docs/exl3-format.md (the tile and block layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .codec import Exl3Tensors, reference_linear
from .errors import GeometryError
from .hadamard import HAD_BLOCK
from .trellis import TILE

COLUMN = "column"
ROW = "row"


@dataclass(frozen=True)
class TpCut:
    """One rank's part of one EXL3 tensor.

    Attributes:
        kind: ``"column"`` (output features split) or ``"row"`` (input features split).
        start, stop: the rank's logical features ``[start, stop)`` along the split side.
        sliced: True when ``[start, stop)`` covers whole 128-feature blocks and the tensor itself is cut; False for
            the whole-tensor fallback.
    """

    kind: str
    start: int
    stop: int
    sliced: bool


def tp_range(features: int, tp_size: int, tp_rank: int, layer: str = "") -> tuple[int, int]:
    """vLLM's even split: the features ``[start, stop)`` rank ``tp_rank`` of ``tp_size`` owns.

    Raises:
        ValueError: a bad rank.
        GeometryError: ``features`` not divisible by ``tp_size`` (vLLM refuses such a split too; named here first).
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} of {tp_size}: need tp_size >= 1 and 0 <= tp_rank < tp_size")
    if features % tp_size:
        raise GeometryError(
            f"{layer or 'layer'}: {features} features cannot be split evenly over {tp_size} tensor-parallel ranks "
            "-> choose a tensor-parallel size that divides it"
        )
    share = features // tp_size
    return tp_rank * share, (tp_rank + 1) * share


def plan_cut(kind: str, features: int, tp_size: int, tp_rank: int, layer: str = "") -> TpCut:
    """How rank ``tp_rank`` holds its part of a layer split along ``kind``.

    Args:
        kind: ``"column"`` or ``"row"``.
        features: logical features along the split side.
        tp_size, tp_rank: the rank.
        layer: module name for messages.

    Returns:
        a :class:`TpCut`; ``sliced`` when both ends fall on 128-feature block boundaries (a rank whose end is the
        layer's last logical feature may end inside the last, padded block).

    Raises:
        ValueError: unknown ``kind`` or a bad rank. GeometryError: an uneven split (:func:`tp_range`).
    """
    if kind not in (COLUMN, ROW):
        raise ValueError(f"unknown split {kind!r}: expected {COLUMN!r} or {ROW!r}")
    start, stop = tp_range(features, tp_size, tp_rank, layer)
    aligned = start % HAD_BLOCK == 0 and (stop % HAD_BLOCK == 0 or stop == features)
    return TpCut(kind, start, stop, aligned)


def cut_tensors(t: Exl3Tensors, cut: TpCut) -> Exl3Tensors:
    """The rank's EXL3 tensors: a block-aligned slice, or the whole tensor for a fallback cut.

    Args:
        t: the layer's full tensors (as the pack stores them).
        cut: from :func:`plan_cut`.

    Returns:
        for a sliced column cut, trellis tiles ``[:, start/16 : ceil(stop/128)*8]`` with svh alongside; for a sliced
        row cut, trellis tiles ``[start/16 : ..., :]`` with suh alongside (stored ends rounded up to the block);
        otherwise ``t`` itself.

    Source: seed 000 (``_cut_tp``).
    """
    if not cut.sliced:
        return t
    a = cut.start
    b = -(-cut.stop // HAD_BLOCK) * HAD_BLOCK
    if cut.kind == COLUMN:
        return Exl3Tensors(t.trellis[:, a // TILE : b // TILE].contiguous(), t.suh, t.svh[a:b].contiguous(), t.codebook)
    return Exl3Tensors(t.trellis[a // TILE : b // TILE].contiguous(), t.suh[a:b].contiguous(), t.svh, t.codebook)


def rank_forward(x: torch.Tensor, kept: Exl3Tensors, cut: TpCut, full_in: int, dtype=torch.float64) -> torch.Tensor:
    """Reference forward of one rank's part (the oracle of the TP tests and the rule the kernels follow).

    Args:
        x: column cut: the full input ``(..., full_in)``; row cut: the rank's input slice ``(..., stop - start)``.
        kept: :func:`cut_tensors`' result. cut: the rank's cut. full_in: the layer's logical input features.
        dtype: compute dtype.

    Returns:
        column cut: the rank's output columns ``(..., stop - start)``; row cut: the rank's partial sum over all
        output columns (summing the ranks' results gives the layer's output).
    """
    width = cut.stop - cut.start
    if cut.kind == COLUMN:
        y = reference_linear(x, kept, dtype)
        return y[..., :width] if cut.sliced else y[..., cut.start : cut.stop]
    if cut.sliced:
        return reference_linear(x, kept, dtype)
    full = torch.zeros(*x.shape[:-1], full_in, dtype=x.dtype, device=x.device)
    full[..., cut.start : cut.stop] = x
    return reference_linear(full, kept, dtype)
