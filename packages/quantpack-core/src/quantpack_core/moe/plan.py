"""The plan of one MoE layer's EXL3 expert bank on one tensor-parallel rank: K-sorted slots, K groups, offsets.

Every expert of an EXL3 MoE layer stores three self-contained EXL3 tensors: ``w1`` (gate_proj, hidden ->
intermediate), ``w3`` (up_proj, hidden -> intermediate) and ``w2`` (down_proj, intermediate -> hidden), each with its
own trellis, suh and svh, and, under a mixed-precision allocation, its own K. Experts are placed in physical slots
sorted by their K (``w1`` / ``w3`` first, then ``w2``; ties keep the logical order), so every group of experts sharing
K is a contiguous slot range that one grouped kernel launch can cover. The plan also fixes where each slot's
trellises sit in the bank's two flat trellis tensors (:mod:`.bank`), and which intermediate channels a
tensor-parallel rank keeps: ``[r * I_loc, (r + 1) * I_loc)`` of every expert, exact only when ``I_loc`` is a whole
number of 128-channel Hadamard blocks (any other cut is refused here; the vLLM method splits whole experts instead).

An ungated layer (Nemotron-H's relu² experts: ``down(relu(x W1)²)``, no ``up_proj``) plans the same way with ``w1``
alone on the gate / up side: ``w13_trellis`` holds one trellis per slot and the vectors' second axis has one entry.

Here ``H`` and ``I`` are the stored (128-padded) hidden and intermediate sizes. Follows docs/moe-bank.md and
exllamav3 (``exllamav3/modules/block_sparse_mlp.py``, ``exllamav3/modules/multilinear.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..codec.codebook import Codebook
from ..codec.hadamard import HAD_BLOCK
from ..codec.trellis import TILE, check_k_codebook, width_from_k
from ..errors import CodecError, GeometryError
from ..tp import check_rank, sliced_tp_sizes

#: vLLM's FusedMoE shard ids: w1 = gate_proj, w3 = up_proj, w2 = down_proj.
PROJ_GATE = "w1"
PROJ_UP = "w3"
PROJ_DOWN = "w2"
PROJECTIONS = (PROJ_GATE, PROJ_UP, PROJ_DOWN)
#: the projections of an ungated expert (``down(act(x W1))``): vLLM loads its one input projection as ``w1``
UNGATED_PROJECTIONS = (PROJ_GATE, PROJ_DOWN)
#: checkpoint module name of each projection (used in messages)
PROJ_MODULES = {PROJ_GATE: "gate_proj", PROJ_UP: "up_proj", PROJ_DOWN: "down_proj"}


def expert_projections(gated: bool) -> tuple[str, ...]:
    """The projections every expert of a layer stores: :data:`PROJECTIONS`, or :data:`UNGATED_PROJECTIONS`."""
    return PROJECTIONS if gated else UNGATED_PROJECTIONS


def proj_module(proj: str, gated: bool = True) -> str:
    """The checkpoint module of projection ``proj`` (messages): :data:`PROJ_MODULES`, except that an ungated
    expert's ``w1`` is its ``up_proj``."""
    return "up_proj" if proj == PROJ_GATE and not gated else PROJ_MODULES[proj]


#: the per-projection tensors the bank stores
PIECE_KINDS = ("trellis", "suh", "svh")
#: the bank's tensors, in the order :meth:`Exl3MoeBank.allocate` creates them
BANK_TENSORS = ("w13_trellis", "w2_trellis", "w13_suh", "w13_svh", "w2_suh", "w2_svh")


def trellis_shape(rows: int, cols: int, k: float) -> tuple[int, int, int]:
    """Shape of the trellis of a ``(rows, cols)`` EXL3 weight at bitrate K.

    Args:
        rows: input features (a multiple of 16).
        cols: output features (a multiple of 16).
        k: bits per weight.

    Returns:
        ``(rows/16, cols/16, words per tile)`` (int16 elements).

    Raises:
        CodecError: illegal K.

    Source: docs/exl3-format.md ("Tensors of one layer"); docs/moe-bank.md.
    """
    return rows // TILE, cols // TILE, width_from_k(k)


