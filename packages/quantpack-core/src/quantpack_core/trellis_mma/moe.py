"""The trellis_mma kernels' expert-bank op, ``quantpack::trellis_moe_``: one MoE layer's trellis experts over the routed
tokens through the grouped kernels of ``csrc/moe.cu`` (the sort launch, one gate/up and one down launch for
every K group of the bank, each CTA at its work item's K, the reduction), and the per-GPU buffers those launches
share.

Two paths, chosen per call by its token count alone (:func:`uses_tensor_cores`), so a CUDA graph captured at one
token count always replays the path it captured:

- the mma.sync kernel (``csrc/moe.cu``): work items of :data:`ITEM_ROWS` rows, each expert's trellis decoded once per
  16 of its picks, chunks of :data:`SLOTS` picks; every GPU, and every call below the threshold (decode).
- on Hopper, from :attr:`~.settings.Settings.moe_tc_picks` picks per expert on: the tensor-core path
  (``csrc/moe_tc.cu``): a transform launch writes each pick's transformed input rows (``xh``), and the wgmma kernel
  decodes each expert's trellis once per :data:`TC_ITEM_ROWS` of its picks, in chunks of :data:`TC_SLOTS` picks.

The buffers (allocated when a bank is prepared, before any CUDA-graph capture; widened by a later, larger bank) hold
one chunk: the sort's arrays, the gate / up outputs (fp16), the weighted down rows (fp32) and, where the tensor-core
path can run, the transformed rows. A call of more tokens runs in chunks of ``SLOTS // top_k`` (``TC_SLOTS // top_k``)
tokens (a loop whose length depends on the token count only). The split-K partials and counters are the linear
kernels' workspace (:func:`.ops.reserve`).

Memory: ``SLOTS * (4 * I + 4 * H)`` bytes for the mma.sync path (stored hidden ``H`` and intermediate ``I``); where
the tensor-core path can run, ``TC_SLOTS * (4 * I + 4 * H + 2 * max(2 * H, I))`` instead: for Qwen3-30B-A3B's banks
(H 2048, I 768) 16384 x 19,456 bytes = 319 MB per GPU, once for all layers.

Source: docs/moe-bank.md (slots, K groups, pointer tables); ``csrc/moe.cu`` describes the kernels.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from quantpack_core.moe import GROUPED_OP_SCHEMA
from quantpack_core.ops import define_op

from .library import LibraryError, check, load
from .ops import reserve, workspace
from .settings import current

#: picks (token x choice) one chunk of launches sorts: bounds every buffer below
SLOTS = 2048
#: rows of one work item (MOE_ROWS in csrc/moe.cu)
ITEM_ROWS = 16
#: picks one chunk of the tensor-core path sorts: at 8 of 128 experts, 128 picks per expert, two 64-row items each
TC_SLOTS = 16384
#: rows of one work item of the tensor-core path (NR of csrc/moe_tc.cu)
TC_ITEM_ROWS = 64
#: K groups one bank may have (MOE_MAX_GROUPS)
MAX_GROUPS = 16
#: slots one bank may have: the sort kernel keeps 4 ints per slot in 48 KiB of shared memory
MAX_EXPERTS = 3000
WEIGHT_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def group_items(slots: int, group_slots: int, item_rows: int = ITEM_ROWS) -> int:
    """Work items of up to ``item_rows`` rows that ``group_slots`` consecutive slots (a K group, or a whole bank: the
    extent of its one launch per projection) can have for ``slots`` picks at most (``qp_moe_items``): one per
    non-empty slot beyond its share of whole items."""
    return min(group_slots, slots) + -(-slots // item_rows)


def uses_tensor_cores(buffers: MoeBuffers, tokens: int, top_k: int, layer_experts: int) -> bool:
    """Whether a call of ``tokens`` tokens at ``top_k`` in a layer of ``layer_experts`` routed experts runs the
    tensor-core path: the GPU's buffers have it (Hopper) and the call brings at least
    :attr:`~.settings.Settings.moe_tc_picks` picks per expert on average. The experts are the layer's over all ranks,
    so a rank of the expert split (whose bank holds a share of them and sees the other ranks' picks as -1) chooses
    by the picks its own experts get, as one GPU holding the whole layer does. The token count is a shape, so the
    choice is the same at every replay of a captured graph."""
    threshold = current().moe_tc_picks
    return buffers.xh is not None and threshold > 0 and tokens * top_k >= threshold * layer_experts


@dataclass
class MoeBuffers:
    """One GPU's buffers for ``quantpack::trellis_moe_`` (one chunk of ``picks`` picks, below).

    Attributes:
        slot_of, sorted: int32 ``(picks,)``: each pick's slot (-1: another rank's expert); picks in slot order.
        offsets: int32 ``(experts + 1,)``.
        work: int32 ``(2 * items,)``: (slot, first row) per work item.
        group_work: int32 ``(MAX_GROUPS + 1,)``.
        gu: float16 ``(picks, 2 * intermediate)``; y: float32 ``(picks, hidden)`` (stored sizes).
        xh: float16 ``(TC_SLOTS * max(2 * hidden, intermediate),)``: the tensor-core path's transformed rows (gate /
            up: two planes of ``(picks, hidden)``; down: ``(picks, intermediate)``); None where that path cannot run.

    ``picks`` is :data:`TC_SLOTS` where ``xh`` is allocated, else :data:`SLOTS`.
    """

    slot_of: torch.Tensor
    sorted: torch.Tensor
    offsets: torch.Tensor
    work: torch.Tensor
    group_work: torch.Tensor
    gu: torch.Tensor
    y: torch.Tensor
    xh: torch.Tensor | None = None


_buffers: dict[int, MoeBuffers] = {}
#: buffers a wider bank replaced: kept alive, since a CUDA graph captured before may still read them
_retired: list[MoeBuffers] = []


def reserve_moe(device: torch.device, experts: int, hidden: int, intermediate: int) -> MoeBuffers:
    """The MoE buffers of ``device``, created or widened for a bank of ``experts`` slots and stored ``hidden`` /
    ``intermediate`` sizes (call at load), and the linear workspace the launches share. On Hopper, unless
    :attr:`~.settings.Settings.moe_tc_picks` is 0, they hold a chunk of the tensor-core path (:data:`TC_SLOTS` picks;
    the module's head gives the memory).

    Raises:
        quantpack_core.trellis_mma.library.LibraryError: the kernels cannot be built or loaded for this GPU.
    """
    ws = reserve(device, max(hidden, intermediate))
    index = ws.partials.device.index
    have = _buffers.get(index)
    tc = ws.tensor_cores and current().moe_tc_picks > 0
    if have is not None:
        experts = max(experts, have.offsets.numel() - 1)
        intermediate = max(intermediate, have.gu.shape[1] // 2)
        hidden = max(hidden, have.y.shape[1])
        tc = tc or have.xh is not None
    picks = TC_SLOTS if tc else SLOTS
    if (
        have is None
        or have.offsets.numel() < experts + 1
        or have.gu.shape != (picks, 2 * intermediate)
        or have.y.shape[1] < hidden
        or (tc and have.xh.numel() < _xh_halves(hidden, intermediate))
    ):
        if have is not None:
            _retired.append(have)
        have = _allocate(ws.partials.device, experts, hidden, intermediate, tc)
        _buffers[index] = have
    return have


def _xh_halves(hidden: int, intermediate: int) -> int:
    """The tensor-core path's transformed rows of one chunk: two gate/up planes or one down plane."""
    return TC_SLOTS * max(2 * hidden, intermediate)


def _allocate(device: torch.device, experts: int, hidden: int, intermediate: int, tc: bool) -> MoeBuffers:
    """New buffers for a bank of these sizes (``tc``: with the tensor-core path's chunk)."""
    picks = TC_SLOTS if tc else SLOTS
    items = experts + max(MAX_GROUPS * -(-SLOTS // ITEM_ROWS), -(-TC_SLOTS // TC_ITEM_ROWS) if tc else 0)
    i32 = dict(dtype=torch.int32, device=device)
    return MoeBuffers(
        slot_of=torch.empty(picks, **i32),
        sorted=torch.empty(picks, **i32),
        offsets=torch.empty(experts + 1, **i32),
        work=torch.empty(2 * items, **i32),
        group_work=torch.empty(MAX_GROUPS + 1, **i32),
        gu=torch.empty((picks, 2 * intermediate), dtype=torch.float16, device=device),
        y=torch.empty((picks, hidden), dtype=torch.float32, device=device),
        xh=torch.empty(_xh_halves(hidden, intermediate), dtype=torch.float16, device=device) if tc else None,
    )


def run_trellis_moe(
    x, topk_ids, topk_weights, perm, tables, w13_trellis, w2_trellis, w13_suh, w13_svh, w2_suh, w2_svh,
    codebook: int, layer_experts: int, group_lo: list[int], group_hi: list[int], k_gu: list[float], k_d: list[float],
    out,
) -> None:  # fmt: skip
    """The CUDA implementation of ``quantpack::trellis_moe_`` (see :func:`trellis_moe_`)."""
    tokens, top_k = topk_ids.shape
    if tokens == 0:
        return
    device = x.device
    ws, buf = workspace(device), _buffers.get(device.index)
    experts = tables.shape[1]
    hidden_stored, inter = w13_suh.shape[2], w2_suh.shape[1]
    gated = w13_suh.shape[1] == 2  # an ungated bank (relu(x W1)^2, no W3) holds one entry per slot
    hidden = out.shape[1]
    if (
        ws is None
        or buf is None
        or x.dtype not in (torch.float16, torch.bfloat16)
        or out.dtype != x.dtype
        or out.stride(1) != 1
        or topk_weights.dtype not in WEIGHT_DTYPES
        or topk_ids.dtype not in (torch.int32, torch.int64)
        or buf.offsets.numel() < experts + 1
        or buf.gu.shape[1] < 2 * inter
        or buf.y.shape[1] < hidden_stored
    ):
        raise LibraryError(
            f"trellis_moe: takes float16 / bfloat16 activations with an output of their dtype, int32 / int64 expert "
            f"ids and float routing weights, after prepare() reserved this GPU's buffers for the bank (x {x.dtype}, "
            f"out {out.dtype}, ids {topk_ids.dtype}, weights {topk_weights.dtype}, buffers "
            f"{'ready' if buf is not None else 'missing'})"
        )
    if top_k > SLOTS:
        raise LibraryError(f"trellis_moe: top_k {top_k} is more than the {SLOTS} picks one chunk of launches sorts")
    tc = uses_tensor_cores(buf, tokens, top_k, layer_experts)
    call = _Call(
        lib=load(ws.arch), ws=ws, buf=buf, tc=tc, stream=torch.cuda.current_stream(device).cuda_stream,
        x=x if x.stride(1) == 1 else x.contiguous(), ids=topk_ids.contiguous(), weights=topk_weights.contiguous(),
        perm=perm, tables=tables, experts=experts, top_k=top_k, gated=gated, hidden_stored=hidden_stored, inter=inter,
        codebook=codebook, group_lo=(ctypes.c_int * len(group_lo))(*group_lo),
        k2=[(ctypes.c_int * len(group_lo))(*(round(2 * k) for k in ks)) for ks in (k_gu, k_d)],  # host arrays
    )  # fmt: skip
    chunk = (TC_SLOTS if tc else SLOTS) // top_k
    for t0 in range(0, tokens, chunk):
        t1 = min(t0 + chunk, tokens)
        call.sort(t0, t1)
        call.gemm(0, t0, t1)
        call.gemm(1, t0, t1)
        code = call.lib.qp_moe_reduce(
            call.y.data_ptr(), buf.slot_of.data_ptr(), out[t0:t1].data_ptr(), t1 - t0, top_k, hidden_stored, hidden,
            out.stride(0), int(out.dtype == torch.bfloat16), call.stream,
        )  # fmt: skip
        check(code, f"reduce of {t1 - t0} tokens")


@dataclass
class _Call:
    """One call's launches (the chunk loop of :func:`run_trellis_moe`): the library, this GPU's buffers, the path
    (``tc``: the tensor-core one) and the call's tensors and bank geometry; ``k2`` holds the 2K of each K group for
    gate/up and for down (ctypes host arrays)."""

    lib: ctypes.CDLL
    ws: object
    buf: MoeBuffers
    tc: bool
    stream: int
    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    perm: torch.Tensor
    tables: torch.Tensor
    experts: int
    top_k: int
    gated: bool
    hidden_stored: int
    inter: int
    codebook: int
    group_lo: ctypes.Array
    k2: list

    @property
    def gu(self) -> torch.Tensor:
        return self.buf.gu[:, : (2 if self.gated else 1) * self.inter]

    @property
    def y(self) -> torch.Tensor:
        return self.buf.y[:, : self.hidden_stored]

    def sort(self, t0: int, t1: int) -> None:
        """The picks of tokens ``t0 .. t1`` bucketed per slot and cut into the path's work items."""
        slots, buf = (t1 - t0) * self.top_k, self.buf
        code = self.lib.qp_moe_sort(
            self.ids[t0:t1].data_ptr(), int(self.ids.dtype == torch.int64), self.perm.data_ptr(), slots,
            self.experts, self.group_lo, len(self.group_lo), TC_ITEM_ROWS if self.tc else ITEM_ROWS,
            buf.slot_of.data_ptr(),
            buf.offsets.data_ptr(), buf.sorted.data_ptr(), buf.work.data_ptr(), buf.group_work.data_ptr(),
            self.stream,
        )  # fmt: skip
        check(code, f"sort of {slots} picks over {self.experts} experts")

    def gemm(self, down: int, t0: int, t1: int) -> None:
        """Gate/up (``down`` 0: x -> gu) or down (1: gu -> y) of tokens ``t0 .. t1`` on the call's path."""
        slots, buf, ws, x = (t1 - t0) * self.top_k, self.buf, self.ws, self.x
        k2 = self.k2[down]
        shared = (
            len(self.group_lo), k2, self.weights[t0:t1].data_ptr(), WEIGHT_DTYPES[self.weights.dtype],
            ws.partials.data_ptr(), ws.partials.numel(), ws.counters.data_ptr(), ws.counters.numel(),
        )  # fmt: skip
        tail = (
            self.top_k, x.shape[1], x.stride(0), self.inter if down else self.hidden_stored,
            self.hidden_stored if down else self.inter, self.codebook, int(x.dtype == torch.bfloat16),
        )  # fmt: skip
        head = (down, int(self.gated), x[t0:t1].data_ptr(), self.gu.data_ptr(), self.y.data_ptr())
        plan = (buf.sorted.data_ptr(), buf.offsets.data_ptr(), buf.work.data_ptr(), buf.group_work.data_ptr())
        if self.tc:
            code = self.lib.qp_moe_tc_gemm(
                *head, buf.xh.data_ptr(), buf.xh.numel(), self.tables.data_ptr(), self.experts,
                buf.slot_of.data_ptr(), *plan, *shared,
                slots, group_items(slots, self.experts, TC_ITEM_ROWS), TC_ITEM_ROWS, *tail,
                ws.target_ctas_wide, self.stream,
            )  # fmt: skip
        else:
            code = self.lib.qp_moe_gemm(
                *head, self.tables.data_ptr(), self.experts, *plan, *shared,
                group_items(slots, self.experts), *tail, ws.target_ctas, self.stream,
            )  # fmt: skip
        path = "tensor-core " if self.tc else ""
        check(code, f"{path}{'down' if down else 'gate/up'} of {len(k2)} K group(s) ({slots} picks, K {list(k2)})")


define_op(
    "trellis_moe_",
    GROUPED_OP_SCHEMA,
    {"CUDA": run_trellis_moe},
)


def trellis_moe_(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    perm: torch.Tensor,
    tables: torch.Tensor,
    w13_trellis: torch.Tensor,
    w2_trellis: torch.Tensor,
    w13_suh: torch.Tensor,
    w13_svh: torch.Tensor,
    w2_suh: torch.Tensor,
    w2_svh: torch.Tensor,
    codebook: int,
    layer_experts: int,
    group_lo: list[int],
    group_hi: list[int],
    k_gu: list[float],
    k_d: list[float],
    out: torch.Tensor,
) -> None:
    """One MoE layer's routed experts through the trellis_mma grouped kernels:
    ``out[t] = sum_j w[t, j] * (silu(x[t] W1_e) * (x[t] W3_e)) W2_e`` over the token's picks ``e = ids[t, j]`` this
    rank holds; for an ungated bank (``w13_suh`` of one entry per slot) ``relu(x[t] W1_e)² W2_e``.

    Args:
        x: ``(T, hidden)`` float16 / bfloat16 activations (zero-extended to the stored hidden size in the kernel).
        topk_ids: ``(T, top_k)`` int32 / int64 expert ids, -1 for an expert another tensor-parallel rank holds.
        topk_weights: ``(T, top_k)`` float32 / float16 / bfloat16 routing weights.
        perm, tables, w13_trellis ... w2_svh, codebook, layer_experts, group_lo ... k_d: as
            :func:`quantpack_core.moe.grouped_inputs` gives them (the bank tensors keep the tables' pointers alive;
            ``layer_experts`` sets the path, :func:`uses_tensor_cores`).
        out: ``(T, hidden)`` in ``x``'s dtype, written in place.

    Raises:
        quantpack_core.trellis_mma.library.LibraryError: no buffers reserved on this GPU, unsupported dtypes,
            or a launch failed (the message names the step).

    Source: docs/moe-bank.md; ``csrc/moe.cu``.
    """
    torch.ops.quantpack.trellis_moe_(
        x, topk_ids, topk_weights, perm, tables, w13_trellis, w2_trellis, w13_suh, w13_svh, w2_suh, w2_svh,
        codebook, layer_experts, group_lo, group_hi, k_gu, k_d, out,
    )  # fmt: skip
