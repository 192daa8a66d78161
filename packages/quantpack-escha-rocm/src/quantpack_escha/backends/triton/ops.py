"""The Triton backend's custom op ``quantpack::escha_triton_`` (one escha shard into its columns of the layer's
output) and the per-device workspace its launches share (reserved when a shard is prepared, before any graph
capture): the float16 transformed input of up to :data:`MAX_ROWS` rows of the widest shard, the float32 partial
sums of the decode GEMM (:data:`PART_ELEMS`), the 128 x 128 Hadamard matrix and the tile placement. A call of more
rows than a piece holds runs in pieces; the op allocates nothing.

Split-K plan (:func:`split_plan`): a piece whose row blocks times column blocks fill fewer than
:data:`PROGRAMS_PER_SM` programs per SM cuts k into slices until they do (at most one slice per ``BK`` of k), so
that the decode GEMVs of a few rows stream the code on every SM. Rows per piece (:func:`piece_rows`): as many as
the partials hold for the shard's width, at most :data:`MAX_ROWS`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantpack_core.codec import hadamard_matrix
from quantpack_core.codec.trellis import tile_placement
from quantpack_core.ops import define_op

#: rows of transformed input per launch (a larger call runs in pieces)
MAX_ROWS = 1024
#: float32 partial sums of one piece (32 MiB): its rows x the shard's width x its k slices
PART_ELEMS = 1 << 23
#: rows per program
BM = 16
#: k per step of the GEMM loop (a multiple of 16; 16 keeps the loop's gathers within the registers of 8 warps)
BK = 16
#: warps and software-pipeline stages of the decode GEMM (8 warps, 2 stages: 123 registers for sm_90, no spills)
GEMM_WARPS, GEMM_STAGES = 8, 2
#: programs per SM the split-K plan aims at
PROGRAMS_PER_SM = 2
#: SMs assumed where the device reports none (Triton's interpreter on CPU: small, so the tests' shards split)
CPU_SMS = 8


@dataclass
class Workspace:
    """One device's buffers: ``xt`` float16 ``(MAX_ROWS, k)``, ``part`` float32 ``(PART_ELEMS,)`` (the decode GEMM's
    partial sums), ``h`` float32 ``(128, 128)`` (+-1), ``place`` int32 ``(256,)``; ``target``: programs a launch aims
    at (SMs x :data:`PROGRAMS_PER_SM`)."""

    xt: torch.Tensor
    part: torch.Tensor
    h: torch.Tensor
    place: torch.Tensor
    target: int


_workspaces: dict[tuple[str, int | None], Workspace] = {}


def _sms(device: torch.device) -> int:
    """Streaming multiprocessors (CUDA) or compute units (ROCm) of ``device``; :data:`CPU_SMS` on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return CPU_SMS