def tp_shard(intermediate: int, tp_size: int, tp_rank: int, layer: str = "") -> tuple[int, int]:
    """The intermediate channels one tensor-parallel rank keeps of every expert.

    Args:
        intermediate: stored intermediate size ``I`` of the experts (channels; a multiple of 128).
        tp_size: number of tensor-parallel ranks (>= 1).
        tp_rank: this rank, ``0 <= tp_rank < tp_size``.
        layer: module name used in the error message.

    Returns:
        ``(i0, i1)``: channels ``[i0, i1)`` with ``i1 - i0 = I / tp_size``, a multiple of 128.

    Raises:
        ValueError: ``tp_size < 1`` or ``tp_rank`` outside ``[0, tp_size)``.
        GeometryError: ``I / tp_size`` is not a whole number of 128-channel Hadamard blocks (the message names the
            layer, the dimension, the rule, and the tensor-parallel sizes that would work).

    Source: docs/moe-bank.md ("Tensor parallelism": exact because the cut is 128-aligned).
    """
    check_rank(tp_size, tp_rank)
    if intermediate % HAD_BLOCK or intermediate <= 0:
        raise GeometryError(
            f"{layer or 'MoE layer'}: the experts' stored intermediate size is {intermediate}, not a positive "
            f"multiple of {HAD_BLOCK}: an EXL3 tensor is stored padded to whole {HAD_BLOCK}-channel Hadamard blocks "
            "-> pass the stored (padded) size, the trellis's intermediate tiles times 16"
        )
    blocks = intermediate // HAD_BLOCK
    if blocks % tp_size:
        share = intermediate / tp_size
        ok = ", ".join(str(d) for d in sliced_tp_sizes([intermediate], limit=64))
        raise GeometryError(
            f"{layer or 'MoE layer'}: cannot cut the experts' intermediate dimension ({intermediate} channels = "
            f"{blocks} Hadamard blocks of {HAD_BLOCK}) over {tp_size} tensor-parallel ranks: each rank would keep "
            f"{share:g} channels. Rule: a rank's share must be whole {HAD_BLOCK}-channel blocks, because EXL3's "
            f"Hadamard transform mixes all {HAD_BLOCK} channels of a block (a cut inside one changes the weights; "
            f"the trellis itself could only be cut between {TILE}-row tiles anyway), and this bank has no fallback "
            f"-> use a tensor-parallel size dividing {blocks} ({ok}), or expert parallelism (whole experts per rank: "
            "plan with tp_size=1), or pipeline parallelism (splits layers, not channels)"
        )
    share = intermediate // tp_size
    return tp_rank * share, (tp_rank + 1) * share


@dataclass(frozen=True)
class ShardSlices:
    """Where one rank's part sits in a full exllamav3 tensor of one projection.

    Attributes:
        proj: ``"w1"``, ``"w3"`` or ``"w2"``.
        trellis_dim: dimension of the trellis that is cut: 1 (output tiles) for w1/w3, 0 (input tiles) for w2.
        trellis_range: ``(a, b)``, tiles ``[a, b)`` along ``trellis_dim`` (channels / 16).
        suh_range: ``(i0, i1)`` channels of suh to keep, or None (suh not cut: w1/w3's hidden side).
        svh_range: ``(i0, i1)`` channels of svh to keep, or None (svh not cut: w2's hidden side).

    Source: docs/moe-bank.md.
    """

    proj: str
    trellis_dim: int
    trellis_range: tuple[int, int]
    suh_range: tuple[int, int] | None
    svh_range: tuple[int, int] | None


