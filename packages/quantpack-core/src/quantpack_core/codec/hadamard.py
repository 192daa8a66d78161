"""The 128-block Hadamard transform EXL3 applies on both sides of every weight.

``H`` is block-diagonal with 128x128 Sylvester Hadamard blocks scaled by 1/sqrt(128), so it is symmetric and
orthogonal (``H @ H = I``). Follows docs/exl3-format.md (step 5) and exllamav3's ``exllamav3_ext/quant/hadamard.cu``
(``had_r_128``).
"""

from __future__ import annotations

import functools
import math

import torch

from ..errors import GeometryError

HAD_BLOCK = 128


@functools.cache
def _sylvester_cpu(n: int, dtype: torch.dtype) -> torch.Tensor:
    i = torch.arange(n)
    # H[i, j] = (-1)^popcount(i & j) is the Sylvester construction H_2n = [[H, H], [H, -H]].
    bits = (i[:, None] & i[None, :]).to(torch.int64)
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits >>= 1
    return ((1 - 2 * parity).to(torch.float64) / math.sqrt(n)).to(dtype)


def hadamard_matrix(
    n: int = HAD_BLOCK, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix of order ``n`` (a power of two).

    Returns:
        ``(n, n)`` tensor of ``dtype`` with entries ``+-1/sqrt(n)``.

    Raises:
        GeometryError: when ``n`` is not a power of two.
    """
    if n < 1 or n & (n - 1):
        raise GeometryError(f"Hadamard order {n} is not a power of two")
    h = _sylvester_cpu(n, dtype)
    return h if device is None else h.to(device)


def had128(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Apply the 128-block Hadamard transform along one dimension.

    Args:
        x: floating tensor; ``x.shape[dim]`` must be a multiple of 128.
        dim: the dimension to transform.

    Returns:
        tensor of the same shape and dtype: each consecutive block of 128 along ``dim`` multiplied by ``H128``.

    Raises:
        GeometryError: when the dimension is not a multiple of 128.
    """
    size = x.shape[dim]
    if size % HAD_BLOCK:
        raise GeometryError(f"Hadamard transform over a dimension of {size}, which is not a multiple of {HAD_BLOCK}")
    h = hadamard_matrix(HAD_BLOCK, x.dtype, x.device)
    if dim in (0, -x.dim()) and x.dim() > 1 and x.is_contiguous():
        # the leading dimension: one batched product H^T @ block over contiguous blocks (moving the dimension last
        # would make the product copy a strided view first; 4x slower for a 2048 x 8192 weight)
        return torch.matmul(h.T, x.reshape(size // HAD_BLOCK, HAD_BLOCK, -1)).reshape(x.shape)
    moved = x.movedim(dim, -1)
    blocks = moved.reshape(*moved.shape[:-1], size // HAD_BLOCK, HAD_BLOCK)
    return (blocks @ h).reshape(moved.shape).movedim(-1, dim)
