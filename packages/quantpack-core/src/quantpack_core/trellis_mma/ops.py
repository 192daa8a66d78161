"""The trellis_mma kernels' custom op, ``quantpack::trellis_mma_`` (one or more trellis shards sharing the layer's
input, each into its columns of the layer's output), its CUDA implementation, and the per-GPU workspace its launches
share.

The workspace is allocated when a shard is prepared (before any CUDA-graph capture) and only read by the op: split-K
partial sums (float32), the arrival counters of the split-K reduction (int32, zero between launches), and for more than
16 rows the transformed input ``had128(x * suh)`` (float16, :data:`XH_ROWS` rows of the widest shard), and for the dense
route the weights of the columns one of its GEMMs computes (:data:`DENSE_BYTES`). Launches on one stream run one after
another, so every shard on a GPU shares one workspace; two streams running trellis_mma launches at the same time on one
GPU would need a workspace each (vLLM runs a model's linear layers on one stream).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from dataclasses import dataclass

import torch

from quantpack_core.ops import define_op

from .library import LibraryError, check, load
from .settings import current

logger = logging.getLogger("vllm.quantpack")

#: split-K partial sums the workspace holds (float32): 16 MiB
PARTIAL_FLOATS = 4 << 20
#: arrival counters (one per 128-column block and row chunk)
COUNTERS = 1 << 16
#: rows of transformed input per launch above 16 rows (larger inputs are run in pieces of this many rows): a prefill
#: chunk of 2048 rows in one launch per shard (the tensor-core kernel's CTAs take 256 rows each)
XH_ROWS = 2048
#: rows up to which one launch runs a layer's shards (one 16-row mma fragment)
FUSED_ROWS = 16
#: the dense route's rebuilt weights (model dtype, (columns, k)): each GEMM computes as many of a layer's consecutive
#: columns as fit (128 MiB: 16,384 columns at k 4,096, 4,608 at k 14,336; :func:`dense_plan`)
DENSE_BYTES = 128 << 20
#: the smallest bucket bound whose calls (from the bucket below's bound + 1, 513 rows) may take the dense route, timed
#: beside the other kernels at load: its rebuild of every weight per call pays off only over many rows
#: (benchmarks/results/kernel_8b.json, H100: on the 8B stack behind the tensor-core kernel at 512 rows, ahead of it
#: from 1,024)
DENSE_ROWS = 1024


def _in_cta(rows: int) -> bool:
    """Whether a call of ``rows`` rows transforms its input in the GEMM's CTAs (one row, with
    ``inline_transform_rows`` 1 in the settings in force), as ``qp_trellis_mma`` decides."""
    return rows == 1 and current().inline_transform_rows >= 1


#: upper row counts of the row buckets: bucket i holds calls of ROW_BUCKETS[i - 1] + 1 .. ROW_BUCKETS[i] rows, the last
#: bucket every call above 1024 rows (timed at 2048)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)

#: what serves the calls of a row bucket, 3 bits a bucket in a run's ``bucket_kernels`` (bucket i at bit 3 i): the
#: split-K kernel (linear.cu), the GPU's delegate (another implementation its format's adapter gives), the
#: tensor-core kernel (tc.cu, Hopper) with 64, 128 or 256 rows per CTA, or the dense route (dense.cu: the weights
#: rebuilt in the model dtype, then a cuBLAS GEMM)
SPLIT, DELEGATE, TC64, TC128, TC256, DENSE = 0, 1, 2, 3, 4, 5
#: rows per CTA of each tensor-core code
TC_ROWS = {TC64: 64, TC128: 128, TC256: 256}
BUCKET_BITS = 3


def row_bucket(rows: int) -> int:
    """The index into :data:`ROW_BUCKETS` of a call of ``rows`` (>= 1) rows: the smallest bound >= rows, the last
    bucket above 1024."""
    return min((rows - 1).bit_length(), len(ROW_BUCKETS) - 1)


def kernel_of(bucket_kernels: int, rows: int) -> int:
    """The code (:data:`SPLIT`, :data:`DELEGATE`, :data:`TC64` ...) that serves a call of ``rows`` rows."""
    return (bucket_kernels >> (BUCKET_BITS * row_bucket(rows))) & ((1 << BUCKET_BITS) - 1)


def bucket_kernels_of(codes) -> int:
    """A run's ``bucket_kernels`` from one code per bucket (in :data:`ROW_BUCKETS` order)."""
    return sum(code << (BUCKET_BITS * i) for i, code in enumerate(codes))