def shard_slices(proj: str, intermediate: int, tp_size: int, tp_rank: int, layer: str = "") -> ShardSlices:
    """The slices of a full expert tensor that one tensor-parallel rank keeps.

    w1 / w3 are column parallel: the trellis ``(H/16, I/16, w)`` is cut along its output tiles (dim 1) and svh
    ``(I,)`` along its channels; suh ``(H,)`` is whole. w2 is row parallel: the trellis ``(I/16, H/16, w)`` is cut
    along its input tiles (dim 0) and suh ``(I,)``; svh ``(H,)`` is whole.

    Args:
        proj: ``"w1"``, ``"w3"`` or ``"w2"``.
        intermediate, tp_size, tp_rank, layer: as for :func:`tp_shard`.

    Returns:
        the :class:`ShardSlices`.

    Raises:
        ValueError: unknown ``proj``, or a bad rank.
        GeometryError: the cut falls off a 128-channel block (see :func:`tp_shard`).

    Source: docs/moe-bank.md.
    """
    if proj not in PROJECTIONS:
        raise ValueError(f"unknown projection {proj!r}: expected one of {PROJECTIONS}")
    i0, i1 = tp_shard(intermediate, tp_size, tp_rank, layer)
    tiles = (i0 // TILE, i1 // TILE)
    if proj == PROJ_DOWN:
        return ShardSlices(proj, 0, tiles, (i0, i1), None)
    return ShardSlices(proj, 1, tiles, None, (i0, i1))


@dataclass(frozen=True)
class ExpertBits:
    """Bitrates of one expert.

    Attributes:
        k_gu: K of w1 (gate) and w3 (up): one K for both, as they share one slot width in the w13 bank.
        k_d: K of w2 (down).

    Source: docs/moe-bank.md.
    """

    k_gu: float
    k_d: float


@dataclass(frozen=True)
class KGroup:
    """A run of physical slots whose experts share K.

    Attributes:
        k_gu: K of w1 / w3 of every expert in the group.
        k_d: K of w2 of every expert in the group.
        lo, hi: the group's slots ``[lo, hi)``.

    Source: docs/moe-bank.md.
    """

    k_gu: float
    k_d: float
    lo: int
    hi: int

    @property
    def size(self) -> int:
        """Number of experts (slots) in the group."""
        return self.hi - self.lo


@dataclass(frozen=True)
class MoePlan:
    """Where every expert of one MoE layer lives in the bank of one tensor-parallel rank. Build with
    :func:`plan_moe_layer`.

    Sizes are in elements: int16 words for the trellis banks, channels for the vectors.

    Attributes:
        layer: module name of the layer (``model.layers.3.mlp.experts``), used in every message.
        hidden: stored hidden size ``H`` (multiple of 128).
        intermediate: stored intermediate size ``I`` of the full experts (multiple of 128).
        tp_size, tp_rank: the tensor-parallel rank this plan is for.
        codebook: the one codebook of every expert tensor in the layer.
        bits: per logical expert, its :class:`ExpertBits`.
        perm: logical expert -> physical slot.
        inv_perm: physical slot -> logical expert.
        groups: the K groups, in slot order; they cover ``[0, E)``.
        inter_start: first intermediate channel this rank keeps (``i0``).
        inter_local: intermediate channels this rank keeps (``I_loc = I / tp_size``).
        words_w13: per slot, int16 words of ONE of its w1 / w3 trellises (``H/16 * I_loc/16 * width(k_gu)``).
        words_w2: per slot, int16 words of its w2 trellis (``I_loc/16 * H/16 * width(k_d)``).
        off_w1, off_w3: per slot, offset of its w1 / w3 trellis in ``w13_trellis`` (``off_w3 = off_w1 + words_w13``;
            an ungated plan has no w3: ``off_w3 = off_w1``, never read).
        off_w2: per slot, offset of its w2 trellis in ``w2_trellis``.
        total_w13, total_w2: lengths of the two trellis banks.
        gated: the experts are ``down(act(x W1) * (x W3))`` (True) or ungated ``down(act(x W1))`` (False: no w3).

    Source: docs/moe-bank.md (the plan: slots, groups, offsets in one object).
    """

    layer: str
    hidden: int
    intermediate: int
    tp_size: int
    tp_rank: int
    codebook: Codebook
    bits: tuple[ExpertBits, ...]
    perm: tuple[int, ...]
    inv_perm: tuple[int, ...]
    groups: tuple[KGroup, ...]
    inter_start: int
    inter_local: int
    words_w13: tuple[int, ...]
    words_w2: tuple[int, ...]
    off_w1: tuple[int, ...]
    off_w3: tuple[int, ...]
    off_w2: tuple[int, ...]
    total_w13: int
    total_w2: int
    gated: bool = True

    @property
    def num_experts(self) -> int:
        """Number of experts ``E`` (logical experts = physical slots)."""
        return len(self.bits)

    @property
    def projections(self) -> tuple[str, ...]:
        """The projections every expert stores: ``("w1", "w3", "w2")``, or ``("w1", "w2")`` when ungated."""
        return expert_projections(self.gated)

    def k_of(self, expert: int, proj: str) -> float:
        """K (bits per weight) of projection ``proj`` (``"w1"``, ``"w3"``, ``"w2"``) of logical expert ``expert``."""
        b = self.bits[expert]
        return b.k_d if proj == PROJ_DOWN else b.k_gu

    def slices(self, proj: str) -> ShardSlices:
        """This rank's :class:`ShardSlices` of a full tensor of projection ``proj``.

        Raises:
            ValueError: unknown ``proj``.
        """
        return shard_slices(proj, self.intermediate, self.tp_size, self.tp_rank, self.layer)

    def full_shape(self, expert: int, proj: str, kind: str) -> tuple[int, ...]:
        """Shape of a full exllamav3 tensor (as the pack stores it) of a logical expert.

        Args:
            expert: logical expert id.
            proj: ``"w1"``, ``"w3"`` or ``"w2"``.
            kind: ``"trellis"`` (int16), ``"suh"`` or ``"svh"`` (float16).

        Returns:
            w1 / w3: trellis ``(H/16, I/16, width)``, suh ``(H,)``, svh ``(I,)``; w2: trellis ``(I/16, H/16, width)``,
            suh ``(I,)``, svh ``(H,)``.

        Raises:
            ValueError: unknown ``kind``.
        """
        return self._shape(expert, proj, kind, self.intermediate)

    def local_shape(self, expert: int, proj: str, kind: str) -> tuple[int, ...]:
        """Shape of this rank's part of a tensor (:meth:`full_shape` with ``I`` replaced by ``I_loc``)."""
        return self._shape(expert, proj, kind, self.inter_local)

    def _shape(self, expert: int, proj: str, kind: str, inter: int) -> tuple[int, ...]:
        rows, cols = (inter, self.hidden) if proj == PROJ_DOWN else (self.hidden, inter)
        if kind == "trellis":
            return trellis_shape(rows, cols, self.k_of(expert, proj))
        if kind == "suh":
            return (rows,)
        if kind == "svh":
            return (cols,)
        raise ValueError(f"unknown tensor kind {kind!r}: expected one of {PIECE_KINDS}")

    def bank_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{bank tensor name: (shape, dtype)}`` of the six bank tensors (see the module docstring)."""
        e, h, i = self.num_experts, self.hidden, self.inter_local
        f16 = torch.float16
        parts = 2 if self.gated else 1
        return {
            "w13_trellis": ((self.total_w13,), torch.int16),
            "w2_trellis": ((self.total_w2,), torch.int16),
            "w13_suh": ((e, parts, h), f16),
            "w13_svh": ((e, parts, i), f16),
            "w2_suh": ((e, i), f16),
            "w2_svh": ((e, h), f16),
        }


def plan_moe_layer(
    layer: str,
    k_bits: Sequence[tuple[float, ...]],
    hidden: int,
    intermediate: int,
    *,
    codebook: Codebook | str,
    tp_size: int = 1,
    tp_rank: int = 0,
    gated: bool = True,
) -> MoePlan:
    """Plan one MoE layer's expert bank on one tensor-parallel rank.

    Args:
        layer: module name of the layer, e.g. ``model.layers.3.mlp.experts`` (used in messages).
        k_bits: per logical expert ``e`` (0..E-1), the K of its ``(w1, w3, w2)`` tensors (w1 and w3 must agree), or
            of its ``(w1, w2)`` when ``gated`` is False.
        hidden: stored hidden size ``H`` (a multiple of 128: suh of w1, svh of w2).
        intermediate: stored intermediate size ``I`` of the full experts (a multiple of 128).
        codebook: the codebook every expert tensor of the layer uses (``"3inst"``, ``"mcg"``, ``"mul1"``).
        tp_size, tp_rank: the tensor-parallel rank to plan for.
        gated: False for ungated experts (``down(act(x W1))``, no w3).

    Returns:
        the :class:`MoePlan`: slots sorted by ``(k_gu, k_d)`` ascending (ties in logical order), K groups, offsets.

    Raises:
        ValueError: no experts, a malformed ``k_bits`` entry, or a bad rank.
        TypeError: ``gated`` not a bool.
        CodecError: an illegal K, or a half-integer K with a codebook other than mul1 (names layer and expert).
        GeometryError: ``H`` or ``I`` not a multiple of 128, an expert whose w1 and w3 K differ, or a TP cut off a
            128-channel block (see :func:`tp_shard`; each names the layer, the rule and the ways out).

    Source: docs/moe-bank.md.
    """
    cb = Codebook.parse(codebook)
    where = layer or "MoE layer"
    if not isinstance(gated, bool):
        raise TypeError(f"{where}: gated must be True or False, got {gated!r}")
    if not k_bits:
        raise ValueError(f"{where}: no experts to plan")
    if hidden % HAD_BLOCK or hidden <= 0:
        raise GeometryError(
            f"{where}: stored hidden size {hidden} is not a positive multiple of {HAD_BLOCK}: EXL3 tensors are "
            f"stored padded to whole {HAD_BLOCK}-channel Hadamard blocks -> pass the stored (padded) size"
        )
    i0, i1 = tp_shard(intermediate, tp_size, tp_rank, layer)
    bits = [expert_bits(where, e, ks, cb, gated) for e, ks in enumerate(k_bits)]
    perm, order = slot_permutation(bits)
    groups = plan_groups([bits[e] for e in order])
    words13, words2, off1, off3, off2 = bank_layout(
        [(bits[e].k_gu, bits[e].k_d) for e in order], hidden, i1 - i0, gated=gated
    )
    return MoePlan(
        layer=layer,
        hidden=hidden,
        intermediate=intermediate,
        tp_size=tp_size,
        tp_rank=tp_rank,
        codebook=cb,
        bits=tuple(bits),
        perm=perm,
        inv_perm=order,
        groups=groups,
        inter_start=i0,
        inter_local=i1 - i0,
        words_w13=words13,
        words_w2=words2,
        off_w1=off1,
        off_w3=off3,
        off_w2=off2,
        total_w13=(2 if gated else 1) * sum(words13),
        total_w2=sum(words2),
        gated=gated,
    )


def expert_bits(where: str, e: int, ks: Sequence[float], cb: Codebook, gated: bool) -> ExpertBits:
    """The :class:`ExpertBits` of logical expert ``e`` from its ``k_bits`` entry ``ks``, checked.

    Raises:
        ValueError: ``ks`` is not ``(w1, w3, w2)`` (``(w1, w2)`` when ungated).
        CodecError: an illegal K, or a half-integer K with a codebook other than mul1 (names layer and expert).
        GeometryError: the expert's w1 and w3 K differ.
    """
    if len(ks) != (3 if gated else 2):
        want = "(K of w1, K of w3, K of w2)" if gated else "(K of w1, K of w2) of an ungated expert"
        raise ValueError(f"{where}: expert {e}: k_bits entry {ks!r} is not {want}")
    k1, k3, k2 = (float(k) for k in ks) if gated else (float(ks[0]), float(ks[0]), float(ks[1]))
    for proj, k in ((PROJ_GATE, k1), (PROJ_UP, k3), (PROJ_DOWN, k2)):
        try:
            width_from_k(k)
            check_k_codebook(k, cb)
        except CodecError as err:
            raise CodecError(f"{where}: expert {e} {proj} ({PROJ_MODULES[proj]}): {err}") from None
    if k1 != k3:
        raise GeometryError(
            f"{where}: expert {e}: w1 (gate_proj) has K={k1:g} but w3 (up_proj) has K={k3:g}. Rule: the bank "
            "stores w1 and w3 of a slot side by side at one width and the grouped kernels run both with one K "
            "-> re-quantize the layer with one bitrate for each expert's gate_proj and up_proj"
        )
    return ExpertBits(k1, k2)


def slot_permutation(bits: Sequence[ExpertBits]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(perm, inv_perm)``: logical expert -> physical slot and back, slots sorted by ``(k_gu, k_d)`` ascending
    (ties in logical order)."""
    order = tuple(sorted(range(len(bits)), key=lambda e: (bits[e].k_gu, bits[e].k_d, e)))
    perm = [0] * len(order)
    for slot, e in enumerate(order):
        perm[e] = slot
    return tuple(perm), order


def plan_groups(slot_bits: Sequence[ExpertBits]) -> tuple[KGroup, ...]:
    """The runs of slots sharing ``(k_gu, k_d)``, in slot order (``slot_bits``: the bits of each physical slot)."""
    groups: list[KGroup] = []
    for slot, b in enumerate(slot_bits):
        if groups and (groups[-1].k_gu, groups[-1].k_d) == (b.k_gu, b.k_d):
            g = groups[-1]
            groups[-1] = KGroup(g.k_gu, g.k_d, g.lo, slot + 1)
        else:
            groups.append(KGroup(b.k_gu, b.k_d, slot, slot + 1))
    return tuple(groups)


def bank_layout(
    slot_bits: Sequence[tuple[float, float]], hidden: int, inter_local: int, *, gated: bool = True
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Where each slot's trellises sit in the two flat trellis banks.

    Args:
        slot_bits: ``(K of w1 / w3, K of w2)`` per physical slot, in slot order.
        hidden: stored hidden size ``H``; inter_local: this rank's intermediate channels ``I_loc``.
        gated: False when the slots hold no w3 (``off_w3`` then equals ``off_w1`` and is never read).

    Returns:
        ``(words_w13, words_w2, off_w1, off_w3, off_w2)``, one entry per slot: the int16 words of one w1 / w3
        trellis and of the w2 trellis, and their offsets (``[w1 | w3]`` back to back in ``w13_trellis``).

    Raises:
        CodecError: an illegal K.

    Source: docs/moe-bank.md.
    """
    tiles = (hidden // TILE) * (inter_local // TILE)
    words13 = tuple(tiles * width_from_k(k_gu) for k_gu, _ in slot_bits)
    words2 = tuple(tiles * width_from_k(k_d) for _, k_d in slot_bits)
    off1, off3, off2 = [], [], []
    a13 = a2 = 0
    for n13, n2 in zip(words13, words2, strict=True):
        off1.append(a13)
        off3.append(a13 + n13 if gated else a13)
        a13 += 2 * n13 if gated else n13
        off2.append(a2)
        a2 += n2
    return words13, words2, tuple(off1), tuple(off3), tuple(off2)
