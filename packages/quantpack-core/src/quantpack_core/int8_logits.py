"""Logits from an int8-row table without dequantizing it: ``out = (x @ qweight.T) * scales``, the op
``quantpack::int8_rows_logits_``.

An int8-row table (:mod:`quantpack_core.embedding`'s rows, escha's ``weight_int8`` / ``weight_scale``) serves both
the token embedding (a gather) and a head tied to it or stored the same way (a product over the whole table). The
product reads each int8 weight once: on CUDA / ROCm a Triton kernel (:mod:`._int8_logits_triton`) converts the rows
to the activations' 16-bit type in registers and applies each row's scale to its logit; elsewhere (the CPU, float32
activations) the table is converted a few megabytes at a time into the output's columns, never as a whole.

Exact for the int8 values (every int8 is a float16 / bfloat16): the Triton kernel multiplies the float32 dot product
by the row's scale; the chunked path multiplies the product in the activations' dtype (float32 for float16
activations, whose range the unscaled product would exceed).

Source: the row format of :mod:`quantpack_core.embedding` (:func:`~quantpack_core.embedding.dequantize_rows`), its
scale applied after the product instead of before; docs/escha-format.md (int8 embedding and head).
"""

from __future__ import annotations

import torch

from .ops import define_op

#: elements of the table the chunked path converts at once (8 MiB of bfloat16)
CHUNK_ELEMENTS = 4 << 20


def int8_rows_logits_chunked(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """The portable implementation: ``out[:, a:b] = (x @ qweight[a:b].T) * scales[a:b]`` over chunks of at most
    :data:`CHUNK_ELEMENTS` table elements (the whole table is never converted at once). Each chunk's int8 rows are
    converted exactly to ``x``'s dtype and the scales multiply the product; for float16 activations the product is
    taken in float32 and rounded once, since the raw int8 values times the activations would pass float16's 65504
    above a logit of about 30 (bfloat16 and float32 have float32's range)."""
    vocab, width = qweight.shape
    step = max(1, CHUNK_ELEMENTS // max(width, 1))
    wide = x.dtype == torch.float16
    xs = x.float() if wide else x
    for a in range(0, vocab, step):
        b = min(vocab, a + step)
        part = torch.mm(xs, qweight[a:b].to(xs.dtype).t())
        out[:, a:b].copy_(part.mul_(scales[a:b].to(part.dtype)))


def _int8_rows_logits_cuda(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """CUDA / ROCm: the Triton kernel for float16 / bfloat16 activations, the chunked path otherwise."""
    if x.dtype in (torch.float16, torch.bfloat16):
        from ._int8_logits_triton import int8_rows_logits_triton

        # the kernel indexes the table and scales as contiguous (no copy when they are, as the method keeps them)
        int8_rows_logits_triton(x, qweight.contiguous(), scales.contiguous(), out)
    else:
        int8_rows_logits_chunked(x, qweight, scales, out)


define_op(
    "int8_rows_logits_",
    "(Tensor x, Tensor qweight, Tensor scales, Tensor(a!) out) -> ()",
    {"CPU": int8_rows_logits_chunked, "CUDA": _int8_rows_logits_cuda},
)


def int8_rows_logits(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Logits of ``x`` against an int8-row table through ``quantpack::int8_rows_logits_``.

    Args:
        x: ``(rows, width)`` activations (float16, bfloat16 or float32), rows of unit stride.
        qweight: int8 ``(vocab, width)`` table rows, contiguous.
        scales: ``(vocab,)`` per-row scales (any float dtype).

    Returns:
        ``(rows, vocab)`` logits in ``x``'s dtype.

    Raises:
        ValueError: shapes that do not fit each other, a table that is not int8, or a table or scales that are not
            contiguous (named in the message).
    """
    if qweight.dtype != torch.int8 or qweight.dim() != 2 or x.dim() != 2 or x.shape[1] != qweight.shape[1]:
        raise ValueError(
            f"int8_rows_logits: needs x (rows, width) and an int8 (vocab, width) table, got x {list(x.shape)} and "
            f"{qweight.dtype} {list(qweight.shape)}"
        )
    if scales.shape != (qweight.shape[0],):
        raise ValueError(
            f"int8_rows_logits: {qweight.shape[0]} table rows need as many scales, got {list(scales.shape)}"
        )
    if not (qweight.is_contiguous() and scales.is_contiguous()):
        raise ValueError("int8_rows_logits: the int8 table and its scales must be contiguous (call .contiguous() once)")
    out = x.new_empty((x.shape[0], qweight.shape[0]))
    torch.ops.quantpack.int8_rows_logits_(x if x.stride(1) == 1 else x.contiguous(), qweight, scales, out)
    return out
