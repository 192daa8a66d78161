"""The project's registered custom ops (namespace ``quantpack``), one per kernel call, each with a fake
implementation so torch.compile traces through it with exact shapes and no graph break.

Every op writes one shard's result into its columns of the layer's preallocated output (``out[:, col:col + n]``,
``out`` mutated in place), so a fused layer needs no concatenation of per-shard results. The ops are defined on a
private ``torch.library.Library`` rather than vLLM's shared one, so that importing this module needs no vLLM
platform, and defining them twice (vLLM loads plugins in every process, sometimes twice) is a no-op. Follows
vLLM's ``vllm/utils/torch_utils.py::direct_register_custom_op`` (define + impl + ``_register_fake``, without
``torch.library.custom_op``'s dispatch overhead).

* ``exl3_reference_gemm_``: plain torch, every device (``CompositeExplicitAutograd``).
* ``exl3_gemm_``: exllamav3's CUDA kernels (``CUDA`` only), see :mod:`quantpack_exl3.backends.exllamav3`.
"""

from __future__ import annotations

import torch

NAMESPACE = "quantpack"

_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")  # kept alive for the life of the process


def _define(name: str, schema: str, impls: dict[str, object], fake) -> None:
    """Define ``quantpack::<name>`` once per process, with one implementation per dispatch key."""
    if hasattr(getattr(torch.ops, NAMESPACE), name):
        return
    _LIB.define(f"{name}{schema}")
    for key, impl in impls.items():
        _LIB.impl(name, impl, key)
    _LIB._register_fake(name, fake)


def _no_result(*args, **kwargs) -> None:
    return None


# --------------------------------------------------------------------------------------------- reference GEMM


def _reference_gemm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, col: int) -> None:
    out.narrow(1, col, weight.shape[1]).copy_(torch.mm(x, weight))


_define(
    "exl3_reference_gemm_",
    "(Tensor x, Tensor weight, Tensor(a!) out, int col) -> ()",
    {"CompositeExplicitAutograd": _reference_gemm},
    _no_result,
)


def exl3_reference_gemm_(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, col: int) -> None:
    """One shard through the reference backend: ``out[:, col:col + out_features] = x @ W``.

    Args:
        x: ``(rows, in)`` activations, the model dtype.
        weight: ``(in, out_features)`` dense weight (an EXL3 shard dequantized at load by the core codec, or a dense
            shard), same dtype and device as ``x``.
        out: ``(rows, total)`` layer output, written in place.
        col: first output column of this shard.

    Source: ``quantpack_core.codec.dequantize`` (docs/exl3-format.md, step 5).
    """
    torch.ops.quantpack.exl3_reference_gemm_(x, weight, out, col)


# ------------------------------------------------------------------------------------------ exllamav3 GEMM


def _exl3_gemm_cuda(x, trellis, suh, svh, codebook: int, k_bits: float, out_features: int, out, col: int) -> None:
    from .backends.exllamav3 import run_exl3_gemm

    run_exl3_gemm(x, trellis, suh, svh, codebook, k_bits, out_features, out, col)