def tc_code(rows: int) -> int:
    """The tensor-core code for calls of up to ``rows`` rows when nothing was measured: 64 rows per CTA up to 64 rows,
    128 up to 128, else 256 (the fastest on most 8B shapes, docs/kernels.md)."""
    return TC64 if rows <= 64 else TC128 if rows <= 128 else TC256


@dataclass
class Workspace:
    """One GPU's scratch for ``quantpack::trellis_mma_``.

    Attributes:
        partials: float32 ``(PARTIAL_FLOATS,)``.
        counters: int32 ``(COUNTERS,)``, zero.
        xh: float16 ``(XH_ROWS, widest k)`` (up to 16 rows: ``(shards, rows, k)``, at most 8 x 16 rows).
        dense: uint8 ``(DENSE_BYTES,)``, the dense route's rebuilt weights, once a shard that may take the route was
            prepared (:meth:`hold_dense`); else empty.
        arch: compute capability (``major * 10 + minor``), which library to load.
        target_ctas: CTAs a launch aims at, up to :data:`FUSED_ROWS` rows.
        target_ctas_wide: the same above :data:`FUSED_ROWS` rows.
        tensor_cores: the tensor-core kernel runs here (a Hopper GPU, whose build has sm_90a's wgmma).
        delegate: another implementation of one shard's call (:class:`.selection.Delegate`'s ``gemm``), given by
            the adapter that prepared this GPU's runs, for the row buckets a run's ``bucket_kernels`` send there; None
            otherwise.
        max_rows: the most rows one call of the linear runs prepared here takes (a serving engine's token budget,
            :meth:`allow_rows`): the row buckets above it are not timed; None: unknown (every bucket may be called);
            0 until a linear run is prepared.
    """

    partials: torch.Tensor
    counters: torch.Tensor
    xh: torch.Tensor
    dense: torch.Tensor
    arch: int
    target_ctas: int
    target_ctas_wide: int
    tensor_cores: bool = False
    delegate: object = None
    max_rows: int | None = 0

    @property
    def holds_dense(self) -> bool:
        """Whether ``dense`` is the dense route's whole buffer (:data:`DENSE_BYTES`), as :meth:`hold_dense` makes it."""
        return self.dense.numel() >= DENSE_BYTES

    def hold_dense(self) -> None:
        """Allocate the dense route's buffer, unless it is held (call at load)."""
        if not self.holds_dense:
            self.dense = torch.empty(DENSE_BYTES, dtype=torch.uint8, device=self.xh.device)

    def allow_rows(self, max_rows: int | None) -> None:
        """Widen :attr:`max_rows` for a linear run whose calls take up to ``max_rows`` rows (None: unknown, which
        stays)."""
        self.max_rows = None if max_rows is None or self.max_rows is None else max(self.max_rows, max_rows)


_workspaces: dict[int, Workspace] = {}


def reserve(device: torch.device, k: int, delegate=None) -> Workspace:
    """The workspace of ``device``, created or widened for shards of ``k`` stored input features (call at load), with
    ``delegate`` (a shard call, see :class:`Workspace`) as its delegate where one is given.

    Raises:
        quantpack_core.trellis_mma.library.LibraryError: the kernels cannot be built or loaded for this GPU, or
            another delegate was given for it before (one per GPU).
    """
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    ws = _workspaces.get(index)
    if ws is None:
        props = torch.cuda.get_device_properties(index)
        arch = props.major * 10 + props.minor
        load(arch)
        per_sm, per_sm_wide = current().ctas_per_sm, current().ctas_per_sm_wide
        ws = Workspace(
            partials=torch.empty(PARTIAL_FLOATS, dtype=torch.float32, device=f"cuda:{index}"),
            counters=torch.zeros(COUNTERS, dtype=torch.int32, device=f"cuda:{index}"),
            xh=torch.empty((XH_ROWS, k), dtype=torch.float16, device=f"cuda:{index}"),
            dense=torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}"),
            arch=arch,
            target_ctas=per_sm * props.multi_processor_count,
            target_ctas_wide=per_sm_wide * props.multi_processor_count,
            tensor_cores=arch == 90,
        )
        _workspaces[index] = ws
    elif ws.xh.shape[1] < k:
        ws.xh = torch.empty((XH_ROWS, k), dtype=torch.float16, device=ws.xh.device)
    if delegate is not None and ws.delegate is not delegate:
        if ws.delegate is not None:
            raise LibraryError(
                f"trellis_mma: a second delegate ({delegate!r}) for cuda:{index}, which delegates to "
                f"{ws.delegate!r}: one per GPU"
            )
        ws.delegate = delegate
    return ws


