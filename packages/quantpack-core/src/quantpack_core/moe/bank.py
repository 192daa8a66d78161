"""One MoE layer's EXL3 experts on one tensor-parallel rank, in six flat tensors.

- **Trellis banks.** Two flat int16 tensors: ``w13_trellis`` holds, slot after slot, ``[w1 | w3]`` (both of the
  slot's ``K_gu``), ``w2_trellis`` holds each slot's ``w2``. Each tensor is a whole number of 16x16 tiles of
  ``16*K`` (or ``16*KA + 8``) words, so every offset is a multiple of 16 bytes.
- **Vectors.** float16, indexed by slot: ``w13_suh (E, 2, H)`` and ``w2_svh (E, H)`` span the hidden side (never cut),
  ``w13_svh (E, 2, I_loc)`` and ``w2_suh (E, I_loc)`` the rank's intermediate channels.
- **Ungated experts** (``down(act(x W1))``, no ``up_proj``: Nemotron-H's relu² experts): ``w13_trellis`` holds ``w1``
  alone per slot and ``w13_suh`` / ``w13_svh`` are ``(E, 1, .)``; the kernels tell the two apart by that axis.

The layout comes from the layer's :class:`~quantpack_core.moe.plan.MoePlan`; each rank cuts its part out of the full
exllamav3 tensors as they load (``w1`` / ``w3`` column parallel, ``w2`` row parallel). Follows docs/moe-bank.md.
Plain torch on any device; no vLLM and no exllamav3 import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..codec.codebook import Codebook
from ..codec.exl3 import Exl3Tensors, check_marker
from ..codec.trellis import k_from_width
from ..errors import CodecError, GeometryError
from .plan import (
    BANK_TENSORS,
    PIECE_KINDS,
    PROJ_DOWN,
    PROJ_GATE,
    PROJ_MODULES,
    PROJ_UP,
    PROJECTIONS,
    MoePlan,
    expert_projections,
    plan_moe_layer,
)
from .tables import BankTables, GroupTables, ProjTables


@dataclass(frozen=True)
class ProjView:
    """One projection of one expert, as views into the bank (this rank's part).

    Attributes:
        trellis: int16 ``(rows/16, cols/16, width)``, a view of ``w13_trellis`` or ``w2_trellis``.
        suh: float16 ``(rows,)``, a view of the bank's suh.
        svh: float16 ``(cols,)``, a view of the bank's svh.
        k: bits per weight.

    Here ``(rows, cols)`` is ``(H, I_loc)`` for w1 / w3 and ``(I_loc, H)`` for w2.

    Source: docs/moe-bank.md.
    """

    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    k: float


@dataclass(frozen=True)
class ExpertViews:
    """The three projections of one expert as views into the bank.

    Attributes:
        w1: gate_proj (:class:`ProjView`; an ungated expert's one input projection).
        w3: up_proj (None for an ungated expert).
        w2: down_proj.

    Source: docs/moe-bank.md.
    """

    w1: ProjView
    w3: ProjView | None
    w2: ProjView

    def proj(self, name: str) -> ProjView:
        """The view of projection ``"w1"``, ``"w3"`` or ``"w2"``.

        Raises:
            ValueError: ``"w3"`` of an ungated expert.
        """
        view = {PROJ_GATE: self.w1, PROJ_UP: self.w3, PROJ_DOWN: self.w2}[name]
        if view is None:
            raise ValueError("an ungated expert has no w3 (up_proj): its bank holds w1 and w2 only")
        return view


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

    Source: docs/moe-bank.md.
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

        Source: docs/moe-bank.md.
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

        Source: docs/moe-bank.md, with the checks added.
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
        return [(e, p, k) for e in range(self.num_experts) for p in self.plan.projections for k in kinds]

    def missing(self) -> list[tuple[int, str, str]]:
        """Pieces not loaded yet: ``(logical expert, proj, kind)`` in expert order; kinds are ``trellis``, ``suh``,
        ``svh`` and the codebook's marker (``mcg`` / ``mul1``; none for 3INST).

        Only :meth:`load_piece` and ``bind(..., loaded=True)`` count as loading; the caller decides what a gap means
        (the vLLM method reports it after loading).
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

        Source: docs/moe-bank.md.
        """
        return getattr(self.expert_views(expert).proj(self._check_proj(proj)), self._check_kind(kind))

    def _check_gated_proj(self, expert: int, proj: str) -> None:
        if proj == PROJ_UP and not self.plan.gated:
            raise GeometryError(
                f"{self.plan.layer or 'MoE layer'}: expert {expert}: an up_proj (w3) for a layer of ungated experts "
                "(down(act(x W1)), w1 and w2 only) -> the pack's experts do not match the model's MoE layers; use "
                "the config the pack was made with"
            )

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

        Source: docs/moe-bank.md.
        """
        plan = self.plan
        e = self._check_expert(expert)
        self._check_proj(proj)
        self._check_gated_proj(e, proj)
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

        Source: docs/moe-bank.md.
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

        Source: docs/moe-bank.md.
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
        up = ProjView(w13[o3 : o3 + n13].view(s_gu), s13[slot, 1], v13[slot, 1], b.k_gu) if plan.gated else None
        return ExpertViews(
            ProjView(w13[o1 : o1 + n13].view(s_gu), s13[slot, 0], v13[slot, 0], b.k_gu),
            up,
            ProjView(w2[o2 : o2 + n2].view(s_d), s2[slot], v2[slot], b.k_d),
        )

    def expert_views(self, expert: int) -> ExpertViews:
        """:meth:`slot_views` of a logical expert (its slot is ``plan.perm[expert]``).

        Raises:
            ValueError: expert out of range, or no tensors yet.
        """
        return self.slot_views(self.plan.perm[self._check_expert(expert)])

    def expert_tensors(self, expert: int) -> tuple[Exl3Tensors, Exl3Tensors | None, Exl3Tensors]:
        """This rank's part of one expert as codec objects over the bank's views (nothing copied).

        Returns:
            ``(w1, w3, w2)`` :class:`~quantpack_core.codec.Exl3Tensors` with the plan's codebook (``w3`` None for an
            ungated expert).

        Raises:
            ValueError: expert out of range, or no tensors yet.
            CodecError: a vector holding NaN or infinities (e.g. a piece never loaded).

        Source: quantpack_core.codec.Exl3Tensors over the bank's per-expert views (docs/moe-bank.md).
        """
        v = self.expert_views(expert)
        cb = self.plan.codebook
        return tuple(None if p is None else Exl3Tensors(p.trellis, p.suh, p.svh, cb) for p in (v.w1, v.w3, v.w2))  # type: ignore[return-value]

    # --------------------------------------------------------------------------------------------- tables

    def pointer_tables(self) -> BankTables:
        """Device pointer tables of every slot's trellis, suh and svh: :func:`quantpack_core.moe.tables.pointer_tables`
        of this bank."""
        return pointer_tables(self)


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
            (sizes padded to 128); a layer without any ``w3`` is planned as ungated experts (w1 and w2 only).
        device: where the bank lives (None: torch's default device).
        tp_size, tp_rank: the tensor-parallel rank whose share of the intermediate channels the bank keeps.

    Returns:
        the loaded :class:`Exl3MoeBank` of that rank.

    Raises:
        GeometryError: no experts, an expert or projection missing (experts must be ``0..E-1``, each with w1 and w2,
            and either all or none with w3: a layer is gated or ungated as a whole), named.
        CodecError: experts of the layer in several codebooks, or an illegal K.
        GeometryError: w1 / w3 of an expert at different K, shapes that differ between experts, or a TP cut off a
            128-channel block (:func:`tp_shard`).

    Source: docs/moe-bank.md.
    """
    where = layer or "MoE layer"
    if not experts:
        raise GeometryError(f"{where}: no expert tensors to build a bank from")
    num = 1 + max(e for e, _ in experts)
    gated = any(p == PROJ_UP for _, p in experts)
    projs = expert_projections(gated)
    absent = [(e, p) for e in range(num) for p in projs if (e, p) not in experts]
    if absent:
        with_up = sorted({e for e, p in experts if p == PROJ_UP})
        kind = (
            f"; experts {with_up[:6]} have a w3 (up_proj) and others not: a layer's experts are all gated or all "
            "ungated"
            if gated and any(p == PROJ_UP for _, p in absent)
            else ""
        )
        listing = ", ".join(f"expert {e} {p} ({PROJ_MODULES[p]})" for e, p in absent[:6])
        raise GeometryError(
            f"{where}: no {listing}{' and more' if len(absent) > 6 else ''} among experts 0..{num - 1}{kind} -> pass "
            "every expert's tensors as the pack stores them"
        )
    codebooks: dict[Codebook, tuple[int, str]] = {}
    for (e, proj), t in sorted(experts.items()):
        codebooks.setdefault(t.codebook, (e, proj))
    if len(codebooks) > 1:
        listing = ", ".join(f"{cb.value} (e.g. expert {e} {PROJ_MODULES[p]})" for cb, (e, p) in codebooks.items())
        raise CodecError(
            f"{where}: the layer's experts use several codebooks: {listing}. Rule: one expert bank holds one "
            "codebook (the grouped kernels take it per launch) - re-quantize the layer with one codebook"
        )
    k_bits = [tuple(experts[(e, p)].k_bits for p in projs) for e in range(num)]
    hidden, inter = experts[(0, PROJ_GATE)].padded_shape
    plan = plan_moe_layer(
        layer, k_bits, hidden, inter, codebook=next(iter(codebooks)), tp_size=tp_size, tp_rank=tp_rank, gated=gated
    )
    bank = Exl3MoeBank(plan)
    bank.allocate(device)
    for (e, proj), t in experts.items():
        bank.load_piece(e, proj, "trellis", t.trellis)
        bank.load_piece(e, proj, "suh", t.suh.to(torch.float16))
        bank.load_piece(e, proj, "svh", t.svh.to(torch.float16))
    return bank


def pointer_tables(bank: Exl3MoeBank) -> BankTables:
    """Device pointer tables (int64 ``data_ptr()`` values, physical slot order, on the bank's device) of every
    slot's trellis, suh and svh, and their slices per K group.

    The pointers are raw addresses: build the tables again whenever the bank's tensors move (another
    :meth:`allocate` or :meth:`bind`, a ``.to()``).

    Returns:
        :class:`BankTables`; each table is int64 ``(E,)``, each group's are its ``[lo, hi)`` slices. An ungated bank's
        up tables repeat its gate tables (the kernels read them only for gated banks).

    Raises:
        ValueError: no tensors yet.
        GeometryError: a bank tensor is not contiguous (only possible if it was changed in place after binding).

    Source: docs/moe-bank.md; exllamav3 ``multilinear.py`` (``ptrs_*`` as int64 tensors).
    """
    for n in BANK_TENSORS:
        if not bank._t(n).is_contiguous():
            raise GeometryError(f"{bank.plan.layer or 'MoE layer'}: bank tensor {n} must be contiguous")
    dev = bank.device
    cols: dict[str, list[list[int]]] = {p: [[], [], []] for p in PROJECTIONS}
    for slot in range(bank.num_experts):
        v = bank.slot_views(slot)
        for p in PROJECTIONS:
            pv = v.proj(p if bank.plan.gated or p != PROJ_UP else PROJ_GATE)
            for i, t in enumerate((pv.trellis, pv.suh, pv.svh)):
                cols[p][i].append(t.data_ptr())
    whole = {p: ProjTables(*(torch.tensor(c, dtype=torch.int64, device=dev) for c in cols[p])) for p in PROJECTIONS}
    g, u, d = whole[PROJ_GATE], whole[PROJ_UP], whole[PROJ_DOWN]
    groups = tuple(
        GroupTables(k.k_gu, k.k_d, k.lo, k.hi, g.slice(k.lo, k.hi), u.slice(k.lo, k.hi), d.slice(k.lo, k.hi))
        for k in bank.plan.groups
    )
    return BankTables(groups, g, u, d)


#: the custom-op schema of a grouped expert kernel taking :func:`grouped_inputs` (after the activations, expert ids and
#: routing weights; before the output it writes)
GROUPED_OP_SCHEMA = (
    "(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor perm, Tensor tables, Tensor w13_trellis, "
    "Tensor w2_trellis, Tensor w13_suh, Tensor w13_svh, Tensor w2_suh, Tensor w2_svh, int codebook, int layer_experts, "
    "int[] group_lo, int[] group_hi, float[] k_gu, float[] k_d, Tensor(a!) out) -> ()"
)


def grouped_inputs(
    bank: Exl3MoeBank, codebook_id: int, layer_experts: int, device: torch.device
) -> tuple[dict[str, torch.Tensor], tuple]:
    """What a grouped expert kernel's op reads for ``bank``: its tensors and scalars, as the exllamav3 and
    trellis_mma expert kernels both take them.

    Args:
        bank: a loaded bank on ``device``.
        codebook_id: the kernels' id of the bank's codebook (0 = 3INST, 1 = mcg, 2 = mul1).
        layer_experts: the layer's routed experts over all ranks (:attr:`~quantpack_core.kernels.ExpertSpec.
            layer_experts`), against which a kernel counts a call's picks per expert.
        device: the bank's device.

    Returns:
        ``(tensors, static)``: tensors ``perm`` (int64 ``(E + 1,)``: expert -> slot, a trailing -1 that an expert id
        of -1, another tensor-parallel rank's expert, indexes), ``tables`` (int64 ``(9, E)``: the trellis, suh and
        svh pointers of w1, w3, w2 per slot) and the six bank tensors (:data:`BANK_TENSORS`); static
        ``(codebook_id, layer_experts, group_lo, group_hi, k_gu, k_d)``, the lists one entry per K group in slot
        order. Whether the experts
        are gated is the second axis of ``w13_suh`` (2 or 1).

    Source: docs/moe-bank.md ("Pointer tables"); exllamav3 ``MultiLinear`` (``ptrs_trellis`` / ``ptrs_suh`` /
    ``ptrs_svh``).
    """
    plan = bank.plan
    t = bank.pointer_tables()
    rows = [getattr(p, f) for p in (t.gate, t.up, t.down) for f in ("trellis", "suh", "svh")]
    tables = torch.stack(rows).to(device)
    perm = torch.tensor([*plan.perm, -1], dtype=torch.int64, device=device)
    static = (
        codebook_id,
        layer_experts,
        [g.lo for g in plan.groups],
        [g.hi for g in plan.groups],
        [float(g.k_gu) for g in plan.groups],
        [float(g.k_d) for g in plan.groups],
    )
    return {"perm": perm, "tables": tables, **{n: bank.tensors[n] for n in BANK_TENSORS}}, static
