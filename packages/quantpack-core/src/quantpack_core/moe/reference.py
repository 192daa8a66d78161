"""The float64 reference forward of one expert bank: each routed expert dequantized by the core codec, the routed,
weighted sum of ``down(act(gate(x)) * up(x))`` (ungated experts: ``down(act(gate(x)))``). A test oracle (each
expert decoded once per call), not a fast path.

Follows exllamav3 ``exllamav3/modules/block_sparse_mlp.py`` (``BlockSparseMLP.forward``) and docs/moe-bank.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..codec.exl3 import dequantize
from .bank import Exl3MoeBank
from .plan import PIECE_KINDS


def dequantize_expert(
    bank: Exl3MoeBank, expert: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Dense weights of this rank's part of one expert, decoded from the bank with the core codec.

    Args:
        bank: a loaded bank.
        expert: logical expert id.
        dtype: compute and result dtype (float32 or float64).

    Returns:
        ``(W1, W3, W2)`` with ``W1, W3`` of shape ``(H, I_loc)`` and ``W2`` of shape ``(I_loc, H)``, in ``y = x @ W``
        layout (see :func:`~quantpack_core.codec.dequantize`); ``W3`` is None for an ungated expert.

    Raises:
        CodecError: a vector holding NaN or infinities (e.g. a piece never loaded).

    Source: quantpack_core.codec.dequantize over the bank's per-expert views (docs/moe-bank.md).
    """
    return tuple(None if t is None else dequantize(t, dtype) for t in bank.expert_tensors(expert))  # type: ignore[return-value]


def relu2(x: torch.Tensor) -> torch.Tensor:
    """``relu(x)²``: Nemotron-H's expert activation (vLLM's ``relu2_no_mul``, applied without an up projection)."""
    return torch.relu(x).square()


#: activations by name: ``silu`` of gated experts (exllamav3's and vLLM's default), ``relu2`` of ungated ones
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": torch.nn.functional.silu, "relu2": relu2}


def reference_moe_forward(
    bank: Exl3MoeBank,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    activation: str | Callable[[torch.Tensor], torch.Tensor] | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Dense reference of the routed experts of one layer on this rank: for each token t,
    ``y[t] = sum_j topk_weights[t, j] * (act(x[t] @ W1) * (x[t] @ W3)) @ W2`` with ``W*`` of expert ``topk_ids[t, j]``
    dequantized from the bank (:func:`dequantize_expert`); for an ungated bank ``act(x[t] @ W1) @ W2``.

    On a rank of ``tp_size > 1`` this is the rank's partial sum: the sum over all ranks (vLLM's all-reduce) is the
    full layer's output. Each expert used is decoded once per call, so this is a test oracle, not a fast path.

    Args:
        bank: a loaded bank.
        x: ``(T, H)`` activations (``H`` the stored hidden size), any floating dtype.
        topk_ids: ``(T, k)`` integer logical expert ids in ``[0, E)``; a token may list an expert more than once.
        topk_weights: ``(T, k)`` routing weights (already normalized / scaled as the model wants).
        activation: a name of :data:`ACTIVATIONS` or a callable applied to the gate; None: ``"silu"`` for a gated bank,
            ``"relu2"`` for an ungated one.
        dtype: compute and result dtype (float64 for an oracle).

    Returns:
        ``(T, H)`` tensor of ``dtype`` on ``x``'s device.

    Raises:
        ValueError: shapes that do not match (``x`` not ``(T, H)``, ids and weights not both ``(T, k)``), an expert id
            out of range, an unknown activation name, or a bank with pieces never loaded (:meth:`Exl3MoeBank.missing`).
        CodecError: an expert whose vectors hold NaN or infinities (e.g. never loaded).

    Source: exllamav3 ``exllamav3/modules/block_sparse_mlp.py`` (``BlockSparseMLP.forward``: per selected expert,
    ``down(act(gate(x)) * up(x))`` times the routing weight, summed); docs/moe-bank.md for the per-rank part.
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
    missing = [m for m in bank.missing() if m[2] in PIECE_KINDS]  # a codebook marker is only checked, never stored
    if missing:
        listing = ", ".join(f"expert {e} {proj}.{kind}" for e, proj, kind in missing[:4])
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise ValueError(f"{where}: the bank was never given {listing}{more}: load every piece first")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"{where}: topk_ids must be integers, got {topk_ids.dtype}")
    if activation is None:
        activation = "silu" if plan.gated else "relu2"
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
        w1, w3, w2 = (None if w is None else w.to(x.device) for w in dequantize_expert(bank, e, dtype))
        xe = xf[tok]
        h = act(xe @ w1) if w3 is None else act(xe @ w1) * (xe @ w3)
        out.index_add_(0, tok, (h @ w2) * wts[tok, j, None])
    return out