_define(
    "exl3_gemm_",
    "(Tensor x, Tensor trellis, Tensor suh, Tensor svh, int codebook, float k_bits, int out_features, "
    "Tensor(a!) out, int col) -> ()",
    {"CUDA": _exl3_gemm_cuda},
    _no_result,
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


# ------------------------------------------------------------------------------------------------ MoE: reference


def _reference_moe(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, out
) -> None:
    inter = w2.shape[1]
    ids = topk_ids.reshape(x.shape[0], -1).long()
    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    for e in ids.unique().tolist():  # the op is opaque to torch.compile: a data-dependent loop is fine here
        if e < 0:  # an expert another tensor-parallel rank holds
            continue
        tok, j = (ids == e).nonzero(as_tuple=True)
        h = x[tok] @ w13[e]
        a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        acc.index_add_(0, tok, (a @ w2[e]).float() * topk_weights[tok, j, None].float())
    out.copy_(acc)


_define(
    "exl3_moe_reference_",
    "(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w2, Tensor(a!) out) -> ()",
    {"CompositeExplicitAutograd": _reference_moe},
    _no_result,
)


def exl3_moe_reference_(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Routed experts through the reference backend: ``out[t] = sum_j w[t, j] * (silu(x W1) * (x W3)) W2`` of expert
    ``topk_ids[t, j]``, over the picks whose id is not -1.

    Args:
        x: ``(T, H)`` activations, the model dtype.
        topk_ids: ``(T, top_k)`` expert ids of the bank, or -1 for a pick this bank does not hold (an expert of
            another tensor-parallel rank; it adds nothing); topk_weights: ``(T, top_k)`` routing weights.
        w13: ``(E, H, 2I)`` dense ``[W1 | W3]`` per expert (dequantized at load), x's dtype.
        w2: ``(E, I, H)`` dense ``W2`` per expert.
        out: ``(T, H)``, written in place (sums accumulate in float32).

    Source: exllamav3 ``BlockSparseMLP.forward`` (per-expert gate / up / down, weighted sum);
    ``quantpack_core.moe.reference_moe_forward`` is the float64 oracle of the same sum.
    """
    torch.ops.quantpack.exl3_moe_reference_(x, topk_ids, topk_weights, w13, w2, out)


# ------------------------------------------------------------------------------------------------ MoE: exllamav3


def _exl3_moe_cuda(
    x, topk_ids, topk_weights, perm, tables, w13_trellis, w2_trellis, w13_suh, w13_svh, w2_suh, w2_svh,
    codebook: int, group_lo, group_hi, k_gu, k_d, out,
) -> None:  # fmt: skip
    from .backends.exllamav3 import run_exl3_moe

    bank = {
        "w13_trellis": w13_trellis, "w2_trellis": w2_trellis, "w13_suh": w13_suh, "w13_svh": w13_svh,
        "w2_suh": w2_suh, "w2_svh": w2_svh,
    }  # fmt: skip
    run_exl3_moe(x, topk_ids, topk_weights, perm, tables, bank, codebook, group_lo, group_hi, k_gu, k_d, out)


_define(
    "exl3_moe_",
    "(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor perm, Tensor tables, Tensor w13_trellis, "
    "Tensor w2_trellis, Tensor w13_suh, Tensor w13_svh, Tensor w2_suh, Tensor w2_svh, int codebook, int[] group_lo, "
    "int[] group_hi, float[] k_gu, float[] k_d, Tensor(a!) out) -> ()",
    {"CUDA": _exl3_moe_cuda},
    _no_result,
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
    group_lo: list[int],
    group_hi: list[int],
    k_gu: list[float],
    k_d: list[float],
    out: torch.Tensor,
) -> None:
    """Routed experts of an EXL3 bank through exllamav3's multi-matrix kernels (``exl3_mgemm``), one launch per
    K group and projection; see :func:`quantpack_exl3.backends.exllamav3.run_exl3_moe`.

    Args:
        x: ``(T, hidden)`` activations (cast to fp16 for the kernels, zero-extended to the stored width).
        topk_ids, topk_weights: ``(T, top_k)`` expert ids of the bank (or -1: an expert another tensor-parallel rank
            holds; the pick adds nothing) and routing weights.
        perm: int64 ``(E + 1,)`` expert id -> physical slot of the bank, then -1 (what id -1 indexes).
        tables: int64 ``(9, E)`` device pointers per slot: gate trellis / suh / svh, up ..., down ... (rows in that
            order), from :meth:`quantpack_core.moe.Exl3MoeBank.pointer_tables`.
        w13_trellis ... w2_svh: the bank's six tensors (see :mod:`quantpack_core.moe`); the tables point into them.
        codebook: 0 = 3INST, 1 = mcg, 2 = mul1.
        group_lo, group_hi, k_gu, k_d: the bank's K groups (slot ranges and their K).
        out: ``(T, hidden)``, written in place.

    Source: exllamav3 ``BlockSparseMLP.forward`` and ``exllamav3_ext/quant/exl3_gemm.cu`` (``exl3_mgemm``: expert
    pointer tables, index filtering by slot range, weighted per-token reduction).
    """
    torch.ops.quantpack.exl3_moe_(
        x, topk_ids, topk_weights, perm, tables, w13_trellis, w2_trellis, w13_suh, w13_svh, w2_suh, w2_svh,
        codebook, group_lo, group_hi, k_gu, k_d, out,
    )  # fmt: skip
