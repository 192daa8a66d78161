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
spill stores per thread; the decode loop alone, 8 warps and ``BK`` = 16, takes 128 registers and spills nothing).

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
    # where each weight of a (BK, 128) block sits in its tile's stream: the word holding its state's high bits and
    # the state's offset in the 64 bits from there, packed in one loop-invariant int32 per weight (a register each;
    # the shifts are derived per step, which costs a few integer operations but keeps the kernel from spilling)
    t = tl.load(place_ptr + (rk[:, None] % 16) * 16 + (cr[None, :] % 16))
    start = ((t + 1) * KBITS - 16 + RING) % RING
    packed = (start // 32) | ((48 - start % 32) << 8)  # word | shift of the 64-bit (hi:lo), 17..48
    tile_n = nb * 8 + cr[None, :] // 16
    ntn = n // 16
    acc = tl.zeros((BM, 128), dtype=tl.float32)
    k_lo = ks * slice_k
    k_hi = tl.minimum(k, k_lo + slice_k)
    for k0 in range(k_lo, k_hi, BK):
        word = packed & 0xFF
        shift = packed >> 8
        nxt = tl.where(word == WORDS - 1, 0, word + 1)
        in_hi = shift >= 32  # the state lies in the high word alone
        hi_shift = tl.where(in_hi, shift - 32, 32 - shift).to(tl.uint32)  # right shift / left shift of hi
        lo_shift = tl.where(in_hi, 0, shift).to(tl.uint32)
        base = (((k0 + rk[:, None]) // 16) * ntn + tile_n) * WORDS
        hi = tl.load(code_ptr + base + word).to(tl.uint32, bitcast=True)
        lo = tl.load(code_ptr + base + nxt).to(tl.uint32, bitcast=True)
        state = tl.where(in_hi, hi >> hi_shift, (hi << hi_shift) | (lo >> lo_shift)) & 0xFFFF
        h16 = ((state * MCG_MULT) & HALF_MASK) ^ HALF_XOR
        low = (h16 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        high = (h16 >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        w = (low + high).to(tl.float16)
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
