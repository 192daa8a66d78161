"""The int8-row codec of vocabulary tables (``quantpack embed-int8``'s ``qweight`` / ``scales``, escha's
``weight_int8`` / ``weight_scale``): one symmetric int8 row and one float32 scale per token. Plain torch.
Source: docs/architecture.md (quantpack_core's modules); :mod:`quantpack_core.embedding` converts packs with it.
"""

from __future__ import annotations

import torch


def quantize_rows(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 quantization.

    Args:
        table: ``(rows, width)`` floating tensor.

    Returns:
        ``(qweight, scales)``: int8 ``(rows, width)`` with values in [-127, 127] and float32 ``(rows,)`` with
        ``scales[i] = max |table[i]| / 127`` (1 for an all-zero row).
    """
    t = table.float()
    scales = t.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(t / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def dequantize_rows(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows back from int8: ``qweight * scales[:, None]`` in ``dtype`` (qweight ``(n, width)`` int8, scales
    ``(n,)``)."""
    return (qweight.to(dtype) * scales.to(dtype)[:, None]).to(dtype)
