"""Which kernel serves each row bucket of a trellis_mma run (the run's ``bucket_kernels``), measured when the run is
prepared; and the warm-up of every launch shape a CUDA-graph capture would otherwise meet first.

Per row bucket (:data:`.ops.ROW_BUCKETS`) the candidates are the split-K kernel, on Hopper from 17 rows on the
tensor-core kernel with 64, 128 or 256 rows per CTA (no more rows per CTA than the bucket's next power of two above 64),
in the buckets from the one up to :data:`.ops.DENSE_ROWS` rows (calls of 513 rows on) the dense route (the weights
rebuilt once per call, then cuBLAS) where the workspace holds its buffer, and another implementation of the same call
that the run's format may give (:class:`Delegate`: its adapter kernel passes it to :func:`.kernels.prepare_shard`).
Each candidate runs the run's shape at the bucket's largest row count (and its smallest too where the dense route is
among them), and the fastest of the project's own kernels serves the bucket, unless the delegate takes at most
:data:`DELEGATE_MARGIN` of its time (:func:`measure_bucket_kernels`); buckets above the most rows a call takes (a
serving engine's token budget, where the adapter gives it) are left out. The table is logged per shape and kept
(:func:`selection_records`).

Source: docs/kernels.md ("The selection").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from quantpack_core.kernels import PreparedShard

from .ops import (
    DELEGATE,
    DENSE,
    DENSE_ROWS,
    FUSED_ROWS,
    ROW_BUCKETS,
    SPLIT,
    TC64,
    TC128,
    TC256,
    TC_ROWS,
    bucket_kernels_of,
    kernel_of,
    row_bucket,
    tc_code,
    workspace,
)
from .settings import current

logger = logging.getLogger("vllm.quantpack")

#: the delegate takes a row bucket when its calls there take at most this fraction of trellis_mma's time (near-ties
#: stay here, where a CUDA-graph replay is bit-identical to an eager call)
DELEGATE_MARGIN = 0.97
#: calls per timed CUDA graph, and replays of it (the best replay counts) when a run's kernels are measured
TIMED_CALLS, TIMED_REPLAYS = 8, 3


@dataclass(frozen=True)
class Delegate:
    """Another implementation of one trellis shard's call, which the row buckets where it is faster go to.

    Attributes:
        name: what the log lines and records call it.
        gemm: ``(x, trellis, suh, svh, codebook, k_bits, out_features, out, col) -> None``, writing
            ``out[:, col:col + out_features]`` as one shard of ``quantpack::trellis_mma_`` does.
        warm_rows: row counts it must have run once before a CUDA-graph capture (e.g. its autotune buckets).
    """

    name: str
    gemm: Callable[..., None]
    warm_rows: tuple[int, ...] = ()


#: what the records and log lines call each code
KERNEL_NAMES = {SPLIT: "split", TC64: "tc64", TC128: "tc128", TC256: "tc256", DENSE: "dense"}


@dataclass(frozen=True)
class SelectionRecord:
    """Which kernel serves each row bucket of one run shape, chosen at load.

    Attributes:
        k: stored input features.
        out_features: the run's shards' output widths.
        k_bits, codebook: the shards' K and codebook id (0 = 3INST, 1 = mcg, 2 = mul1).
        dtype: the model's activation dtype, timed with.
        delegate: the delegate's name, or None.
        rows: each measured bucket's largest row count (:data:`.ops.ROW_BUCKETS`), at most the most rows a call
            takes (the workspace's ``max_rows``); the buckets above the last one that a call reaches are not
            measured and serve as it (:func:`reached_buckets`).
        times_us: per bucket, ``(code, microseconds)`` of each candidate (CUDA-graph replay): a call at each of the
            bucket's :meth:`timed_rows`, summed; a bucket of one candidate is not timed (``(code, 0.0)``); empty
            when no bucket had a choice.
        bucket_kernels: the codes chosen (:func:`.ops.kernel_of`).
    """

    k: int
    out_features: tuple[int, ...]
    k_bits: float
    codebook: int
    dtype: torch.dtype
    delegate: str | None
    rows: tuple[int, ...]
    times_us: tuple[tuple[tuple[int, float], ...], ...]
    bucket_kernels: int

    def name(self, code: int) -> str:
        """What the records call a code."""
        return self.delegate if code == DELEGATE else KERNEL_NAMES[code]

    def timed_rows(self, bucket: int) -> tuple[int, ...]:
        """The row counts a call of each candidate ran at in bucket ``bucket`` (:func:`timed_row_counts`); () where
        the bucket was not timed."""
        timed = self.times_us[bucket] if self.times_us else ()
        return timed_row_counts(bucket, [c for c, _ in timed], self.rows[bucket]) if len(timed) > 1 else ()

    def describe(self) -> str:
        """One log line: the shape, then per bucket the kernel that serves it and, where the bucket had a choice, the
        row counts timed and each candidate's time (their sum where two)."""
        outs = "+".join(str(n) for n in self.out_features)
        cells = []
        for i, rows in enumerate(self.rows):
            chosen = self.name(kernel_of(self.bucket_kernels, rows))
            counts = self.timed_rows(i)
            times = " ".join(f"{self.name(c)} {us:.1f}" for c, us in self.times_us[i]) if counts else ""
            at = "+".join(str(r) for r in counts)
            cells.append(f"{rows}: {chosen}" + (f" ({at} rows: {times} us)" if times else ""))
        if len(self.rows) < len(ROW_BUCKETS):
            cells.append(f"above: as {self.rows[-1]} (not timed: above the token budget)")
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.k} -> {outs}, K {self.k_bits:g} codebook {self.codebook}, {dtype}: " + ", ".join(cells)


