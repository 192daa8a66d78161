"""The trellis_mma kernels' expert-bank op, ``quantpack::trellis_moe_``: one MoE layer's trellis experts over the routed
tokens through the grouped kernels of ``csrc/moe.cu`` (the sort launch, one gate/up and one down launch for
every K group of the bank, each CTA at its work item's K, the reduction), and the per-GPU buffers those launches
share.

The buffers (allocated when a bank is prepared, before any CUDA-graph capture; widened by a later, larger bank) hold
one chunk of :data:`SLOTS` picks: the sort's arrays, the gate / up outputs (fp16) and the weighted down rows (fp32).
A call of more tokens runs in chunks of ``SLOTS // top_k`` tokens (a loop whose length depends on the token count
only). The split-K partials and counters are the linear kernels' workspace (:func:`.ops.reserve`).

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

#: picks (token x choice) one chunk of launches sorts: bounds every buffer below
SLOTS = 2048
#: rows of one work item (MOE_ROWS in csrc/moe.cu)
ITEM_ROWS = 16
#: K groups one bank may have (MOE_MAX_GROUPS)
MAX_GROUPS = 16
#: slots one bank may have: the sort kernel keeps 4 ints per slot in 48 KiB of shared memory
MAX_EXPERTS = 3000
WEIGHT_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def group_items(slots: int, group_slots: int) -> int:
    """Work items ``group_slots`` consecutive slots (a K group, or a whole bank: the extent of its one launch per
    projection) can have for ``slots`` picks at most (``qp_moe_items``): one per non-empty slot beyond its share of
    whole 16-row items."""
    return min(group_slots, slots) + -(-slots // ITEM_ROWS)


@dataclass
class MoeBuffers:
    """One GPU's buffers for ``quantpack::trellis_moe_`` (shapes for :data:`SLOTS` picks).

    Attributes:
        slot_of, sorted: int32 ``(SLOTS,)``: each pick's slot (-1: another rank's expert); picks in slot order.
        offsets: int32 ``(experts + 1,)``.
        work: int32 ``(2 * items,)``: (slot, first row) per work item.
        group_work: int32 ``(MAX_GROUPS + 1,)``.
        gu: float16 ``(SLOTS, 2 * intermediate)``; y: float32 ``(SLOTS, hidden)`` (stored sizes).
    """

    slot_of: torch.Tensor
    sorted: torch.Tensor
    offsets: torch.Tensor
    work: torch.Tensor
    group_work: torch.Tensor
    gu: torch.Tensor
    y: torch.Tensor


_buffers: dict[int, MoeBuffers] = {}
#: buffers a wider bank replaced: kept alive, since a CUDA graph captured before may still read them
_retired: list[MoeBuffers] = []


def reserve_moe(device: torch.device, experts: int, hidden: int, intermediate: int) -> MoeBuffers:
    """The MoE buffers of ``device``, created or widened for a bank of ``experts`` slots and stored ``hidden`` /
    ``intermediate`` sizes (call at load), and the linear workspace the launches share.

    Raises:
        quantpack_core.trellis_mma.library.LibraryError: the kernels cannot be built or loaded for this GPU.
    """
    reserve(device, max(hidden, intermediate))
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    dev = f"cuda:{index}"
    have = _buffers.get(index)
    items = experts + MAX_GROUPS * -(-SLOTS // ITEM_ROWS)
    if (
        have is None
        or have.offsets.numel() < experts + 1
        or have.work.numel() < 2 * items
        or have.gu.shape[1] < 2 * intermediate
        or have.y.shape[1] < hidden
    ):
        experts = max(experts, 0 if have is None else have.offsets.numel() - 1)
        items = experts + MAX_GROUPS * -(-SLOTS // ITEM_ROWS)
        inter = max(intermediate, 0 if have is None else have.gu.shape[1] // 2)
        hid = max(hidden, 0 if have is None else have.y.shape[1])
        i32 = dict(dtype=torch.int32, device=dev)
        if have is not None:
            _retired.append(have)
        have = MoeBuffers(
            slot_of=torch.empty(SLOTS, **i32),
            sorted=torch.empty(SLOTS, **i32),
            offsets=torch.empty(experts + 1, **i32),
            work=torch.empty(2 * items, **i32),
            group_work=torch.empty(MAX_GROUPS + 1, **i32),
            gu=torch.empty((SLOTS, 2 * inter), dtype=torch.float16, device=dev),
            y=torch.empty((SLOTS, hid), dtype=torch.float32, device=dev),
        )
        _buffers[index] = have
    return have


def run_trellis_moe(
    x, topk_ids, topk_weights, perm, tables, w13_trellis, w2_trellis, w13_suh, w13_svh, w2_suh, w2_svh,
    codebook: int, group_lo: list[int], group_hi: list[int], k_gu: list[float], k_d: list[float], out,
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
    lib = load(ws.arch)
    stream = torch.cuda.current_stream(device).cuda_stream
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = topk_ids.contiguous()
    weights = topk_weights.contiguous()
    lo = (ctypes.c_int * len(group_lo))(*group_lo)
    k2_gu = (ctypes.c_int * len(group_lo))(*(round(2 * k) for k in k_gu))  # 2K of each group, host arrays
    k2_d = (ctypes.c_int * len(group_lo))(*(round(2 * k) for k in k_d))
    gu, y = buf.gu[:, : (2 if gated else 1) * inter], buf.y[:, :hidden_stored]
    chunk = SLOTS // top_k
    for t0 in range(0, tokens, chunk):
        t1 = min(t0 + chunk, tokens)
        slots = (t1 - t0) * top_k
        code = lib.qp_moe_sort(
            ids[t0:t1].data_ptr(), int(ids.dtype == torch.int64), perm.data_ptr(), slots, experts, lo, len(group_lo),
            buf.slot_of.data_ptr(), buf.offsets.data_ptr(), buf.sorted.data_ptr(), buf.work.data_ptr(),
            buf.group_work.data_ptr(), stream,
        )  # fmt: skip
        check(code, f"sort of {slots} picks over {experts} experts")
        for down, k2 in ((0, k2_gu), (1, k2_d)):
            code = lib.qp_moe_gemm(
                down, int(gated), x[t0:t1].data_ptr(), gu.data_ptr(), y.data_ptr(), tables.data_ptr(), experts,
                buf.sorted.data_ptr(), buf.offsets.data_ptr(), buf.work.data_ptr(), buf.group_work.data_ptr(),
                len(group_lo), k2, weights[t0:t1].data_ptr(), WEIGHT_DTYPES[weights.dtype],
                ws.partials.data_ptr(), ws.partials.numel(), ws.counters.data_ptr(), ws.counters.numel(),
                group_items(slots, experts), top_k, x.shape[1], x.stride(0),
                inter if down else hidden_stored, hidden_stored if down else inter,
                codebook, int(x.dtype == torch.bfloat16), ws.target_ctas, stream,
            )  # fmt: skip
            check(code, f"{'down' if down else 'gate/up'} of {len(group_lo)} K group(s) ({slots} picks, K {list(k2)})")
        code = lib.qp_moe_reduce(
            y.data_ptr(), buf.slot_of.data_ptr(), out[t0:t1].data_ptr(), t1 - t0, top_k, hidden_stored, hidden,
            out.stride(0), int(out.dtype == torch.bfloat16), stream,
        )  # fmt: skip
        check(code, f"reduce of {t1 - t0} tokens")


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
        perm, tables, w13_trellis ... w2_svh, codebook, group_lo ... k_d: as
            :func:`quantpack_core.moe.grouped_inputs` gives them (the bank tensors keep the tables' pointers alive).
        out: ``(T, hidden)`` in ``x``'s dtype, written in place.

    Raises:
        quantpack_core.trellis_mma.library.LibraryError: no buffers reserved on this GPU, unsupported dtypes,
            or a launch failed (the message names the step).

    Source: docs/moe-bank.md; ``csrc/moe.cu``.
    """
    torch.ops.quantpack.trellis_moe_(
        x, topk_ids, topk_weights, perm, tables, w13_trellis, w2_trellis, w13_suh, w13_svh, w2_suh, w2_svh,
        codebook, group_lo, group_hi, k_gu, k_d, out,
    )  # fmt: skip