def workspace(device: torch.device) -> Workspace | None:
    """The workspace :func:`reserve` made for ``device`` (a CUDA device), or None (none made, or not a CUDA device)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _workspaces.get(torch.cuda.current_device() if device.index is None else device.index)


#: shards one launch runs (MAX_SHARDS in csrc/linear.cu)
MAX_SHARDS = 8


def run_trellis_mma(
    x: torch.Tensor,
    trellis: list[torch.Tensor],
    suh: list[torch.Tensor],
    svh: list[torch.Tensor],
    codebook: int,
    k_bits: float,
    out_features: list[int],
    bucket_kernels: int,
    out: torch.Tensor,
    col: int,
) -> None:
    """The CUDA implementation of ``quantpack::trellis_mma_`` (see :func:`trellis_mma_shards_`)."""
    rows = x.shape[0]
    if rows == 0:
        return
    ws = _workspaces.get(x.device.index)
    if ws is None or x.dtype not in (torch.float16, torch.bfloat16) or out.dtype != x.dtype or out.stride(1) != 1:
        raise LibraryError(
            f"trellis_mma: takes float16 / bfloat16 activations and an output of the same dtype with unit column "
            f"stride, after prepare() reserved this GPU's workspace (x {x.dtype}, out {out.dtype} stride "
            f"{tuple(out.stride())}, workspace {'ready' if ws is not None else 'missing'})"
        )
    if out.shape[0] != rows or out.shape[1] < col + sum(out_features):
        raise LibraryError(
            f"trellis_mma: an output of {tuple(out.shape)} for {rows} rows of {sum(out_features)} columns from column "
            f"{col}: it needs {rows} rows and at least {col + sum(out_features)} columns"
        )
    cols = [col + sum(out_features[:i]) for i in range(len(trellis))]
    code = kernel_of(bucket_kernels, rows)
    if code == DELEGATE and ws.delegate is not None:
        for t, s, v, o, c in zip(trellis, suh, svh, out_features, cols, strict=True):
            ws.delegate(x, t, s, v, codebook, k_bits, o, out, c)
        return
    x = x if x.stride(1) == 1 else x.contiguous()
    k = trellis[0].shape[0] * 16
    if not _in_cta(rows) and k > ws.xh.shape[1]:
        raise LibraryError(f"trellis_mma: k {k} is wider than the workspace reserved for this GPU ({ws.xh.shape[1]})")
    if code == DENSE:
        _run_dense(ws, x, trellis, suh, svh, codebook, k_bits, out_features, out, cols)
        return
    if rows <= FUSED_ROWS:  # one launch for every shard
        _launch(ws, x, trellis, suh, svh, codebook, k_bits, out_features, out, cols)
        return
    if code in TC_ROWS and ws.tensor_cores:  # every shard in each launch, in pieces the workspace's input holds
        step = XH_ROWS // len(trellis) // 64 * 64
        for r0 in range(0, rows, step):
            xr, outr = x[r0 : r0 + step], out[r0 : r0 + step]
            _launch_tc(ws, xr, trellis, suh, svh, codebook, k_bits, out_features, outr, cols, TC_ROWS[code])
        return
    if current().wide_fused and len(trellis) > 1:  # every shard in each launch (the workspace holds each one's input)
        step = XH_ROWS // len(trellis) // 64 * 64
        for r0 in range(0, rows, step):
            _launch(ws, x[r0 : r0 + step], trellis, suh, svh, codebook, k_bits, out_features, out[r0 : r0 + step], cols)
        return
    for r0 in range(0, rows, XH_ROWS):  # a launch per shard (the transformed input depends on its suh)
        xr, outr = x[r0 : r0 + XH_ROWS], out[r0 : r0 + XH_ROWS]
        for t, s, v, o, c in zip(trellis, suh, svh, out_features, cols, strict=True):
            _launch(ws, xr, [t], [s], [v], codebook, k_bits, [o], outr, [c])


def _run_dense(ws: Workspace, x: torch.Tensor, trellis, suh, svh, codebook, k_bits, out_features, out, cols) -> None:
    """The dense route: the layer's shards rebuilt in the model dtype (``qp_trellis_dense``) into the workspace's
    buffer, then a GEMM over what it holds, ``out[:, piece] = x @ w.T`` (cuBLAS, summing in float32), as
    :func:`dense_plan` lays them out."""
    k = trellis[0].shape[0] * 16
    weights = ws.dense.view(x.dtype)
    piece = weights.numel() // k // 128 * 128
    if x.shape[1] > k:
        raise LibraryError(f"trellis_mma: dense route: an input of {x.shape[1]} features for a shard of {k}")
    if piece == 0:
        held = f"holds {ws.dense.numel()} bytes, less than 128 columns of k {k}" if ws.dense.numel() else "has none"
        raise LibraryError(
            "trellis_mma: the dense route needs the weights buffer prepare() holds where a call may take the route "
            "(QUANTPACK_TRELLIS_MMA_WIDE_KERNEL unset or dense, above 512 or 16 rows, within the token budget); "
            f"this GPU's workspace {held}"
        )
    rebuild = _dense_rebuilder(ws, x, codebook, k_bits, k)
    with float32_sums():
        for first, width, rebuilds in dense_plan(tuple(out_features), piece):
            for i, c0, n, row in rebuilds:
                rebuild(trellis[i], suh[i], svh[i], c0, n, weights[row * k :])
            _dense_gemm(x, weights, k, width, out, cols[0] + first)


@functools.cache
def dense_plan(out_features: tuple[int, ...], piece: int) -> tuple[tuple[int, int, tuple], ...]:
    """The dense route's GEMMs for a layer's shards of ``out_features`` columns (consecutive in the output) over a
    buffer of ``piece`` columns (a multiple of 128): the shards are rebuilt side by side, so q, k and v (or gate and
    up, as far as the buffer goes) share a GEMM; a shard that does not fit what is left of the buffer is cut at a
    multiple of 128 of its columns (the rebuild's block), or waits for the next GEMM.

    Returns:
        per GEMM ``(first, width, rebuilds)``: its output columns ``first .. first + width`` counted from the first
        shard's, and the rebuilds that fill the buffer's rows ``0 .. width``, each ``(shard, c0, n, row)``: the
        shard's columns ``c0 .. c0 + n`` at row ``row``.

    Raises:
        ValueError: ``piece`` is not a positive multiple of 128 (no shard wider than it could ever be cut).
    """
    if piece <= 0 or piece % 128:
        raise ValueError(f"dense_plan: a buffer of {piece} columns; the rebuild needs a positive multiple of 128")
    gemms, rebuilds, start, filled, base = [], [], 0, 0, 0
    for i, o in enumerate(out_features):
        c0 = 0
        while c0 < o:
            room = piece - filled
            n = o - c0 if o - c0 <= room else room // 128 * 128
            if n == 0:  # full up to less than a block: its GEMM first
                gemms.append((start, filled, tuple(rebuilds)))
                rebuilds, start, filled = [], base + c0, 0
                continue
            rebuilds.append((i, c0, n, filled))
            filled, c0 = filled + n, c0 + n
        base += o
    gemms.append((start, filled, tuple(rebuilds)))
    return tuple(gemms)


def _dense_rebuilder(ws: Workspace, x: torch.Tensor, codebook, k_bits, k):
    """``rebuild(trellis, suh, svh, c0, n, into)``: W^T of a shard's columns ``c0 .. c0 + n`` (``c0`` a multiple of
    128) into the start of ``into``, (n, k) in x's dtype, on the current stream."""
    lib = load(ws.arch)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    bf16 = int(x.dtype == torch.bfloat16)

    def rebuild(t, s, v, c0, n, into):
        code = lib.qp_trellis_dense(
            t.data_ptr(), s.data_ptr(), v.data_ptr(), into.data_ptr(), k, t.shape[1] * 16, c0, n, codebook,
            round(2 * k_bits), bf16, stream,
        )  # fmt: skip
        check(code, f"dense route, k {k}, columns {c0}..{c0 + n}, K {k_bits:g}, codebook {codebook}")

    return rebuild


