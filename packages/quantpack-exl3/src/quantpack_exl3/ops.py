"""The project's registered custom ops (namespace ``quantpack``), one per kernel call, each with a fake
implementation so torch.compile traces through it with exact shapes and no graph break.

The ops are defined on a private ``torch.library.Library`` rather than vLLM's shared one, so that importing this
module needs no vLLM platform and registering twice (vLLM loads plugins in every process, sometimes twice) is a no-op.
Their eager implementations are plain torch, registered for ``CompositeExplicitAutograd`` (every device). Follows
vLLM's ``vllm/utils/torch_utils.py::direct_register_custom_op`` (define + impl + ``_register_fake``, no
``torch.library.custom_op`` dispatch overhead).
"""

from __future__ import annotations

import torch

NAMESPACE = "quantpack"

_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")  # kept alive for the life of the process
_DEFINED: set[str] = set()


def _define(name: str, schema: str, impl, fake) -> None:
    """Define ``quantpack::<name>`` once per process."""
    if name in _DEFINED or hasattr(getattr(torch.ops, NAMESPACE), name):
        _DEFINED.add(name)
        return
    _LIB.define(f"{name}{schema}")
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    _LIB._register_fake(name, fake)
    _DEFINED.add(name)


def _reference_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.mm(x, weight)


def _reference_gemm_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[1]))


_define("exl3_reference_gemm", "(Tensor x, Tensor weight) -> Tensor", _reference_gemm, _reference_gemm_fake)


def exl3_reference_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One EXL3 shard through the reference backend: ``x @ W`` with ``W`` the shard's weight as the core codec
    dequantized it at load (Hadamard transforms and suh/svh folded in, padding trimmed).

    Args:
        x: ``(rows, in)`` activations, the model dtype.
        weight: ``(in, out)`` dense weight, same dtype and device.

    Returns:
        ``(rows, out)`` tensor of ``x``'s dtype.

    Source: ``quantpack_core.codec.dequantize`` (docs/exl3-format.md step 5).
    """
    return torch.ops.quantpack.exl3_reference_gemm(x, weight)