_records: dict[tuple, SelectionRecord] = {}
_warmed: set[tuple] = set()


def selection_records() -> list[SelectionRecord]:
    """Every run shape measured in this process so far, in the order they were first prepared."""
    return list(_records.values())


def own_candidates(bound: int, tensor_cores: bool, dense: bool = True) -> list[int]:
    """The project's kernels that may serve a bucket of up to ``bound`` rows under the settings in force: up to 16
    rows, or with ``wide_kernel`` "split", the split-K kernel; with "dense" the dense route; with "tc" the
    tensor-core kernel at :func:`.ops.tc_code` (the split-K kernel without tensor cores); unset, the split-K kernel,
    with tensor cores the tensor-core kernel with every row count per CTA up to ``bound`` rounded up to 64, and from
    :data:`.ops.DENSE_ROWS` rows the dense route where ``dense`` (the workspace holds its buffer)."""
    wide = current().wide_kernel
    if bound <= FUSED_ROWS or wide == "split":
        return [SPLIT]
    if wide == "dense":
        return [DENSE]
    if wide == "tc":
        return [tc_code(bound)] if tensor_cores else [SPLIT]
    tc = [code for code in (TC64, TC128, TC256) if TC_ROWS[code] <= max(bound, 64)] if tensor_cores else []
    return [SPLIT, *tc, *([DENSE] if dense and bound >= DENSE_ROWS else [])]


def bucket_options(bucket: int, tensor_cores: bool, delegate: Delegate | None, dense: bool = True) -> list[int]:
    """The codes that may serve row bucket ``bucket``: the delegate alone where ``delegate_rows`` N is set and the
    bucket's smallest row count exceeds N (above 1024 counting as 1024), else :func:`own_candidates` (``dense``: the
    workspace holds the dense route's buffer), with the delegate where one is given and ``delegate_rows`` is
    unset."""
    above = current().delegate_rows
    first = ROW_BUCKETS[bucket - 1] + 1 if bucket else 1
    if delegate is not None and above and first > min(above, ROW_BUCKETS[-2]):
        return [DELEGATE]
    own = own_candidates(ROW_BUCKETS[bucket], tensor_cores, dense)
    return [*own, DELEGATE] if delegate is not None and above is None else own


def dense_may_serve(delegate: Delegate | None, max_rows: int | None) -> bool:
    """Whether the dense route is among the :func:`bucket_options` of a bucket that a call of up to ``max_rows``
    rows (None: unknown) reaches, for a run with ``delegate``, under the settings in force."""
    return any(DENSE in bucket_options(i, True, delegate) for i in range(reached_buckets(max_rows)))


