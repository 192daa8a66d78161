"""The Triton kernels of the escha ``triton`` backend (CUDA and ROCm; checked on CPU with ``TRITON_INTERPRET=1``).

Two or three launches per shard:

1. :func:`input_kernel`: ``xt = H((x * a))`` per 128-feature block, ``a = s_in * rin``, ``H`` the unnormalized
   128-point Sylvester Hadamard matrix (a ``tl.dot`` with the +-1 matrix), rounded to float16 into a workspace;
2. :func:`gemm_kernel`: each program owns ``BM`` rows, one 128-column block of the output and one slice of the
   reduction dimension k (split-K: ``splits`` slices, so that a few rows still give every SM work); along its slice
   it decodes ``BK x 128`` weights of the code per step (each weight's 16-bit state from its tile's uint32 words in
   32-bit arithmetic, the mcg hash, two float16 halves added; docs/exl3-format.md "The math", steps 1-4) and
   multiplies ``xt`` by them into float32 accumulators. With one slice it ends as step 3 does; with more it stores
   its partial sums;
3. :func:`reduce_kernel` (split-K only): sums the slices' partials in slice order (deterministic).

The end of a column block: the output transform (``tl.dot`` with ``H``: it is linear, so it applies to the sum of
the slices), ``b = rout * s_out``, and its columns of the layer's output written in the output's dtype.

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
def _column_block_end(acc, h_ptr, b_ptr, out_ptr, r, nb, rows, out_stride, col, out_features):
    """``out[r, col + c] = (H(acc) * b)[:, c]`` for column block ``nb`` (the columns below ``out_features``)."""
    cr = tl.arange(0, 128)
    h = tl.load(h_ptr + cr[:, None] * 128 + cr[None, :])
    y = tl.dot(acc, h, input_precision="ieee")
    c = nb * 128 + cr
    b = tl.load(b_ptr + c)
    y = y * b[None, :]
    mask = (r[:, None] < rows) & (c[None, :] < out_features)
    tl.store(out_ptr + r[:, None] * out_stride + col + c[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gemm_kernel(
    xt_ptr, code_ptr, place_ptr, h_ptr, b_ptr, out_ptr, part_ptr,
    rows, k, n, out_stride, col, out_features, slice_k, rows_pad,
    KBITS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """The program's partial ``xt[:, slice] @ What[slice, block]``: written through :func:`_column_block_end` when
    ``SPLIT`` is false, else stored to ``part[slice, r, block]`` (float32, ``(splits, rows_pad, n)``); grid
    (rows / BM, n / 128, splits), ``slice_k`` a multiple of ``BK``."""
    WORDS: tl.constexpr = 8 * KBITS
    RING: tl.constexpr = 256 * KBITS
    pid_m = tl.program_id(0)
    nb = tl.program_id(1)
    ks = tl.program_id(2)
    r = pid_m * BM + tl.arange(0, BM)
    rk = tl.arange(0, BK)
    cr = tl.arange(0, 128)
    # where each weight of a (BK, 128) block sits in its tile's stream, which two words hold its state (the high
    # one first), and the shifts that take the state's 16 bits out of them: all loop-invariant
    t = tl.load(place_ptr + (rk[:, None] % 16) * 16 + (cr[None, :] % 16))
    start = ((t + 1) * KBITS - 16 + RING) % RING
    word = start // 32
    nxt = (word + 1) % WORDS
    shift = 48 - start % 32  # of the 64-bit (hi:lo): 17..48
    in_hi = shift >= 32  # the state lies in the high word alone
    hi_shift = tl.where(in_hi, shift - 32, 32 - shift).to(tl.uint32)  # right shift / left shift of hi
    lo_shift = tl.where(in_hi, 0, shift).to(tl.uint32)
    tile_n = nb * 8 + cr[None, :] // 16
    ntn = n // 16
    acc = tl.zeros((BM, 128), dtype=tl.float32)
    k_lo = ks * slice_k
    k_hi = tl.minimum(k, k_lo + slice_k)
    for k0 in range(k_lo, k_hi, BK):
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
    if SPLIT:
        c = nb * 128 + cr
        tl.store(part_ptr + (ks * rows_pad + r[:, None]) * n + c[None, :], acc)
    else:
        _column_block_end(acc, h_ptr, b_ptr, out_ptr, r, nb, rows, out_stride, col, out_features)


@triton.jit
def reduce_kernel(
    part_ptr, h_ptr, b_ptr, out_ptr, rows, n, out_stride, col, out_features, splits, rows_pad, BM: tl.constexpr
):
    """The split-K end: the slices' partials of the program's rows and column block summed in slice order, then
    :func:`_column_block_end`; grid (rows / BM, n / 128)."""
    pid_m = tl.program_id(0)
    nb = tl.program_id(1)
    r = pid_m * BM + tl.arange(0, BM)
    c = nb * 128 + tl.arange(0, 128)
    acc = tl.zeros((BM, 128), dtype=tl.float32)
    for s in range(0, splits):
        acc += tl.load(part_ptr + (s * rows_pad + r[:, None]) * n + c[None, :])
    _column_block_end(acc, h_ptr, b_ptr, out_ptr, r, nb, rows, out_stride, col, out_features)
