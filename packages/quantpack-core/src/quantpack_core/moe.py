"""One layer's EXL3 MoE expert bank on one tensor-parallel rank: the plan, the bank and a reference forward.

Every expert of an EXL3 MoE layer stores three self-contained EXL3 tensors: ``w1`` (gate_proj, hidden ->
intermediate), ``w3`` (up_proj, hidden -> intermediate) and ``w2`` (down_proj, intermediate -> hidden), each with its
own trellis, suh and svh, and, under a mixed-precision allocation, its own K. The bank keeps all experts of a layer in
a few flat tensors so that grouped kernels can reach any expert through per-expert pointer tables:

- **Slots.** Experts are placed in physical slots sorted by their K (``w1``/``w3`` first, then ``w2``; ties keep the
  logical order), so every group of experts sharing K is a contiguous slot range that one kernel launch can cover.
  ``MoePlan.perm`` maps logical expert -> slot, ``MoePlan.inv_perm`` slot -> logical expert.
- **Trellis banks.** Two flat int16 tensors: ``w13_trellis`` holds, slot after slot, ``[w1 | w3]`` (both of the
  slot's ``K_gu``), ``w2_trellis`` holds each slot's ``w2``. Each tensor is a whole number of 16x16 tiles of
  ``16*K`` (or ``16*KA + 8``) words, so every offset is a multiple of 16 bytes.
- **Vectors.** float16, indexed by slot: ``w13_suh (E, 2, H)`` and ``w2_svh (E, H)`` span the hidden side (never cut),
  ``w13_svh (E, 2, I_loc)`` and ``w2_suh (E, I_loc)`` the rank's intermediate channels.
- **Tensor parallelism.** Rank r keeps intermediate channels ``[r * I_loc, (r + 1) * I_loc)`` of every expert, cut
  from the full exllamav3 tensors as they load: the columns of ``w1``/``w3`` (column parallel) and the rows of ``w2``
  (row parallel; the ranks' outputs are summed). The cut is exact only when ``I_loc`` is a whole number of 128-channel
  Hadamard blocks, so any other cut is refused (:class:`GeometryError`); there is no fallback.

Here ``H`` and ``I`` are the stored (128-padded) hidden and intermediate sizes. Follows seed 001 (the bank on one TP
rank: K-sorted slots, flat w13 / w2 banks, per-expert vectors, the 128-aligned TP cut, pointer tables per K group) and
exllamav3 (``exllamav3/modules/block_sparse_mlp.py``: the per-expert gate / up / down and the routed, weighted sum;
``exllamav3/modules/multilinear.py``: int64 tables of trellis / suh / svh ``data_ptr()`` for experts that share one K
and one codebook). Plain torch on any device; no vLLM and no exllamav3 import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from .codebook import Codebook
from .codec import Exl3Tensors, check_marker, dequantize
from .errors import CodecError, GeometryError
from .hadamard import HAD_BLOCK
from .tp import check_rank, sliced_tp_sizes
from .trellis import TILE, check_k_codebook, k_from_width, width_from_k

#: vLLM's FusedMoE shard ids: w1 = gate_proj, w3 = up_proj, w2 = down_proj.
PROJ_GATE = "w1"
PROJ_UP = "w3"
PROJ_DOWN = "w2"
PROJECTIONS = (PROJ_GATE, PROJ_UP, PROJ_DOWN)
#: checkpoint module name of each projection (used in messages)
PROJ_MODULES = {PROJ_GATE: "gate_proj", PROJ_UP: "up_proj", PROJ_DOWN: "down_proj"}
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

    Source: docs/exl3-format.md ("Tensors of one layer"); seed 001 (``trellis_shape``).
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

    Source: seed 001 (``tp_shard``: each rank keeps ``[rank * I_loc, (rank + 1) * I_loc)``; "exact because the cut is
    128-aligned").
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

    Source: seed 001 (``shard_slices``: ``trellis_dim``, ``trellis_range``, ``suh_range``, ``svh_range``).
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

    Source: seed 001 (``shard_slices`` and its use in ``Exl3Bank.load_piece``).
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

    Source: seed 001 (``LayerPlan.bits``: ``k_gu``, ``k_d``).
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

    Source: seed 001 (``LayerPlan.groups``: ``k_gu``, ``k_d``, ``lo``, ``hi``).
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
        off_w1, off_w3: per slot, offset of its w1 / w3 trellis in ``w13_trellis`` (``off_w3 = off_w1 + words_w13``).
        off_w2: per slot, offset of its w2 trellis in ``w2_trellis``.
        total_w13, total_w2: lengths of the two trellis banks.

    Source: seed 001 (``LayerPlan`` and ``BankLayout``: ``perm``, ``inv_perm``, ``bits``, ``groups``, ``off_w1``,
    ``off_w3``, ``off_w2``, ``words_w1``, ``words_w2``, ``total13``, ``total2``), merged into one object here.
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

    @property
    def num_experts(self) -> int:
        """Number of experts ``E`` (logical experts = physical slots)."""
        return len(self.bits)

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
        return {
            "w13_trellis": ((self.total_w13,), torch.int16),
            "w2_trellis": ((self.total_w2,), torch.int16),
            "w13_suh": ((e, 2, h), f16),
            "w13_svh": ((e, 2, i), f16),
            "w2_suh": ((e, i), f16),
            "w2_svh": ((e, h), f16),
        }


def plan_moe_layer(
    layer: str,
    k_bits: Sequence[tuple[float, float, float]],
    hidden: int,
    intermediate: int,
    *,
    codebook: Codebook | str,
    tp_size: int = 1,
    tp_rank: int = 0,
) -> MoePlan:
    """Plan one MoE layer's expert bank on one tensor-parallel rank.

    Args:
        layer: module name of the layer, e.g. ``model.layers.3.mlp.experts`` (used in messages).
        k_bits: per logical expert ``e`` (0..E-1), the K of its ``(w1, w3, w2)`` tensors; w1 and w3 must agree.
        hidden: stored hidden size ``H`` (a multiple of 128: suh of w1, svh of w2).
        intermediate: stored intermediate size ``I`` of the full experts (a multiple of 128).
        codebook: the codebook every expert tensor of the layer uses (``"3inst"``, ``"mcg"``, ``"mul1"``).
        tp_size, tp_rank: the tensor-parallel rank to plan for.

    Returns:
        the :class:`MoePlan`: slots sorted by ``(k_gu, k_d)`` ascending (ties in logical order), K groups, offsets.

    Raises:
        ValueError: no experts, a malformed ``k_bits`` entry, or a bad rank.
        CodecError: an illegal K, or a half-integer K with a codebook other than mul1 (names layer and expert).
        GeometryError: ``H`` or ``I`` not a multiple of 128, an expert whose w1 and w3 K differ, or a TP cut off a
            128-channel block (see :func:`tp_shard`; each names the layer, the rule and the ways out).

    Source: seed 001 (``LayerPlan``: K-sorted slots and groups; ``BankLayout.build``: w13 = [w1 | w3] per slot;
    ``tp_shard``).
    """
    cb = Codebook.parse(codebook)
    where = layer or "MoE layer"
    if not k_bits:
        raise ValueError(f"{where}: no experts to plan")
    if hidden % HAD_BLOCK or hidden <= 0:
        raise GeometryError(
            f"{where}: stored hidden size {hidden} is not a positive multiple of {HAD_BLOCK}: EXL3 tensors are "
            f"stored padded to whole {HAD_BLOCK}-channel Hadamard blocks -> pass the stored (padded) size"
        )
    i0, i1 = tp_shard(intermediate, tp_size, tp_rank, layer)
    bits: list[ExpertBits] = []
    for e, ks in enumerate(k_bits):
        if len(ks) != 3:
            raise ValueError(f"{where}: expert {e}: k_bits entry {ks!r} is not (K of w1, K of w3, K of w2)")
        k1, k3, k2 = (float(k) for k in ks)
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
        bits.append(ExpertBits(k1, k2))
    order = sorted(range(len(bits)), key=lambda e: (bits[e].k_gu, bits[e].k_d, e))
    inv_perm = tuple(order)
    perm_list = [0] * len(order)
    for slot, e in enumerate(order):
        perm_list[e] = slot
    groups: list[KGroup] = []
    for slot, e in enumerate(order):
        b = bits[e]
        if groups and (groups[-1].k_gu, groups[-1].k_d) == (b.k_gu, b.k_d):
            g = groups[-1]
            groups[-1] = KGroup(g.k_gu, g.k_d, g.lo, slot + 1)
        else:
            groups.append(KGroup(b.k_gu, b.k_d, slot, slot + 1))
    words13, words2, off1, off3, off2 = bank_layout([(bits[e].k_gu, bits[e].k_d) for e in order], hidden, i1 - i0)
    return MoePlan(
        layer=layer,
        hidden=hidden,
        intermediate=intermediate,
        tp_size=tp_size,
        tp_rank=tp_rank,
        codebook=cb,
        bits=tuple(bits),
        perm=tuple(perm_list),
        inv_perm=inv_perm,
        groups=tuple(groups),
        inter_start=i0,
        inter_local=i1 - i0,
        words_w13=words13,
        words_w2=words2,
        off_w1=off1,
        off_w3=off3,
        off_w2=off2,
        total_w13=sum(2 * n for n in words13),
        total_w2=sum(words2),
    )


def bank_layout(
    slot_bits: Sequence[tuple[float, float]], hidden: int, inter_local: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Where each slot's trellises sit in the two flat trellis banks.

    Args:
        slot_bits: ``(K of w1 / w3, K of w2)`` per physical slot, in slot order.
        hidden: stored hidden size ``H``; inter_local: this rank's intermediate channels ``I_loc``.

    Returns:
        ``(words_w13, words_w2, off_w1, off_w3, off_w2)``, one entry per slot: the int16 words of one w1 / w3
        trellis and of the w2 trellis, and their offsets (``[w1 | w3]`` back to back in ``w13_trellis``).

    Raises:
        CodecError: an illegal K.

    Source: seed 001 (``BankLayout.build``).
    """
    tiles = (hidden // TILE) * (inter_local // TILE)
    words13 = tuple(tiles * width_from_k(k_gu) for k_gu, _ in slot_bits)
    words2 = tuple(tiles * width_from_k(k_d) for _, k_d in slot_bits)
    off1, off3, off2 = [], [], []
    a13 = a2 = 0
    for n13, n2 in zip(words13, words2, strict=True):
        off1.append(a13)
        off3.append(a13 + n13)
        a13 += 2 * n13
        off2.append(a2)
        a2 += n2
    return words13, words2, tuple(off1), tuple(off3), tuple(off2)


def bank_from_tensors(
    layer: str,
    experts: Mapping[tuple[int, str], Exl3Tensors],
    device: torch.device | str | None = None,
    tp_size: int = 1,
    tp_rank: int = 0,
) -> Exl3MoeBank:
    """Plan a layer's bank from its experts' full EXL3 tensors (the K each one holds) and load them into it.

    Args:
        layer: module name, for messages.
        experts: ``(logical expert, "w1" | "w3" | "w2") -> tensors`` for experts ``0..E-1``, as the pack stores them
            (sizes padded to 128).
        device: where the bank lives (None: torch's default device).
        tp_size, tp_rank: the tensor-parallel rank whose share of the intermediate channels the bank keeps.

    Returns:
        the loaded :class:`Exl3MoeBank` of that rank.

    Raises:
        KeyError: an expert or projection missing (check completeness first for a named error).
        CodecError: experts of the layer in several codebooks, or an illegal K.
        GeometryError: w1 / w3 of an expert at different K, shapes that differ between experts, or a TP cut off a
            128-channel block (:func:`tp_shard`).

    Source: seed 001 (``LayerPlan`` from the pack's own K, then ``Exl3Bank.load_piece`` per tensor).
    """
    where = layer or "MoE layer"
    codebooks: dict[Codebook, tuple[int, str]] = {}
    for (e, proj), t in sorted(experts.items()):
        codebooks.setdefault(t.codebook, (e, proj))
    if len(codebooks) > 1:
        listing = ", ".join(f"{cb.value} (e.g. expert {e} {PROJ_MODULES[p]})" for cb, (e, p) in codebooks.items())
        raise CodecError(
            f"{where}: the layer's experts use several codebooks: {listing}. Rule: one expert bank holds one "
            "codebook (the grouped kernels take it per launch) - re-quantize the layer with one codebook"
        )
    num = 1 + max(e for e, _ in experts)
    k_bits = [tuple(experts[(e, p)].k_bits for p in PROJECTIONS) for e in range(num)]
    hidden, inter = experts[(0, PROJ_GATE)].padded_shape
    plan = plan_moe_layer(
        layer, k_bits, hidden, inter, codebook=next(iter(codebooks)), tp_size=tp_size, tp_rank=tp_rank
    )
    bank = Exl3MoeBank(plan)
    bank.allocate(device)
    for (e, proj), t in experts.items():
        bank.load_piece(e, proj, "trellis", t.trellis)
        bank.load_piece(e, proj, "suh", t.suh.to(torch.float16))
        bank.load_piece(e, proj, "svh", t.svh.to(torch.float16))
    return bank


@dataclass(frozen=True)
class ProjView:
    """One projection of one expert, as views into the bank (this rank's part).

    Attributes:
        trellis: int16 ``(rows/16, cols/16, width)``, a view of ``w13_trellis`` or ``w2_trellis``.
        suh: float16 ``(rows,)``, a view of the bank's suh.
        svh: float16 ``(cols,)``, a view of the bank's svh.
        k: bits per weight.

    Here ``(rows, cols)`` is ``(H, I_loc)`` for w1 / w3 and ``(I_loc, H)`` for w2.

    Source: seed 001 (the tuples ``Exl3Bank.views`` returns).
    """

    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    k: float


@dataclass(frozen=True)
class ExpertViews:
    """The three projections of one expert as views into the bank.

    Attributes:
        w1: gate_proj (:class:`ProjView`).
        w3: up_proj.
        w2: down_proj.

    Source: seed 001 (``Exl3Bank.views``).
    """

    w1: ProjView
    w3: ProjView
    w2: ProjView

    def proj(self, name: str) -> ProjView:
        """The view of projection ``"w1"``, ``"w3"`` or ``"w2"``."""
        return {PROJ_GATE: self.w1, PROJ_UP: self.w3, PROJ_DOWN: self.w2}[name]


@dataclass(frozen=True)
class ProjTables:
    """Device pointer tables of one projection, one entry per slot (physical order).

    Attributes:
        trellis: int64 ``(n,)``, ``data_ptr()`` of each slot's trellis.
        suh: int64 ``(n,)``, ``data_ptr()`` of each slot's suh.
        svh: int64 ``(n,)``, ``data_ptr()`` of each slot's svh.

    Source: seed 001 (``ProjTables``); exllamav3 ``multilinear.py`` (``ptrs_trellis``, ``ptrs_suh``, ``ptrs_svh``).
    """

    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor

    def slice(self, lo: int, hi: int) -> ProjTables:
        """Entries of slots ``[lo, hi)`` (views of these tables)."""
        return ProjTables(self.trellis[lo:hi], self.suh[lo:hi], self.svh[lo:hi])


@dataclass(frozen=True)
class GroupTables:
    """The pointer tables of one K group: everything one grouped kernel launch needs.

    Attributes:
        k_gu, k_d: the group's K of w1 / w3 and of w2.
        lo, hi: its slots ``[lo, hi)``.
        gate, up, down: :class:`ProjTables` of w1, w3, w2 over those slots.

    Source: seed 001 (``GroupTables``).
    """

    k_gu: float
    k_d: float
    lo: int
    hi: int
    gate: ProjTables
    up: ProjTables
    down: ProjTables


@dataclass(frozen=True)
class BankTables:
    """All pointer tables of a bank.

    Attributes:
        groups: one :class:`GroupTables` per K group, in slot order.
        gate, up, down: the whole-layer :class:`ProjTables` (all E slots) the groups are slices of.

    Source: seed 001 (what ``Exl3Bank.tables`` returns, as one object).
    """

    groups: tuple[GroupTables, ...]
    gate: ProjTables
    up: ProjTables
    down: ProjTables


def _dtype(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


class Exl3MoeBank:
    """One MoE layer's EXL3 experts on one tensor-parallel rank, in six flat tensors (see the module docstring).

    Use: ``bank = Exl3MoeBank(plan); bank.allocate(device)`` (or :meth:`bind` to tensors owned elsewhere, e.g.
    vLLM Parameters); then :meth:`load_piece` once per expert, projection and tensor with the FULL exllamav3 tensor
    (each rank cuts its own part); then :meth:`expert_views` / :meth:`pointer_tables` for the kernels.

    Attributes:
        plan: the :class:`MoePlan`.
        tensors: bank tensor name -> tensor (empty until :meth:`allocate` or :meth:`bind`).

    Source: seed 001 (``Exl3Bank``: ``allocate``, ``bind``, ``load_piece``, ``views``, ``tables``).
    """

    def __init__(self, plan: MoePlan):
        self.plan = plan
        self.tensors: dict[str, torch.Tensor] = {}
        self._loaded: set[tuple[int, str, str]] = set()

    @property
    def num_experts(self) -> int:
        """Number of experts ``E``."""
        return self.plan.num_experts

    @property
    def device(self) -> torch.device:
        """Device of the bank's tensors.

        Raises:
            ValueError: before :meth:`allocate` or :meth:`bind`.
        """
        return self._t("w13_trellis").device

    # --------------------------------------------------------------------------------------------- storage

    def allocate(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """Allocate the six bank tensors, uninitialized.

        Args:
            device: where; None means torch's current default device (what vLLM's ``create_weights`` relies on).

        Returns:
            ``{name: tensor}`` with the shapes and dtypes of :meth:`MoePlan.bank_shapes` (also kept in
            :attr:`tensors`). Nothing counts as loaded.

        Raises:
            RuntimeError: from torch, when the device cannot hold the bank.

        Source: seed 001 (``Exl3Bank.allocate``).
        """
        kw = {} if device is None else {"device": device}
        self.tensors = {n: torch.empty(s, dtype=d, **kw) for n, (s, d) in self.plan.bank_shapes().items()}
        self._loaded.clear()
        return self.tensors

    def bind(self, tensors: Mapping[str, torch.Tensor], *, loaded: bool = False) -> None:
        """Point the bank at tensors owned elsewhere (vLLM Parameters' ``.data``, another bank's tensors).

        Args:
            tensors: the six bank tensors by name (extra names are ignored).
            loaded: mark every piece as loaded (the tensors were filled elsewhere); otherwise the record of loaded
                pieces is kept as it was.

        Raises:
            GeometryError: a missing tensor, or one whose shape, dtype or contiguity is not what the plan needs, or
                tensors on different devices (names the layer and the tensor).

        Source: seed 001 (``Exl3Bank.bind``), with the checks added.
        """
        where = self.plan.layer or "MoE layer"
        devices = set()
        for name, (shape, dtype) in self.plan.bank_shapes().items():
            t = tensors.get(name)
            if t is None:
                raise GeometryError(f"{where}: bank tensor {name} not given -> pass all of {', '.join(BANK_TENSORS)}")
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise GeometryError(
                    f"{where}: bank tensor {name}: got {tuple(t.shape)} {_dtype(t.dtype)}, the plan needs {shape} "
                    f"{_dtype(dtype)} -> allocate it from the same plan (MoePlan.bank_shapes)"
                )
            if not t.is_contiguous():
                raise GeometryError(f"{where}: bank tensor {name} is not contiguous -> pass a contiguous tensor")
            devices.add(t.device)
        if len(devices) > 1:
            raise GeometryError(f"{where}: bank tensors on several devices {sorted(map(str, devices))}")
        self.tensors = {n: tensors[n] for n in BANK_TENSORS}
        if loaded:
            self._loaded = set(self._required())

    def _t(self, name: str) -> torch.Tensor:
        t = self.tensors.get(name)
        if t is None:
            raise ValueError(f"{self.plan.layer or 'MoE layer'}: the bank has no tensors yet: allocate() or bind()")
        return t

    # --------------------------------------------------------------------------------------------- loading

    def _required(self) -> list[tuple[int, str, str]]:
        marker = self.plan.codebook.marker
        kinds = (*PIECE_KINDS, marker) if marker else PIECE_KINDS
        return [(e, p, k) for e in range(self.num_experts) for p in PROJECTIONS for k in kinds]

    def missing(self) -> list[tuple[int, str, str]]:
        """Pieces not loaded yet: ``(logical expert, proj, kind)`` in expert order; kinds are ``trellis``, ``suh``,
        ``svh`` and the codebook's marker (``mcg`` / ``mul1``; none for 3INST).

        Only :meth:`load_piece` and ``bind(..., loaded=True)`` count as loading; the caller decides what a gap means
        (the vLLM method reports it after loading). Not in seed 001.
        """
        return [r for r in self._required() if r not in self._loaded]

    def _where(self, expert: int, proj: str, kind: str) -> str:
        layer = self.plan.layer or "MoE layer"
        return f"{layer}: expert {expert} {proj} ({PROJ_MODULES[proj]}).{kind}"

    def piece_view(self, expert: int, proj: str, kind: str) -> torch.Tensor:
        """The bank's view that holds this rank's part of one tensor of a logical expert.

        Returns:
            trellis: int16 ``(rows/16, cols/16, width)``; suh ``(rows,)``; svh ``(cols,)`` (float16), with
            ``(rows, cols)`` = ``(H, I_loc)`` for w1 / w3 and ``(I_loc, H)`` for w2.

        Raises:
            ValueError: unknown expert, projection or kind, or no tensors yet.

        Source: seed 001 (the destinations ``Exl3Bank.load_piece`` writes).
        """
        return getattr(self.expert_views(expert).proj(self._check_proj(proj)), self._check_kind(kind))

    def _check_expert(self, expert: int) -> int:
        e = int(expert)
        if not 0 <= e < self.num_experts:
            raise ValueError(f"{self.plan.layer or 'MoE layer'}: expert {expert} outside 0..{self.num_experts - 1}")
        return e

    @staticmethod
    def _check_proj(proj: str) -> str:
        if proj not in PROJECTIONS:
            raise ValueError(f"unknown projection {proj!r}: expected one of {PROJECTIONS} (gate, up, down)")
        return proj

    @staticmethod
    def _check_kind(kind: str) -> str:
        if kind not in PIECE_KINDS:
            raise ValueError(f"unknown tensor kind {kind!r}: expected one of {PIECE_KINDS}")
        return kind

    def load_piece(self, expert: int, proj: str, kind: str, tensor: torch.Tensor) -> None:
        """Copy this rank's part of one full exllamav3 tensor of a logical expert into its slot.

        Args:
            expert: logical expert id (0..E-1).
            proj: ``"w1"`` (gate_proj), ``"w3"`` (up_proj) or ``"w2"`` (down_proj).
            kind: ``"trellis"`` (int16 ``(rows/16, cols/16, width)`` of the FULL tensor), ``"suh"`` / ``"svh"``
                (float16 ``(rows,)`` / ``(cols,)``), or the codebook marker ``"mcg"`` / ``"mul1"`` (a 0-d int32, only
                checked: the bank has one codebook). ``(rows, cols)`` is ``(H, I)`` for w1 / w3, ``(I, H)`` for w2.
            tensor: the tensor as the pack stores it, on any device (copied, not kept).

        Raises:
            ValueError: unknown expert, projection or kind, or no tensors yet (:meth:`allocate` / :meth:`bind`).
            GeometryError: a shape or dtype the plan does not predict (names layer, expert, tensor, expected and got;
                for a trellis of another width, also the K the tensor holds against the plan's).
            CodecError: a marker of another codebook than the plan's, or a marker with a wrong value.

        Source: seed 001 (``Exl3Bank.load_piece``).
        """
        plan = self.plan
        e = self._check_expert(expert)
        self._check_proj(proj)
        if kind in ("mcg", "mul1"):
            self._check_marker_piece(e, proj, kind, tensor)
            return
        self._check_kind(kind)
        dst = self.piece_view(e, proj, kind)
        want_shape = plan.full_shape(e, proj, kind)
        want_dtype = torch.int16 if kind == "trellis" else torch.float16
        got_shape = tuple(tensor.shape)
        if got_shape != want_shape or tensor.dtype != want_dtype:
            what = f"got {got_shape} {_dtype(tensor.dtype)}, expected {want_shape} {_dtype(want_dtype)}"
            if kind == "trellis":
                what += f" (K={plan.k_of(e, proj):g} in the plan, H={plan.hidden}, I={plan.intermediate})"
                if got_shape[:2] == want_shape[:2] and len(got_shape) == 3:
                    try:
                        what += f"; the tensor holds K={k_from_width(got_shape[2]):g}"
                    except CodecError:
                        what += f"; its width {got_shape[2]} is no legal K"
                fix = "build the plan from this pack's own K and sizes for every expert"
            else:
                fix = "pass the pack's float16 vector of this expert (H and I are the stored, 128-padded sizes)"
            raise GeometryError(f"{self._where(e, proj, kind)}: {what} -> {fix}")
        sl = plan.slices(proj)
        if kind == "trellis":
            a, b = sl.trellis_range
            src = tensor.narrow(sl.trellis_dim, a, b - a)  # w1 / w3: a strided cut of the output tiles
        else:
            rng = sl.suh_range if kind == "suh" else sl.svh_range
            src = tensor if rng is None else tensor[rng[0] : rng[1]]
        dst.copy_(src)
        self._loaded.add((e, proj, kind))

    def _check_marker_piece(self, e: int, proj: str, kind: str, tensor: torch.Tensor) -> None:
        cb = self.plan.codebook
        if cb.marker != kind:
            raise CodecError(
                f"{self._where(e, proj, kind)}: the tensor is marked {kind}, but the plan's codebook is {cb.value}. "
                "Rule: one bank holds one codebook (the grouped kernels take it per launch, not per expert) -> plan "
                "the layer with the codebook its experts use; a layer mixing codebooks cannot be banked"
            )
        try:
            check_marker(tensor, cb)
        except CodecError as err:
            raise CodecError(f"{self._where(e, proj, kind)}: {err}") from None
        self._loaded.add((e, proj, kind))

    def load_expert(self, expert: int, pieces: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Load every tensor of one expert: :meth:`load_piece` for each ``pieces[proj][suffix]``.

        Args:
            expert: logical expert id.
            pieces: ``{"w1" | "w3" | "w2": {suffix: tensor}}`` with the suffixes of a pack (``trellis``, ``suh``,
                ``svh`` and the codebook marker); a ``bias`` is refused.

        Raises:
            as :meth:`load_piece`; ValueError for an unknown suffix (legacy ``su`` / ``sv`` and ``bias`` included).

        Source: seed 001 (``Exl3Bank.load_piece``, once per tensor).
        """
        for proj, ts in pieces.items():
            for kind, t in ts.items():
                if kind not in (*PIECE_KINDS, "mcg", "mul1"):
                    raise ValueError(
                        f"{self._where(int(expert), self._check_proj(proj), kind)}: the bank stores no {kind!r} "
                        "(it takes trellis, suh, svh and the codebook marker; expert biases and legacy su / sv are "
                        "not supported)"
                    )
                self.load_piece(expert, proj, kind, t)

    # --------------------------------------------------------------------------------------------- views

    def slot_views(self, slot: int) -> ExpertViews:
        """Views into the bank of the expert in physical slot ``slot`` (this rank's part).

        Returns:
            :class:`ExpertViews`: w1 / w3 trellis ``(H/16, I_loc/16, width(k_gu))``, suh ``(H,)``, svh ``(I_loc,)``;
            w2 trellis ``(I_loc/16, H/16, width(k_d))``, suh ``(I_loc,)``, svh ``(H,)``.

        Raises:
            ValueError: slot out of range, or no tensors yet.

        Source: seed 001 (``Exl3Bank.views``).
        """
        plan = self.plan
        if not 0 <= slot < self.num_experts:
            raise ValueError(f"{plan.layer or 'MoE layer'}: slot {slot} outside 0..{self.num_experts - 1}")
        e = plan.inv_perm[slot]
        w13, w2 = self._t("w13_trellis"), self._t("w2_trellis")
        s13, v13, s2, v2 = (self._t(n) for n in ("w13_suh", "w13_svh", "w2_suh", "w2_svh"))
        s_gu = plan.local_shape(e, PROJ_GATE, "trellis")
        s_d = plan.local_shape(e, PROJ_DOWN, "trellis")
        n13, n2 = plan.words_w13[slot], plan.words_w2[slot]
        o1, o3, o2 = plan.off_w1[slot], plan.off_w3[slot], plan.off_w2[slot]
        b = plan.bits[e]
        return ExpertViews(
            ProjView(w13[o1 : o1 + n13].view(s_gu), s13[slot, 0], v13[slot, 0], b.k_gu),
            ProjView(w13[o3 : o3 + n13].view(s_gu), s13[slot, 1], v13[slot, 1], b.k_gu),
            ProjView(w2[o2 : o2 + n2].view(s_d), s2[slot], v2[slot], b.k_d),
        )

    def expert_views(self, expert: int) -> ExpertViews:
        """:meth:`slot_views` of a logical expert (its slot is ``plan.perm[expert]``).

        Raises:
            ValueError: expert out of range, or no tensors yet.
        """
        return self.slot_views(self.plan.perm[self._check_expert(expert)])

    def expert_tensors(self, expert: int) -> tuple[Exl3Tensors, Exl3Tensors, Exl3Tensors]:
        """This rank's part of one expert as codec objects over the bank's views (nothing copied).

        Returns:
            ``(w1, w3, w2)`` :class:`~quantpack_core.codec.Exl3Tensors` with the plan's codebook.

        Raises:
            ValueError: expert out of range, or no tensors yet.
            CodecError: a vector holding NaN or infinities (e.g. a piece never loaded).

        Source: quantpack_core.codec.Exl3Tensors over seed 001's per-expert views.
        """
        v = self.expert_views(expert)
        cb = self.plan.codebook
        return tuple(Exl3Tensors(p.trellis, p.suh, p.svh, cb) for p in (v.w1, v.w3, v.w2))  # type: ignore[return-value]

    # --------------------------------------------------------------------------------------------- tables

    def pointer_tables(self) -> BankTables:
        """Device pointer tables (int64 ``data_ptr()`` values, physical slot order, on the bank's device) of every
        slot's trellis, suh and svh, and their slices per K group.

        The pointers are raw addresses: build the tables again whenever the bank's tensors move (another
        :meth:`allocate` or :meth:`bind`, a ``.to()``).

        Returns:
            :class:`BankTables`; each table is int64 ``(E,)``, each group's are its ``[lo, hi)`` slices.

        Raises:
            ValueError: no tensors yet.
            GeometryError: a bank tensor is not contiguous (only possible if it was changed in place after binding).

        Source: seed 001 (``Exl3Bank.tables``); exllamav3 ``multilinear.py`` (``ptrs_*`` as int64 tensors).
        """
        for n in BANK_TENSORS:
            if not self._t(n).is_contiguous():
                raise GeometryError(f"{self.plan.layer or 'MoE layer'}: bank tensor {n} must be contiguous")
        dev = self.device
        cols: dict[str, list[list[int]]] = {p: [[], [], []] for p in PROJECTIONS}
        for slot in range(self.num_experts):
            v = self.slot_views(slot)
            for p in PROJECTIONS:
                pv = v.proj(p)
                for i, t in enumerate((pv.trellis, pv.suh, pv.svh)):
                    cols[p][i].append(t.data_ptr())
        whole = {p: ProjTables(*(torch.tensor(c, dtype=torch.int64, device=dev) for c in cols[p])) for p in PROJECTIONS}
        g, u, d = whole[PROJ_GATE], whole[PROJ_UP], whole[PROJ_DOWN]
        groups = tuple(
            GroupTables(k.k_gu, k.k_d, k.lo, k.hi, g.slice(k.lo, k.hi), u.slice(k.lo, k.hi), d.slice(k.lo, k.hi))
            for k in self.plan.groups
        )
        return BankTables(groups, g, u, d)


# ------------------------------------------------------------------------------------------------ reference forward


def dequantize_expert(
    bank: Exl3MoeBank, expert: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense weights of this rank's part of one expert, decoded from the bank with the core codec.

    Args:
        bank: a loaded bank.
        expert: logical expert id.
        dtype: compute and result dtype (float32 or float64).

    Returns:
        ``(W1, W3, W2)`` with ``W1, W3`` of shape ``(H, I_loc)`` and ``W2`` of shape ``(I_loc, H)``, in ``y = x @ W``
        layout (see :func:`~quantpack_core.codec.dequantize`).

    Raises:
        CodecError: a vector holding NaN or infinities (e.g. a piece never loaded).

    Source: quantpack_core.codec.dequantize over seed 001's per-expert views.
    """
    return tuple(dequantize(t, dtype) for t in bank.expert_tensors(expert))  # type: ignore[return-value]


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": torch.nn.functional.silu}


def reference_moe_forward(
    bank: Exl3MoeBank,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    activation: str | Callable[[torch.Tensor], torch.Tensor] = "silu",
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Dense reference of the routed experts of one layer on this rank: for each token t,
    ``y[t] = sum_j topk_weights[t, j] * (act(x[t] @ W1) * (x[t] @ W3)) @ W2`` with ``W*`` of expert ``topk_ids[t, j]``
    dequantized from the bank (:func:`dequantize_expert`).

    On a rank of ``tp_size > 1`` this is the rank's partial sum: the sum over all ranks (vLLM's all-reduce) is the
    full layer's output. Each expert used is decoded once per call, so this is a test oracle, not a fast path.

    Args:
        bank: a loaded bank.
        x: ``(T, H)`` activations (``H`` the stored hidden size), any floating dtype.
        topk_ids: ``(T, k)`` integer logical expert ids in ``[0, E)``; a token may list an expert more than once.
        topk_weights: ``(T, k)`` routing weights (already normalized / scaled as the model wants).
        activation: ``"silu"`` (exllamav3's and vLLM's default) or a callable applied to the gate.
        dtype: compute and result dtype (float64 for an oracle).

    Returns:
        ``(T, H)`` tensor of ``dtype`` on ``x``'s device.

    Raises:
        ValueError: shapes that do not match (``x`` not ``(T, H)``, ids and weights not both ``(T, k)``), an expert id
            out of range, or an unknown activation name.
        CodecError: an expert whose vectors hold NaN or infinities (e.g. never loaded).

    Source: exllamav3 ``exllamav3/modules/block_sparse_mlp.py`` (``BlockSparseMLP.forward``: per selected expert,
    ``down(act(gate(x)) * up(x))`` times the routing weight, summed); seed 001 for the per-rank part.
    """
    plan = bank.plan
    where = plan.layer or "MoE layer"
    if x.dim() != 2 or x.shape[1] != plan.hidden:
        raise ValueError(f"{where}: x has shape {tuple(x.shape)}, expected (tokens, {plan.hidden})")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"{where}: topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be "
            f"(tokens={x.shape[0]}, top_k)"
        )
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"{where}: topk_ids must be integers, got {topk_ids.dtype}")
    if isinstance(activation, str):
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}: expected one of {sorted(ACTIVATIONS)} or a callable")
        act = ACTIVATIONS[activation]
    else:
        act = activation
    ids = topk_ids.to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= plan.num_experts):
        raise ValueError(f"{where}: expert ids must lie in 0..{plan.num_experts - 1}, got {ids.unique().tolist()}")
    xf = x.to(dtype)
    wts = topk_weights.to(device=x.device, dtype=dtype)
    ids = ids.to(x.device)
    out = torch.zeros(x.shape[0], plan.hidden, dtype=dtype, device=x.device)
    for e in ids.unique().tolist():
        tok, j = (ids == e).nonzero(as_tuple=True)
        w1, w3, w2 = (w.to(x.device) for w in dequantize_expert(bank, e, dtype))
        xe = xf[tok]
        h = act(xe @ w1) * (xe @ w3)
        out.index_add_(0, tok, (h @ w2) * wts[tok, j, None])
    return out
