"""The CUDA implementation of ``quantpack::exl3_moe_``: an EXL3 expert bank through exllamav3's multi-matrix kernels
(``exl3_mgemm``), one launch per K group and projection, or, for large eager batches, expert by expert.

Source: exllamav3 1.6.5, ``exllamav3/modules/block_sparse_mlp.py`` (``BlockSparseMLP.forward``) and
``exllamav3_ext/quant/exl3_gemm.cu`` (``exl3_mgemm``: expert pointer tables, index filtering, weighted reduction).
"""

from __future__ import annotations

import torch

from quantpack_core.codec.trellis import width_from_k
from quantpack_core.moe import bank_layout
from quantpack_core.moe.reference import relu2

from .extension import load_extension
from .gemm import run_exl3_gemm

#: above this many slots, and outside CUDA-graph capture, experts run one by one over their gathered tokens (each
#: expert decoded once per call) instead of once per slot
GROUPED_MIN_SLOTS = 1024


def _act(gate: torch.Tensor, up: torch.Tensor | None) -> torch.Tensor:
    """The down projection's fp16 input: ``silu(gate) * up``, or ``relu(gate)²`` for ungated experts (up None)."""
    if up is None:
        return relu2(gate.float()).to(torch.float16)
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(torch.float16)


def _moe_slots(xh, ids, weights, tables, mcg, mul1, groups, inter, gated, acc) -> None:
    """Per-slot path: every (token, expert) pick is one matrix of a batched exl3_mgemm (graph-safe, no host sync)."""
    ext = load_extension()
    tokens, top_k = ids.shape
    hidden = xh.shape[1]
    slots = tokens * top_k
    a = xh.repeat_interleave(top_k, dim=0).unsqueeze(1)  # (S, 1, H): slot j reads its token's row
    flat_ids = ids.reshape(1, -1)
    w = weights.reshape(1, -1)
    ah_in = torch.empty((slots, 1, hidden), dtype=torch.float16, device=xh.device)
    ah_mid = torch.empty((slots, 1, inter), dtype=torch.float16, device=xh.device)
    g = torch.empty((slots, 1, inter), dtype=torch.float16, device=xh.device)
    u = torch.empty_like(g) if gated else None
    c = torch.empty((slots, 1, hidden), dtype=torch.float32, device=xh.device)
    for lo, hi, k_gu, k_d in groups:
        tab = tables[:, lo:hi]
        if len(groups) == 1:
            idx = flat_ids
        else:
            # the group's slots index its own table slice; every other slot gets -1, which the kernel skips (no
            # product, and left out of the weighted sum of its token; a token whose slots are all -1 gets a zero
            # row of c: test_exl3_gpu_moe.py's absent-expert cases check both on exllamav3 1.6.5)
            idx = torch.where((flat_ids >= lo) & (flat_ids < hi), flat_ids - lo, -1)
        ext.exl3_mgemm(a, tab[0], g, tab[1], ah_in, tab[2], idx, None, k_gu, -1, mcg, mul1, -1, -1, 0, 1)
        if gated:
            ext.exl3_mgemm(a, tab[3], u, tab[4], ah_in, tab[5], idx, None, k_gu, -1, mcg, mul1, -1, -1, 0, 1)
        # down: each slot scaled by its routing weight, and each token's k slots summed into row t of c
        ext.exl3_mgemm(_act(g, u), tab[6], c, tab[7], ah_mid, tab[8], idx, w, k_d, -1, mcg, mul1, -1, -1, 0, tokens)
        acc += c[:tokens, 0]