def _dense_gemm(x: torch.Tensor, weights: torch.Tensor, k: int, filled: int, out: torch.Tensor, start: int) -> None:
    """``out[:, start:start + filled] = x @ w.T`` over the first ``filled`` rebuilt columns of the buffer."""
    w = weights[: filled * k].view(filled, k)[:, : x.shape[1]]
    torch.mm(x, w.t(), out=out[:, start : start + filled])


#: torch's switches that let cuBLAS round the partial sums of a float16 / bfloat16 GEMM to that dtype
REDUCTION_SWITCHES = ("allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction")


@contextlib.contextmanager
def float32_sums():
    """cuBLAS GEMMs inside the block sum in float32 throughout (torch's default lets it round split-K partials to
    the output dtype, which would add a rounding to the dense route's calls of few rows); the switches as they were
    after it (with their split-K part, where the torch release has one)."""
    matmul = torch.backends.cuda.matmul
    before = {}
    for name in REDUCTION_SWITCHES:
        try:
            before[name] = (getattr(matmul, name), getattr(matmul, f"{name}_split_k"))
        except AttributeError:
            before[name] = getattr(matmul, name)
        setattr(matmul, name, False)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(matmul, name, value)


def _shard_arrays(trellis, suh, svh, out_features, cols) -> tuple:
    """The host arrays of a launch's table of shards: pointers to trellis / suh / svh, stored widths, columns, output
    widths, and the count."""
    count = len(trellis)
    ptrs = ctypes.c_void_p * count
    ints = ctypes.c_int * count
    ns = [t.shape[1] * 16 for t in trellis]
    return (
        ptrs(*(t.data_ptr() for t in trellis)), ptrs(*(t.data_ptr() for t in suh)), ptrs(*(t.data_ptr() for t in svh)),
        ints(*ns), ints(*cols), ints(*out_features), count,
    )  # fmt: skip


