"""The reference backend's custom op: routed experts over dense per-expert weights (``quantpack::exl3_moe_reference_``,
any device). Its linear shards run the shared dense GEMM (``quantpack::dense_gemm_``, :mod:`quantpack_core.dense`)
on the weight dequantized at load.
"""

from __future__ import annotations

import torch

from quantpack_core.moe.reference import relu2
from quantpack_core.ops import define_op


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
        if w13.shape[2] == inter:  # ungated experts: relu(x W1)^2
            a = relu2(h)
        else:
            a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        acc.index_add_(0, tok, (a @ w2[e]).float() * topk_weights[tok, j, None].float())
    out.copy_(acc)


define_op(
    "exl3_moe_reference_",
    "(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w2, Tensor(a!) out) -> ()",
    {"CompositeExplicitAutograd": _reference_moe},
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
    ``topk_ids[t, j]`` (ungated experts: ``relu(x W1)² W2``), over the picks whose id is not -1.

    Args:
        x: ``(T, H)`` activations, the model dtype.
        topk_ids: ``(T, top_k)`` expert ids of the bank, or -1 for a pick this bank does not hold (an expert of
            another tensor-parallel rank; it adds nothing); topk_weights: ``(T, top_k)`` routing weights.
        w13: ``(E, H, 2I)`` dense ``[W1 | W3]`` per expert (dequantized at load), x's dtype; ``(E, H, I)``, ``W1``
            alone, for ungated experts.
        w2: ``(E, I, H)`` dense ``W2`` per expert.
        out: ``(T, H)``, written in place (sums accumulate in float32).

    Source: exllamav3 ``BlockSparseMLP.forward`` (per-expert gate / up / down, weighted sum);
    ``quantpack_core.moe.reference_moe_forward`` is the float64 oracle of the same sum.
    """
    torch.ops.quantpack.exl3_moe_reference_(x, topk_ids, topk_weights, w13, w2, out)