def reserve(device: torch.device, k: int) -> Workspace:
    """The workspace of ``device``, created or widened for a shard of ``k`` input features (call at load)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" is the current device: what a call's x.device names
        device = torch.device(device.type, torch.cuda.current_device())
    key = (device.type, device.index)
    ws = _workspaces.get(key)
    if ws is None:
        h = (hadamard_matrix(128, torch.float64) * 128**0.5).round().to(torch.float32)
        target = _sms(device) * PROGRAMS_PER_SM
        ws = Workspace(
            xt=torch.empty((MAX_ROWS, k), dtype=torch.float16, device=device),
            part=torch.empty((PART_ELEMS,), dtype=torch.float32, device=device),
            h=h.to(device),
            place=tile_placement().to(device=device, dtype=torch.int32),
            target=target,
        )
        _workspaces[key] = ws
    elif ws.xt.shape[1] < k:
        ws.xt = torch.empty((MAX_ROWS, k), dtype=torch.float16, device=device)
    return ws


def piece_rows(n: int) -> int:
    """Rows per piece for a shard of ``n`` stored output features: whole ``BM`` blocks whose one-slice partials fit
    :data:`PART_ELEMS`, at most :data:`MAX_ROWS`, at least ``BM`` (a width up to ``PART_ELEMS / BM`` = 524,288)."""
    return max(BM, min(MAX_ROWS, PART_ELEMS // n) // BM * BM)


def split_plan(rows: int, k: int, n: int, target: int) -> tuple[int, int]:
    """``(splits, slice_k)`` for a piece of ``rows`` rows on a ``k x n`` shard: one slice when the row blocks times
    the column blocks reach ``target`` programs, else as many slices (of whole ``BK`` steps) as bring the grid to it
    and the partials hold (``splits * rows rounded up to BM * n <= PART_ELEMS``)."""
    row_blocks = triton_cdiv(rows, BM)
    blocks = row_blocks * (n // 128)
    steps = k // BK
    if blocks >= target or steps < 2:
        return 1, k
    want = min(steps, triton_cdiv(target, blocks), max(1, PART_ELEMS // (row_blocks * BM * n)))
    slice_k = triton_cdiv(steps, want) * BK
    return triton_cdiv(k, slice_k), slice_k


def run_escha_triton(
    x: torch.Tensor,
    code: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    kbits: int,
    out_features: int,
    out: torch.Tensor,
    col: int,
) -> None:
    """The implementation of ``quantpack::escha_triton_`` (see :func:`escha_triton_`)."""
    from .escha_triton import gemm_kernel, input_kernel, reduce_kernel

    rows = x.shape[0]
    if rows == 0:
        return
    k, n = code.shape[0] * 16, code.shape[1] * 16
    ws = _workspaces.get((x.device.type, x.device.index))
    if ws is None or ws.xt.shape[1] < k or out.stride(1) != 1 or x.stride(1) != 1:
        raise RuntimeError(
            f"escha_triton: a shard of {k} input features needs the workspace reserved at load (have "
            f"{'none' if ws is None else ws.xt.shape[1]}), and input and output of unit column stride"
        )
    piece = piece_rows(n)
    for r0 in range(0, rows, piece):
        r = min(piece, rows - r0)
        xr, outr = x[r0 : r0 + r], out[r0 : r0 + r]
        xt = ws.xt[:r, :k]
        row_blocks = triton_cdiv(r, BM)
        input_kernel[(row_blocks, k // 128)](xr, a, ws.h, xt, r, xr.shape[1], k, xr.stride(0), BM=BM)
        splits, slice_k = split_plan(r, k, n, ws.target)
        rows_pad = row_blocks * BM
        gemm_kernel[(row_blocks, n // 128, splits)](
            xt, code, ws.place, ws.part, r, k, n, slice_k, rows_pad, KBITS=kbits, BM=BM, BK=BK,
            num_warps=GEMM_WARPS, num_stages=GEMM_STAGES,
        )  # fmt: skip
        reduce_kernel[(row_blocks, n // 128)](
            ws.part, ws.h, b, outr, r, n, outr.stride(0), col, out_features, splits, rows_pad, BM=BM
        )


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


define_op(
    "escha_triton_",
    "(Tensor x, Tensor code, Tensor a, Tensor b, int kbits, int out_features, Tensor(a!) out, int col) -> ()",
    {"CUDA": run_escha_triton, "CPU": run_escha_triton},
)


def escha_triton_(
    x: torch.Tensor,
    code: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    kbits: int,
    out_features: int,
    out: torch.Tensor,
    col: int,
) -> None:
    """One escha shard through the Triton kernels: ``out[:, col:col + out_features] = y[:, :out_features]``.

    Args:
        x: ``(rows, in)`` float16 / bfloat16 / float32 activations, unit column stride (zero-extended to k).
        code: int32 ``(k/16, n/16, 8*K)``: the code's uint32 words.
        a: float32 ``(k,)``: ``s_in * rin``. b: float32 ``(n,)``: ``rout * s_out``.
        kbits: K (integer 1..8).
        out_features: columns written (<= n).
        out: ``(rows, total)`` layer output, unit column stride, written in place.
        col: first output column of this shard.

    Raises:
        RuntimeError: no workspace was reserved for this width (``prepare`` does it).

    The CPU dispatch key runs the same kernels under Triton's interpreter (``TRITON_INTERPRET=1``), for tests.
    Source: docs/escha-format.md; :mod:`.escha_triton` describes the kernels.
    """
    torch.ops.quantpack.escha_triton_(x, code, a, b, kbits, out_features, out, col)
