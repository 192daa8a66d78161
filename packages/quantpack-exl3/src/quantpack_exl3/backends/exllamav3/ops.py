"""The exllamav3 backend's custom ops, each with a fake implementation (:func:`quantpack_core.ops.define_op`):

* ``quantpack::exl3_gemm_``: one EXL3 shard into its columns of the layer's output (:mod:`.gemm`);
* ``quantpack::exl3_moe_``: an EXL3 expert bank over the routed tokens (:mod:`.moe`).

Both have a CUDA implementation only.
"""

from __future__ import annotations

import torch

from quantpack_core.moe import GROUPED_OP_SCHEMA
from quantpack_core.ops import define_op

from .gemm import run_exl3_gemm
from .moe import run_exl3_moe

define_op(
    "exl3_gemm_",
    "(Tensor x, Tensor trellis, Tensor suh, Tensor svh, int codebook, float k_bits, int out_features, "
    "Tensor(a!) out, int col) -> ()",
    {"CUDA": run_exl3_gemm},
)


def exl3_gemm_(
    x: torch.Tensor,
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: int,
    k_bits: float,
    out_features: int,
    out: torch.Tensor,
    col: int,
) -> None:
    """One EXL3 shard through exllamav3's kernels: ``out[:, col:col + out_features] = (x @ W)[:, :out_features]``.

    Args:
        x: ``(rows, in)`` activations (any float dtype; cast to fp16 for the kernels, zero-extended to k).
        trellis: int16 ``(k/16, n/16, 16*K)`` on the GPU.
        suh, svh: float16 ``(k,)``, ``(n,)``.
        codebook: 0 = 3INST, 1 = mcg, 2 = mul1.
        k_bits: bits per weight K.
        out_features: logical output width (<= n).
        out: ``(rows, total)`` layer output, written in place.
        col: first output column of this shard.

    Source: exllamav3's ``LinearEXL3.forward`` (``exllamav3/modules/quant/exl3.py``).
    """
    torch.ops.quantpack.exl3_gemm_(x, trellis, suh, svh, codebook, k_bits, out_features, out, col)


def _exl3_moe_cuda(
    x, topk_ids, topk_weights, perm, tables, w13_trellis, w2_trellis, w13_suh, w13_svh, w2_suh, w2_svh,
    codebook: int, layer_experts: int, group_lo, group_hi, k_gu, k_d, out,
) -> None:  # fmt: skip
    bank = {
        "w13_trellis": w13_trellis, "w2_trellis": w2_trellis, "w13_suh": w13_suh, "w13_svh": w13_svh,
        "w2_suh": w2_suh, "w2_svh": w2_svh,
    }  # fmt: skip
    run_exl3_moe(x, topk_ids, topk_weights, perm, tables, bank, codebook, group_lo, group_hi, k_gu, k_d, out)


define_op(
    "exl3_moe_",
    GROUPED_OP_SCHEMA,
    {"CUDA": _exl3_moe_cuda},
)


def exl3_moe_(
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
    """Routed experts of an EXL3 bank through exllamav3's multi-matrix kernels (``exl3_mgemm``), one launch per
    K group and projection; see :func:`.moe.run_exl3_moe`.

    Args:
        x: ``(T, hidden)`` activations (cast to fp16 for the kernels, zero-extended to the stored width).
        topk_ids, topk_weights: ``(T, top_k)`` expert ids of the bank (or -1: an expert another tensor-parallel rank
            holds; the pick adds nothing) and routing weights.
        perm: int64 ``(E + 1,)`` expert id -> physical slot of the bank, then -1 (what id -1 indexes).
        tables: int64 ``(9, E)`` device pointers per slot: gate trellis / suh / svh, up ..., down ... (rows in that
            order), from :func:`quantpack_core.moe.pointer_tables`.
        w13_trellis ... w2_svh: the bank's six tensors (see :mod:`quantpack_core.moe`); the tables point into them.
        codebook: 0 = 3INST, 1 = mcg, 2 = mul1.
        layer_experts: the layer's routed experts over all ranks (read by kernels that choose a path by picks per
            expert; exllamav3's launches do not).
        group_lo, group_hi, k_gu, k_d: the bank's K groups (slot ranges and their K).
        out: ``(T, hidden)``, written in place.

    Source: exllamav3 ``BlockSparseMLP.forward`` and ``exllamav3_ext/quant/exl3_gemm.cu`` (``exl3_mgemm``: expert
    pointer tables, index filtering by slot range, weighted per-token reduction).
    """
    torch.ops.quantpack.exl3_moe_(
        x, topk_ids, topk_weights, perm, tables, w13_trellis, w2_trellis, w13_suh, w13_svh, w2_suh, w2_svh,
        codebook, layer_experts, group_lo, group_hi, k_gu, k_d, out,
    )  # fmt: skip