def measure_bucket_kernels(run: PreparedShard, dtype: torch.dtype, delegate: Delegate | None) -> int:
    """The ``bucket_kernels`` of a trellis_mma run (a shard, or a layer's fused shards): which kernel serves each row
    bucket. Called at load, before any CUDA-graph capture.

    Where a bucket has several :func:`bucket_options`, each runs the run's shape at the bucket's largest row count
    (and, where the dense route is among them, at its smallest too: the route's rebuild costs the same at any row
    count, so the largest alone would favour it) with activations of the model's ``dtype``: ``TIMED_CALLS`` calls in
    one CUDA graph, the best of ``TIMED_REPLAYS`` replays, twice in alternation; the fastest of the project's own
    kernels (over both row counts together where two are timed) serves the bucket unless the delegate takes at most
    :data:`DELEGATE_MARGIN` of its time. The buckets above the most rows a call takes (the workspace's ``max_rows``)
    are neither timed nor warmed and serve as the last bucket a call reaches, timed at ``max_rows`` rows where that
    is less than its bound. A shape measured once in a process (per dtype, settings and row counts timed) keeps its
    codes. Every launch kind a capture could meet first runs once here (:func:`warm_up`). Tensors off the GPU, or a
    GPU without a workspace: every bucket on the split-K kernel, nothing timed.

    Returns:
        the codes, 3 bits a bucket (:func:`.ops.bucket_kernels_of`).

    Raises:
        quantpack_core.trellis_mma.library.LibraryError: a launch failed (the message names the shape).
    """
    trellis = _trellis_of(run)
    device = trellis[0].device
    ws = workspace(device)
    if ws is None:
        return bucket_kernels_of([SPLIT] * len(ROW_BUCKETS))
    codebook, k_bits, outs = run.static[:3]
    outs = tuple(outs) if isinstance(outs, tuple) else (outs,)
    k = trellis[0].shape[0] * 16
    name = None if delegate is None else delegate.name
    rows = tuple(min(bound, ws.max_rows or bound) for bound in ROW_BUCKETS[: reached_buckets(ws.max_rows)])
    key = (k, tuple(tuple(t.shape) for t in trellis), codebook, k_bits, dtype, device, current(), name, rows)
    known = _records.get(key)
    if known is not None:
        return known.bucket_kernels
    # the route's buffer is held where a bucket a call reaches may take it (prepare_shard, dense_may_serve)
    options = [bucket_options(i, ws.tensor_cores, delegate, ws.holds_dense) for i in range(len(rows))]
    reach = delegate if any(DELEGATE in o for o in options) else None  # the delegate only where it can serve
    warm_up(run, k, reach, dtype, ws.tensor_cores, any(DENSE in o for o in options))
    times = _time_buckets(run, k, dtype, options, rows) if any(len(o) > 1 for o in options) else ()
    codes = [_choose(t) for t in times] if times else [o[0] for o in options]
    chosen = bucket_kernels_of(codes + codes[-1:] * (len(ROW_BUCKETS) - len(codes)))
    record = SelectionRecord(k, outs, k_bits, codebook, dtype, name, rows, times, chosen)
    _records[key] = record
    logger.info("quantpack: trellis_mma kernels per row bucket, %s", record.describe())
    return chosen


def _choose(timed: tuple[tuple[int, float], ...]) -> int:
    """The code that serves a bucket from its candidates' times: the fastest own kernel, or the delegate where it
    takes at most :data:`DELEGATE_MARGIN` of that one's time (or is the only candidate)."""
    if len(timed) == 1:
        return timed[0][0]
    own = min((us, code) for code, us in timed if code != DELEGATE)
    theirs = [us for code, us in timed if code == DELEGATE]
    return DELEGATE if theirs and theirs[0] <= DELEGATE_MARGIN * own[0] else own[1]


def reached_buckets(max_rows: int | None) -> int:
    """How many row buckets, from the first, hold calls of at most ``max_rows`` rows (None: unknown, every one)."""
    return len(ROW_BUCKETS) if max_rows is None else row_bucket(max(max_rows, 1)) + 1


def timed_row_counts(bucket: int, codes: list[int], largest: int | None = None) -> tuple[int, ...]:
    """The row counts each of ``codes`` (a bucket's candidates) runs at to time bucket ``bucket``: its largest (or
    ``largest``, the most rows a call takes, where that is less), and its smallest too where the dense route is among
    them (whose rebuild costs the same at any row count)."""
    bound = ROW_BUCKETS[bucket]
    first, top = (ROW_BUCKETS[bucket - 1] + 1 if bucket else 1), min(largest or bound, bound)
    return (first, top) if DENSE in codes and top > first else (top,)