def _slot_tensors(bank: dict[str, torch.Tensor], groups, hidden: int, inter: int, gated: bool):
    """Per physical slot: ``(gate, up, down, k_gu, k_d)`` with each projection as ``(trellis, suh, svh)`` views of
    the bank, at the offsets :func:`quantpack_core.moe.bank_layout` gives the plan (``up`` None when ungated)."""
    slot_bits = [(k_gu, k_d) for lo, hi, k_gu, k_d in groups for _ in range(lo, hi)]
    words13, words2, off1, off3, off2 = bank_layout(slot_bits, hidden, inter, gated=gated)
    t13, t2 = bank["w13_trellis"], bank["w2_trellis"]
    out = []
    for slot, (k_gu, k_d) in enumerate(slot_bits):
        gu_shape = (hidden // 16, inter // 16, width_from_k(k_gu))
        w1 = t13[off1[slot] : off1[slot] + words13[slot]].view(gu_shape)
        gate = (w1, bank["w13_suh"][slot, 0], bank["w13_svh"][slot, 0])
        up = None
        if gated:
            w3 = t13[off3[slot] : off3[slot] + words13[slot]].view(gu_shape)
            up = (w3, bank["w13_suh"][slot, 1], bank["w13_svh"][slot, 1])
        down_trellis = t2[off2[slot] : off2[slot] + words2[slot]].view(inter // 16, hidden // 16, width_from_k(k_d))
        down = (down_trellis, bank["w2_suh"][slot], bank["w2_svh"][slot])
        out.append((gate, up, down, k_gu, k_d))
    return out


def _moe_grouped(xh, ids, weights, slot_tensors, codebook: int, inter: int, acc) -> None:
    """Per-expert path for large batches outside graph capture: gather each expert's tokens, three GEMMs each."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # picks of -1 (experts of other ranks) sort first and are skipped
    counts = torch.bincount(flat + 1, minlength=len(slot_tensors) + 1).tolist()  # the one host sync of this path
    tok_sorted = order // top_k
    w_sorted = weights.reshape(-1)[order].float()
    hidden = acc.shape[1]
    start = counts[0]
    for slot, count in enumerate(counts[1:]):
        if count == 0:
            continue
        tok = tok_sorted[start : start + count]
        rows = xh.index_select(0, tok)
        gate, up, down, k_gu, k_d = slot_tensors[slot]
        g = torch.empty((count, inter), dtype=torch.float16, device=xh.device)
        run_exl3_gemm(rows, *gate, codebook, k_gu, inter, g, 0)
        u = None
        if up is not None:
            u = torch.empty_like(g)
            run_exl3_gemm(rows, *up, codebook, k_gu, inter, u, 0)
        y = torch.empty((count, hidden), dtype=torch.float32, device=xh.device)
        run_exl3_gemm(_act(g, u), *down, codebook, k_d, hidden, y, 0)
        acc.index_add_(0, tok, y * w_sorted[start : start + count, None])
        start += count


def run_exl3_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    perm: torch.Tensor,
    tables: torch.Tensor,
    bank: dict[str, torch.Tensor],
    codebook: int,
    group_lo: list[int],
    group_hi: list[int],
    k_gu: list[float],
    k_d: list[float],
    out: torch.Tensor,
) -> None:
    """The CUDA implementation of ``quantpack::exl3_moe_`` (see :func:`.ops.exl3_moe_`).

    Up to :data:`GROUPED_MIN_SLOTS` slots (``T * top_k``), and always during CUDA-graph capture, each slot is one
    matrix of ``exl3_mgemm``: per K group, a gate launch and an up launch (fp16 outputs), SiLU(gate) * up (ungated
    experts, ``w13_suh`` of one entry per slot: the gate launch alone and relu(gate)²), and a down
    launch whose kernel weights each slot by its routing weight and sums each token's slots (fp32). A bank of several
    K groups runs each group over all slots, with the expert index of every slot outside the group set to -1 (the
    kernel skips such slots; the kernel's own index-range filter is not used). Shapes depend only on ``T``: nothing
    is synchronized with the host. Larger eager batches run expert by expert over the expert's gathered tokens (one
    host sync for the counts), so each expert is decoded once per call. A pick of id -1 (an expert another
    tensor-parallel rank holds) maps through ``perm``'s last entry to slot -1 and is skipped on both paths.
    """
    tokens = x.shape[0]
    if tokens == 0:
        return
    groups = list(zip(group_lo, group_hi, k_gu, k_d, strict=True))
    hidden = out.shape[1]
    hidden_stored = bank["w13_suh"].shape[2]
    inter = bank["w2_suh"].shape[1]
    gated = bank["w13_suh"].shape[1] == 2
    # ids are >= 0 or -1 (the method's expert-split map emits no other negative): -1 indexes perm's trailing -1
    ids = perm[topk_ids.long()]
    weights = topk_weights.to(torch.float16)
    xh = x.to(torch.float16)
    if hidden_stored != hidden:  # a padded layer: zero-extend the input to the stored width
        xh = torch.nn.functional.pad(xh, (0, hidden_stored - hidden))
    acc = torch.zeros((tokens, hidden_stored), dtype=torch.float32, device=x.device)
    if ids.numel() > GROUPED_MIN_SLOTS and not torch.cuda.is_current_stream_capturing():
        slot_tensors = _slot_tensors(bank, groups, hidden_stored, inter, gated)
        _moe_grouped(xh, ids, weights, slot_tensors, codebook, inter, acc)
    else:
        _moe_slots(xh, ids, weights, tables, int(codebook == 1), int(codebook == 2), groups, inter, gated, acc)
    out.copy_(acc[:, :hidden])
