"""The Triton kernels of the escha ``triton`` backend (CUDA and ROCm; checked on CPU with ``TRITON_INTERPRET=1``).

Two launches per shard:

1. :func:`input_kernel`: ``xt = H((x * a))`` per 128-feature block, ``a = s_in * rin``, ``H`` the unnormalized
   128-point Sylvester Hadamard matrix (a ``tl.dot`` with the +-1 matrix), rounded to float16 into a workspace;
2. :func:`gemm_kernel`: each program owns ``BM`` rows and one 128-column block of the output; along k it decodes
   ``BK x 128`` weights of the code per step (each weight's 16-bit state from its tile's uint32 words, the mcg hash,
   two float16 halves added; docs/exl3-format.md "The math", steps 1-4), multiplies ``xt`` by them into float32
   accumulators, and at the end applies the output transform (``tl.dot`` with ``H``), ``b = rout * s_out`` and
   writes its columns of the layer's output in the output's dtype.

The decode is the codec's (``quantpack_core.codec.trellis``: state of stream position ``t`` = the 16 ring bits
ending at ``(t + 1) * K``, tile placement of the tensor-core layout), written for whole blocks of weights.
"""

from __future__ import annotations

import triton
import triton.language as tl

# tl.constexpr: compiled Triton kernels read only constexpr globals (the interpreter reads any)
MCG_MULT = tl.constexpr(0xCBAC1FED)
HALF_MASK = tl.constexpr(0x8FFF8FFF)
HALF_XOR = tl.constexpr(0x3B603B60)


@triton.jit
def input_kernel(x_ptr, a_ptr, h_ptr, xt_ptr, rows, width, k, x_stride, BM: tl.constexpr):
    """``xt[rows, k] = H(x * a)`` per 128-block (x zero-extended from ``width`` to ``k``); grid (rows / BM, k / 128)."""
    pid_m = tl.program_id(0)
    kb = tl.program_id(1)
    r = pid_m * BM + tl.arange(0, BM)
    c = kb * 128 + tl.arange(0, 128)
    x = tl.load(x_ptr + r[:, None] * x_stride + c[None, :], mask=(r[:, None] < rows) & (c[None, :] < width), other=0.0)
    a = tl.load(a_ptr + c)
    v = x.to(tl.float32) * a[None, :]
    i = tl.arange(0, 128)
    h = tl.load(h_ptr + i[:, None] * 128 + i[None, :])
    xt = tl.dot(v, h, input_precision="ieee")
    tl.store(xt_ptr + r[:, None] * k + c[None, :], xt.to(tl.float16), mask=r[:, None] < rows)


@triton.jit
def gemm_kernel(
    xt_ptr, code_ptr, place_ptr, h_ptr, b_ptr, out_ptr,
    rows, k, n, out_stride, col, out_features,
    KBITS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """``out[:, col + c] = (H(xt @ What) * b)[:, c]`` for the program's 128-column block; grid (rows / BM, n / 128)."""
    WORDS: tl.constexpr = 8 * KBITS
    RING: tl.constexpr = 256 * KBITS
    pid_m = tl.program_id(0)
    nb = tl.program_id(1)
    r = pid_m * BM + tl.arange(0, BM)
    rk = tl.arange(0, BK)
    cr = tl.arange(0, 128)
    # where each weight of a (BK, 128) block sits in its tile's stream, and which words hold its state
    t = tl.load(place_ptr + (rk[:, None] % 16) * 16 + (cr[None, :] % 16)).to(tl.int64)
    start = ((t + 1) * KBITS - 16 + RING) % RING
    word = start // 32
    nxt = (word + 1) % WORDS
    shift = 48 - start % 32
    tile_n = nb * 8 + cr[None, :] // 16
    ntn = n // 16
    acc = tl.zeros((BM, 128), dtype=tl.float32)
    for k0 in range(0, k, BK):
        base = (((k0 + rk[:, None]) // 16) * ntn + tile_n) * WORDS
        hi = tl.load(code_ptr + base + word).to(tl.int64) & 0xFFFFFFFF
        lo = tl.load(code_ptr + base + nxt).to(tl.int64) & 0xFFFFFFFF
        state = (((hi << 32) | lo) >> shift) & 0xFFFF
        h16 = ((state * MCG_MULT) & 0xFFFFFFFF & HALF_MASK) ^ HALF_XOR
        low = (h16 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        high = (h16 >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        w = (low + high).to(tl.float16)
        xt = tl.load(xt_ptr + r[:, None] * k + k0 + rk[None, :], mask=r[:, None] < rows, other=0.0)
        acc += tl.dot(xt, w)
    i = tl.arange(0, 128)
    h = tl.load(h_ptr + i[:, None] * 128 + i[None, :])
    y = tl.dot(acc, h, input_precision="ieee")
    c = nb * 128 + cr
    b = tl.load(b_ptr + c)
    y = y * b[None, :]
    mask = (r[:, None] < rows) & (c[None, :] < out_features)
    tl.store(out_ptr + r[:, None] * out_stride + col + c[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