def _time_buckets(
    run: PreparedShard, k: int, dtype: torch.dtype, options: list[list[int]], rows: tuple[int, ...]
) -> tuple:
    """Per bucket, ``(code, microseconds)`` of each candidate: the sum of a call at each of the bucket's
    :func:`timed_row_counts` (``rows``: each bucket's largest calls; a single candidate is not timed:
    ``(code, 0.0)``)."""
    device = _trellis_of(run)[0].device
    generator = torch.Generator(device=device).manual_seed(0)
    times = []
    for i, codes in enumerate(options):
        if len(codes) == 1:
            times.append(((codes[0], 0.0),))
            continue
        total = [0.0] * len(codes)
        for count in timed_row_counts(i, codes, rows[i]):
            x = torch.randn((count, k), generator=generator, device=device).to(dtype)
            out = torch.empty((count, run.out_features), dtype=dtype, device=device)
            first = [_graph_us(run, x, out, _everywhere(c)) for c in codes]
            again = [_graph_us(run, x, out, _everywhere(c)) for c in codes]
            total = [t + min(a, b) for t, a, b in zip(total, first, again, strict=True)]
            del x, out
        times.append(tuple(zip(codes, total, strict=True)))
    torch.cuda.empty_cache()  # a delegate's large-row path may hold whole matrices in the graphs' pools
    return tuple(times)


def _everywhere(code: int) -> int:
    """``bucket_kernels`` with one code in every bucket."""
    return bucket_kernels_of([code] * len(ROW_BUCKETS))


def _trellis_of(run: PreparedShard) -> list[torch.Tensor]:
    """The trellis tensors of a run: ``trellis`` of one shard, ``trellis0``, ``trellis1``, ... of a fused one."""
    return [t for name, t in run.tensors.items() if name.startswith("trellis")]


def _graph_us(run: PreparedShard, x: torch.Tensor, out: torch.Tensor, bucket_kernels: int) -> float:
    """Microseconds per call of ``run`` on ``x`` with ``bucket_kernels``: ``TIMED_CALLS`` calls captured in one CUDA
    graph, the best of ``TIMED_REPLAYS`` replays."""
    static = (*run.static[:3], bucket_kernels)
    run.run(x, *run.tensors.values(), *static, out, 0)  # eager first: nothing lazy happens during the capture
    torch.cuda.synchronize(x.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(TIMED_CALLS):
            run.run(x, *run.tensors.values(), *static, out, 0)
    best = float("inf")
    for _ in range(TIMED_REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / TIMED_CALLS)
    del graph
    return best


def warm_up(
    run: PreparedShard,
    in_features: int,
    delegate: Delegate | None,
    dtype: torch.dtype,
    tensor_cores: bool = False,
    dense: bool = False,
) -> None:
    """Run a new run shape once eagerly at every launch kind a CUDA-graph capture would otherwise meet first: the fused
    split-K kernel (1 row), the unfused ones (2 and 17 rows), with ``dense`` the dense route (its kernel's
    shared-memory limit and cuBLAS's first call) and, with ``tensor_cores``, the tensor-core kernel's three row counts
    per CTA, so that their shared-memory limits are set; and, with a ``delegate`` (it can take buckets), each of its
    ``warm_rows`` (e.g. kernels that time their launch shapes on a shape's first call, which must not happen during
    capture; with activations of the model's ``dtype``). A shape already warmed in this process the same way is
    skipped."""
    trellis = _trellis_of(run)
    device = trellis[0].device
    name = None if delegate is None else delegate.name
    settings = (current().inline_transform_rows, current().wide_kernel)
    key = (tuple(tuple(t.shape) for t in trellis), run.static[0], dtype, device, name, settings, tensor_cores, dense)
    if key in _warmed:
        return
    # one row (the in-CTA transform's kernel, unless inline_transform_rows is 0), two rows (the few-row kernel that
    # streams the transformed input), FUSED_ROWS + 1 (the 64-row kernel)
    calls = [(1, SPLIT), (2, SPLIT), (FUSED_ROWS + 1, SPLIT)]
    if dense:
        calls.append((FUSED_ROWS + 1, DENSE))
    if tensor_cores:
        calls += [(FUSED_ROWS + 1, code) for code in (TC64, TC128, TC256)]
    if delegate is not None:
        calls += [(r, DELEGATE) for r in delegate.warm_rows]
    generator = torch.Generator(device=device).manual_seed(0)
    for rows, code in calls:
        x = torch.randn((rows, in_features), generator=generator, device=device).to(dtype)
        out = torch.empty((rows, run.out_features), dtype=dtype, device=device)
        run.run(x, *run.tensors.values(), *run.static[:3], _everywhere(code), out, 0)
    torch.cuda.synchronize(device)
    _warmed.add(key)
