"""The Triton kernel of ``quantpack::int8_rows_logits_`` (CUDA and ROCm): ``out = (x @ qweight.T) * scales`` with
the int8 rows converted to the activations' 16-bit type in registers.

Each program owns ``BLOCK_M`` rows of ``x`` and ``BLOCK_V`` table rows (logits columns); it walks the width in steps
of ``BLOCK_H``, loading an int8 ``(BLOCK_V, BLOCK_H)`` tile (each table byte is read once per row block) and a
``(BLOCK_M, BLOCK_H)`` slice of ``x``, and accumulates ``tl.dot`` in float32; the row scales multiply the float32
sums before the store. Masked at every edge (any rows, vocabulary and width). Imported only when a CUDA / ROCm call
needs it (:mod:`quantpack_core.int8_logits`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: table rows (logits columns) per program
BLOCK_V = 64
#: width per step
BLOCK_H = 128


@triton.jit
def int8_rows_logits_kernel(
    x_ptr, q_ptr, s_ptr, out_ptr, rows, vocab, width, x_stride, out_stride,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """One ``(BLOCK_M, BLOCK_V)`` block of logits (see the module)."""
    pid_v = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # 64-bit offsets: rows x vocab can pass 2^31
    rv = (pid_v * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
    rh = tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)
    for h0 in range(0, width, BLOCK_H):
        h = h0 + rh
        in_h = h[None, :] < width
        a = tl.load(x_ptr + rm[:, None] * x_stride + h[None, :], mask=(rm[:, None] < rows) & in_h, other=0.0)
        q = tl.load(q_ptr + rv[:, None] * width + h[None, :], mask=(rv[:, None] < vocab) & in_h, other=0)
        acc += tl.dot(a, tl.trans(q.to(a.dtype)))
    s = tl.load(s_ptr + rv, mask=rv < vocab, other=0.0).to(tl.float32)
    y = acc * s[None, :]
    mask = (rm[:, None] < rows) & (rv[None, :] < vocab)
    tl.store(out_ptr + rm[:, None] * out_stride + rv[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def int8_rows_logits_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """Launch :func:`int8_rows_logits_kernel`: ``x`` ``(rows, width)`` float16 / bfloat16 with unit column stride,
    ``qweight`` contiguous int8 ``(vocab, width)``, ``scales`` ``(vocab,)``, ``out`` ``(rows, vocab)`` with unit column
    stride, written. 16-row blocks up to 16 rows (the decode case), 64 above."""
    rows, width = x.shape
    vocab = qweight.shape[0]
    if rows == 0 or vocab == 0:
        return
    block_m = 16 if rows <= 16 else 64
    grid = (triton.cdiv(vocab, BLOCK_V), triton.cdiv(rows, block_m))
    int8_rows_logits_kernel[grid](
        x, qweight, scales, out, rows, vocab, width, x.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_V=BLOCK_V, BLOCK_H=BLOCK_H,
    )  # fmt: skip
