"""The CUDA implementation of ``quantpack::exl3_gemm_``: one EXL3 shard through exllamav3's kernels, following
exllamav3's ``LinearEXL3.forward`` policy: up to 144 rows the fused EXL3 GEMM (input Hadamard, trellis decode and
matmul, output Hadamard in one kernel), above that the trellis is reconstructed to a dense fp16 matrix and multiplied
with cuBLAS between the two Hadamard transforms.

Activations enter the kernels as fp16 (the kernels take nothing else). Outputs are accumulated into fp32 for
bf16 / fp32 models (fp16 for fp16 models) and written into the layer's output columns in the model dtype.

Source: exllamav3 1.6.5, ``exllamav3/modules/quant/exl3.py`` and ``exllamav3_ext/quant/exl3_gemm.cu``.
"""

from __future__ import annotations

import torch

from .extension import load_extension

#: rows up to which the fused EXL3 GEMM runs; above, reconstruct + cuBLAS (exllamav3's AUTO_RECONSTRUCT_THRESHOLD)
AUTO_RECONSTRUCT_THRESHOLD = 144


def run_exl3_gemm(
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
    """The CUDA implementation of ``quantpack::exl3_gemm_`` (see :func:`.ops.exl3_gemm_`)."""
    ext = load_extension()
    rows, width = x.shape
    if rows == 0:
        return
    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
    mcg, mul1 = codebook == 1, codebook == 2
    if width == k:
        a = x.to(torch.float16).contiguous()
    else:  # a padded layer: zero-extend the input to the stored width
        a = torch.zeros((rows, k), dtype=torch.float16, device=x.device)
        a[:, :width].copy_(x)
    c_dtype = torch.float16 if out.dtype == torch.float16 else torch.float32
    if rows <= AUTO_RECONSTRUCT_THRESHOLD:
        target = out.narrow(1, col, out_features)
        direct = c_dtype == out.dtype and n == out_features and target.is_contiguous()
        c = target if direct else torch.empty((rows, n), dtype=c_dtype, device=x.device)
        ext.exl3_gemm(a, trellis, c, suh, torch.empty_like(a), svh, -1, mcg, mul1, 0)
        if direct:
            return
    else:
        ah = torch.empty_like(a)
        ext.had_r_128(a, ah, suh, None, 1.0)
        w = torch.empty((k, n), dtype=torch.float16, device=x.device)
        ext.reconstruct(w, trellis, float(k_bits), mcg, mul1)
        c = torch.empty((rows, n), dtype=c_dtype, device=x.device)
        ext.hgemm_recon(ah, w, c)
        ext.had_r_128(c, c, None, svh, 1.0)
    out.narrow(1, col, out_features).copy_(c.narrow(1, 0, out_features))
