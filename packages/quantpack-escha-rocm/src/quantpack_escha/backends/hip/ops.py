"""The HIP backend's custom op ``quantpack::escha_hip_`` (one escha shard into its columns of the layer's output) and
the per-device workspace its launches share.

The workspace is allocated when a shard is prepared, before any graph capture, and grown only there: the split-K
slab and counters (handed to the extension once with ``set_decode_scratch``), and the activation buffers of up to
:data:`MAX_ROWS` rows (bf16 copy of the input, the extension's uint8 pre-quantization with its per-row scale and
max, the bf16 intermediate). A call of more rows runs in pieces of :data:`MAX_ROWS`. The op allocates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantpack_core.ops import define_op

from .extension import load_extension

#: rows one launch takes (a larger call runs in pieces)
MAX_ROWS = 2048
#: block counters the extension's split-K uses
COUNTERS = 4096


def scratch_bytes(n: int) -> int:
    """Split-K slab bytes the extension needs for a shard of ``n`` output features (8 splits x 64 rows x n float32,
    at least 1 MiB)."""
    return max(8 * 64 * n * 4, 1 << 20)


@dataclass
class Workspace:
    """One device's buffers (see the module). ``k`` / ``n``: the widest input / output features reserved."""

    partial: torch.Tensor
    counters: torch.Tensor
    x: torch.Tensor
    a_q: torch.Tensor
    a_scale: torch.Tensor
    a_max: torch.Tensor
    c: torch.Tensor
    k: int
    n: int


_workspaces: dict[tuple[str, int | None], Workspace] = {}


def reserve(device: torch.device, k: int, n: int) -> Workspace:
    """The workspace of ``device``, created or grown for a shard of ``k`` input and ``n`` output features; hands the
    split-K slab to the extension whenever it is (re)allocated. Call at load only.

    Raises:
        ImportError: the extension does not import.
    """
    device = torch.device(device)
    key = (device.type, device.index)
    ws = _workspaces.get(key)
    if ws is not None and ws.k >= k and ws.n >= n:
        return ws
    k = max(k, ws.k if ws else 0)
    n = max(n, ws.n if ws else 0)
    ext = load_extension()
    partial = torch.empty(scratch_bytes(n) // 4, dtype=torch.float32, device=device)
    counters = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    ws = Workspace(
        partial=partial,
        counters=counters,
        x=torch.empty((MAX_ROWS, k), dtype=torch.bfloat16, device=device),
        a_q=torch.empty((MAX_ROWS, k), dtype=torch.uint8, device=device),
        a_scale=torch.empty(MAX_ROWS, dtype=torch.float32, device=device),
        a_max=torch.zeros(MAX_ROWS, dtype=torch.float32, device=device),
        c=torch.empty((MAX_ROWS, n), dtype=torch.bfloat16, device=device),
        k=k,
        n=n,
    )
    ext.set_decode_scratch(partial.data_ptr(), partial.numel() * 4, counters.data_ptr())
    _workspaces[key] = ws
    return ws


def run_escha_hip(
    x: torch.Tensor,
    code: torch.Tensor,
    rin: torch.Tensor,
    rout: torch.Tensor,
    s_in: torch.Tensor,
    s_out: torch.Tensor,
    kbits: int,
    out: torch.Tensor,
    col: int,
) -> None:
    """The implementation of ``quantpack::escha_hip_`` (see :func:`escha_hip_`)."""
    rows = x.shape[0]
    if rows == 0:
        return
    k, n = code.shape[0] * 16, code.shape[1] * 16
    ws = _workspaces.get((x.device.type, x.device.index))
    if ws is None or ws.k < k or ws.n < n or out.stride(1) != 1:
        raise RuntimeError(
            f"escha_hip: a {k}x{n} shard needs the workspace reserved at load (have "
            f"{'none' if ws is None else f'{ws.k}x{ws.n}'}) and an output of unit column stride"
        )
    ext = load_extension()
    stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0
    for r0 in range(0, rows, MAX_ROWS):
        r = min(MAX_ROWS, rows - r0)
        xb = ws.x[:r, :k]
        xb[:, : x.shape[1]].copy_(x[r0 : r0 + r])  # contiguous bf16
        if x.shape[1] < k:
            xb[:, x.shape[1] :].zero_()  # zero-extended to the stored width
        ws.a_max[:r].zero_()
        o = out[r0 : r0 + r]
        ext.launch(
            xb.data_ptr(), code.data_ptr(), rin.data_ptr(), rout.data_ptr(), s_in.data_ptr(), s_out.data_ptr(),
            ws.a_q.data_ptr(), ws.a_scale.data_ptr(), ws.a_max.data_ptr(), ws.c.data_ptr(), o.data_ptr(),
            r, n, k, int(kbits), out.stride(0), int(col), stream,
        )  # fmt: skip


define_op(
    "escha_hip_",
    "(Tensor x, Tensor code, Tensor rin, Tensor rout, Tensor s_in, Tensor s_out, int kbits, Tensor(a!) out, "
    "int col) -> ()",
    {"CUDA": run_escha_hip, "CPU": run_escha_hip},
)


def escha_hip_(
    x: torch.Tensor,
    code: torch.Tensor,
    rin: torch.Tensor,
    rout: torch.Tensor,
    s_in: torch.Tensor,
    s_out: torch.Tensor,
    kbits: int,
    out: torch.Tensor,
    col: int,
) -> None:
    """One escha shard through the HIP extension: ``out[:, col:col + n] = y`` (the whole stored width n).

    Args:
        x: ``(rows, in)`` activations (any float dtype; copied as contiguous bf16, zero-extended to k).
        code: int32 ``(k/16, n/16, 8*K)`` (the int16 code's words as the extension reads them).
        rin, rout: float16 ``(k,)``, ``(n,)``. s_in, s_out: float32 ``(k,)``, ``(n,)``.
        kbits: K.
        out: ``(rows, total)`` bfloat16 layer output (the extension writes bf16), unit column stride, written in
            place.
        col: first output column of this shard.

    Raises:
        RuntimeError: no workspace was reserved for this shard's size (``prepare`` does it).

    Source: docs/escha-format.md; the extension's interface: :mod:`.extension`.
    """
    torch.ops.quantpack.escha_hip_(x, code, rin, rout, s_in, s_out, kbits, out, col)
