"""The Triton kernels of the escha ``triton`` backend (CUDA and ROCm; checked on CPU with ``TRITON_INTERPRET=1``).

Three launches per shard:

1. :func:`input_kernel`: ``xt = H((x * a))`` per 128-feature block, ``a = s_in * rin``, ``H`` the unnormalized
   128-point Sylvester Hadamard matrix (a ``tl.dot`` with the +-1 matrix), rounded to float16 into a workspace;
2. :func:`gemm_kernel`: each program owns ``BM`` rows, one 128-column block of the output and one slice of the
   reduction dimension k (split-K: ``splits`` slices, so that a few rows still give every SM work); along its slice
   it decodes ``BK x 128`` weights of the code per step (each weight's 16-bit state from its tile's uint32 words in
   32-bit arithmetic, the mcg hash, two float16 halves added; docs/exl3-format.md "The math", steps 1-4), multiplies
   ``xt`` by them into float32 accumulators and stores its partial sums;
3. :func:`reduce_kernel`: sums the slices' partials in slice order (deterministic) and ends the column block: the
   output transform (``tl.dot`` with ``H``: it is linear, so it applies to the sum of the slices), ``b = rout *
   s_out``, and its columns of the layer's output written in the output's dtype.

The end of a column block lives in its own launch because its float32 128 x 128 product needs most of a program's
registers: inside the decode loop's kernel it made the compiler spill (ptxas for sm_90: 255 registers and 1.1 KB of
spill stores per thread). The decode loop alone, 8 warps and ``BK`` = 16, takes 96 registers for sm_90, spills
nothing and issues 157 instructions per warp and step (261 before its per-weight offsets and shifts were made
loop-invariant; bit-identical results).

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
    xt_ptr, code_ptr, place_ptr, part_ptr,
    rows, k, n, slice_k, rows_pad,
    KBITS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """The program's partial ``xt[:, slice] @ What[slice, block]``, stored to ``part[slice, r, block]`` (float32,
    ``(splits, rows_pad, n)``); grid (rows / BM, n / 128, splits), ``slice_k`` a multiple of ``BK``."""
    WORDS: tl.constexpr = 8 * KBITS
    RING: tl.constexpr = 256 * KBITS
    pid_m = tl.program_id(0)
    nb = tl.program_id(1)
    ks = tl.program_id(2)
    r = pid_m * BM + tl.arange(0, BM)
    rk = tl.arange(0, BK)
    cr = tl.arange(0, 128)
    # where each weight of a (BK, 128) block finds its 16-bit state (loop-invariant, one register each): the state
    # starts at stream bit ``start``, in word ``j = start // 32`` at offset ``o = start % 32`` (most significant bit
    # first). With o <= 16 it lies in word j alone, ``(w[j] >> (16 - o)) & 0xFFFF``; else it runs into the next word
    # of the ring, ``(w[j]:w[j+1] >> (48 - o)) & 0xFFFF``. Both are ``((hi << (32 - s)) | (lo >> s)) & 0xFFFF``
    # with s in 0..31 (hi's part falls outside the mask when s <= 16), written ``(hi << 1) << (31 - s)`` so that no
    # shift reaches 32
    t = tl.load(place_ptr + (rk[:, None] % 16) * 16 + (cr[None, :] % 16))
    start = ((t + 1) * KBITS - 16 + RING) % RING
    j = start // 32
    o = start % 32
    two = o > 16
    s = tl.where(two, 48 - o, 16 - o)
    tile_off = (nb * 8 + cr[None, :] // 16) * WORDS
    hi_off = tile_off + j
    lo_off = tile_off + tl.where(two, tl.where(j == WORDS - 1, 0, j + 1), j)
    hi_shift = (31 - s).to(tl.uint32)
    lo_shift = s.to(tl.uint32)
    ntn = n // 16
    acc = tl.zeros((BM, 128), dtype=tl.float32)
    k_lo = ks * slice_k
    k_hi = tl.minimum(k, k_lo + slice_k)
    for k0 in range(k_lo, k_hi, BK):
        tiles = code_ptr + (k0 // 16) * ntn * WORDS  # this step's row of tiles
        hi = tl.load(tiles + hi_off).to(tl.uint32, bitcast=True)
        lo = tl.load(tiles + lo_off).to(tl.uint32, bitcast=True)
        state = (((hi << 1) << hi_shift) | (lo >> lo_shift)) & 0xFFFF
        h16 = ((state * MCG_MULT) & HALF_MASK) ^ HALF_XOR
        low = (h16 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
        high = (h16 >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
        w = low + high  # in float16: the halves' exponents are close, so their sum is exact before its one rounding
        xt = tl.load(xt_ptr + r[:, None] * k + k0 + rk[None, :], mask=r[:, None] < rows, other=0.0)
        acc += tl.dot(xt, w)
    c = nb * 128 + cr
    tl.store(part_ptr + (ks * rows_pad + r[:, None]) * n + c[None, :], acc)


@triton.jit
def reduce_kernel(
    part_ptr, h_ptr, b_ptr, out_ptr, rows, n, out_stride, col, out_features, splits, rows_pad, BM: tl.constexpr
):
    """``out[r, col + c] = (H(sum of the slices' partials) * b)[:, c]`` for the program's rows and column block
    (the columns below ``out_features``; slices summed in order); grid (rows / BM, n / 128)."""
    pid_m = tl.program_id(0)
    nb = tl.program_id(1)
    r = pid_m * BM + tl.arange(0, BM)
    c = nb * 128 + tl.arange(0, 128)
    acc = tl.zeros((BM, 128), dtype=tl.float32)
    for s in range(0, splits):
        acc += tl.load(part_ptr + (s * rows_pad + r[:, None]) * n + c[None, :])
    i = tl.arange(0, 128)
    h = tl.load(h_ptr + i[:, None] * 128 + i[None, :])
    y = tl.dot(acc, h, input_precision="ieee")
    b = tl.load(b_ptr + c)
    y = y * b[None, :]
    mask = (r[:, None] < rows) & (c[None, :] < out_features)
    tl.store(out_ptr + r[:, None] * out_stride + col + c[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