def _launch_tc(ws: Workspace, x: torch.Tensor, trellis, suh, svh, codebook, k_bits, out_features, out, cols, nr):
    """One ``qp_trellis_tc`` launch (the input transform, then the tensor-core kernel with ``nr`` rows per CTA) of
    every shard at up to :data:`XH_ROWS` / shards rows."""
    lib = load(ws.arch)
    rows, width = x.shape
    k = trellis[0].shape[0] * 16
    code = lib.qp_trellis_tc(
        x.data_ptr(), ws.xh.data_ptr(), *_shard_arrays(trellis, suh, svh, out_features, cols),
        out.data_ptr(), ws.partials.data_ptr(), ws.partials.numel(), ws.counters.data_ptr(), ws.counters.numel(),
        rows, width, x.stride(0), k, out.stride(0), codebook, round(2 * k_bits), int(x.dtype == torch.bfloat16),
        ws.target_ctas, nr, 0, torch.cuda.current_stream(x.device).cuda_stream,
    )  # fmt: skip
    check(code, f"tensor-core kernel, rows {rows}, k {k}, shards {len(trellis)}, K {k_bits:g}, codebook {codebook}")


def _launch(
    ws: Workspace,
    x: torch.Tensor,
    trellis: list[torch.Tensor],
    suh: list[torch.Tensor],
    svh: list[torch.Tensor],
    codebook: int,
    k_bits: float,
    out_features: list[int],
    out: torch.Tensor,
    cols: list[int],
) -> None:
    """One ``qp_trellis_mma`` launch: several shards at up to :data:`FUSED_ROWS` rows (from two rows on, and at
    one row with ``inline_transform_rows`` 0, through the workspace's transformed input), or one shard at up to
    :data:`XH_ROWS` rows (through the workspace's transformed input)."""
    lib = load(ws.arch)
    rows, width = x.shape
    k = trellis[0].shape[0] * 16
    ns = [t.shape[1] * 16 for t in trellis]
    code = lib.qp_trellis_mma(
        x.data_ptr(), None if _in_cta(rows) else ws.xh.data_ptr(),
        *_shard_arrays(trellis, suh, svh, out_features, cols),
        out.data_ptr(), ws.partials.data_ptr(), ws.partials.numel(), ws.counters.data_ptr(), ws.counters.numel(),
        rows, width, x.stride(0), k, out.stride(0),
        codebook, round(2 * k_bits), int(x.dtype == torch.bfloat16),
        ws.target_ctas if rows <= FUSED_ROWS else ws.target_ctas_wide, current().inline_transform_rows,
        torch.cuda.current_stream(x.device).cuda_stream,
    )  # fmt: skip
    check(code, f"rows {rows}, k {k}, n {ns}, K {k_bits:g}, codebook {codebook}")


