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