define_op(
    "trellis_mma_",
    "(Tensor x, Tensor[] trellis, Tensor[] suh, Tensor[] svh, int codebook, float k_bits, int[] out_features, "
    "int bucket_kernels, Tensor(a!) out, int col) -> ()",
    {"CUDA": run_trellis_mma},
)


def trellis_mma_shards_(x: torch.Tensor, *args) -> None:
    """Several trellis shards of one layer that share its input (q / k / v, gate / up; same K and codebook) through one
    ``quantpack::trellis_mma_`` call: up to :data:`FUSED_ROWS` rows one launch runs them all.

    Args:
        x: ``(rows, in)`` float16 or bfloat16 activations.
        args: ``trellis_0, suh_0, svh_0, trellis_1, ...`` (each as in :func:`trellis_mma_`), then ``codebook``,
            ``k_bits``, ``out_features`` (a tuple, one per shard), ``bucket_kernels``, ``out``, ``col``: shard ``i``
            writes
            ``out[:, col + sum(out_features[:i]):][:, :out_features[i]]``.

    Raises:
        quantpack_core.trellis_mma.library.LibraryError: a launch failed (the message names the shape).
    """
    *tensors, codebook, k_bits, out_features, bucket_kernels, out, col = args
    torch.ops.quantpack.trellis_mma_(
        x,
        list(tensors[0::3]),
        list(tensors[1::3]),
        list(tensors[2::3]),
        codebook,
        k_bits,
        list(out_features),
        bucket_kernels,
        out,
        col,
    )


def trellis_mma_(
    x: torch.Tensor,
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: int,
    k_bits: float,
    out_features: int,
    bucket_kernels: int,
    out: torch.Tensor,
    col: int,
) -> None:
    """One trellis shard through the trellis_mma kernels: ``out[:, col:col + out_features] = (x @ W)[:, :out_features]``
    (the op with one shard; :func:`trellis_mma_shards_` runs several).

    A call runs on the kernel its row bucket's code in ``bucket_kernels`` names (:func:`kernel_of`; measured per shape
    at load: :func:`.selection.measure_bucket_kernels`): the split-K kernel (more than 16 rows: 64-row chunks, the
    input transform in its own launch), the tensor-core kernel (Hopper; 17 rows and more), the dense route or the
    GPU's delegate.

    Args:
        x: ``(rows, in)`` float16 or bfloat16 activations (zero-extended to k inside the kernel).
        trellis: int16 ``(k/16, n/16, 16*K)`` on the GPU.
        suh, svh: float16 ``(k,)``, ``(n,)``.
        codebook: 0 = 3INST, 1 = mcg, 2 = mul1.
        k_bits: bits per weight K.
        out_features: logical output width (<= n).
        bucket_kernels: the code of each row bucket (:data:`ROW_BUCKETS`, 3 bits each: :data:`SPLIT`,
            :data:`DELEGATE`, :data:`TC64`, :data:`TC128`, :data:`TC256`, :data:`DENSE`).
        out: ``(rows, total)`` layer output in ``x``'s dtype, unit column stride, written in place.
        col: first output column of this shard.

    Raises:
        quantpack_core.trellis_mma.library.LibraryError: a launch failed (the message names the shape).

    Source: docs/kernels.md; ``csrc/linear.cu`` describes the kernels.
    """
    torch.ops.quantpack.trellis_mma_(
        x, [trellis], [suh], [svh], codebook, k_bits, [out_features], bucket_kernels, out, col
    )
