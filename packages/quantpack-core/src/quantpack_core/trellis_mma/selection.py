"""Which row buckets of a trellis_mma run go to another implementation of the same call (the run's ``delegated``
mask), measured when the run is prepared; and the warm-up of every launch shape a CUDA-graph capture would otherwise
meet first.

The other implementation is the run's format's to give (:class:`Delegate`: its adapter kernel passes it to
:func:`.kernels.prepare_shard`): a callable with the arguments of one shard of ``quantpack::trellis_mma_``. Each run
(a shard, or a layer's fused shards) is timed at load against it on its own shape, once per row bucket
(:data:`.ops.ROW_BUCKETS`), and the buckets where it is faster go to it (:func:`measure_delegated`; the run's
``delegated`` mask). The table is logged per shape and kept (:func:`delegation_records`).

Source: docs/kernels.md ("The selection").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from quantpack_core.kernels import PreparedShard

from .ops import (
    ALL_BUCKETS,
    FUSED_ROWS,
    ROW_BUCKETS,
    fixed_delegated,
    workspace,
)
from .settings import current

logger = logging.getLogger("vllm.quantpack")

#: the delegate takes a row bucket when its calls there take at most this fraction of trellis_mma's time (near-ties
#: stay here, where a CUDA-graph replay is bit-identical to an eager call)
DELEGATE_MARGIN = 0.97
#: calls per timed CUDA graph, and replays of it (the best replay counts) when the delegated row buckets are measured
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


@dataclass(frozen=True)
class DelegationRecord:
    """Which row buckets of one run shape were delegated at load.

    Attributes:
        k: stored input features.
        out_features: the run's shards' output widths.
        k_bits, codebook: the shards' K and codebook id (0 = 3INST, 1 = mcg, 2 = mul1).
        dtype: the model's activation dtype, timed with.
        delegate: the delegate's name.
        rows: the row count timed per bucket (:data:`.ops.ROW_BUCKETS`).
        own_us, delegate_us: microseconds per call (CUDA-graph replay) of trellis_mma's launches and of the
            delegate, per bucket; empty when nothing was measured (a fixed
            ``QUANTPACK_TRELLIS_MMA_DELEGATE_ROWS``).
        delegated: bit i set: bucket i goes to the delegate.
    """

    k: int
    out_features: tuple[int, ...]
    k_bits: float
    codebook: int
    dtype: torch.dtype
    delegate: str
    rows: tuple[int, ...]
    own_us: tuple[float, ...]
    delegate_us: tuple[float, ...]
    delegated: int

    def describe(self) -> str:
        """One log line: the shape, then per bucket both times and the implementation that serves it."""
        outs = "+".join(str(n) for n in self.out_features)
        cells = []
        for i, rows in enumerate(self.rows):
            mark = self.delegate if (self.delegated >> i) & 1 else "trellis_mma"
            if self.own_us:
                cells.append(f"{rows}: {self.own_us[i]:.1f}/{self.delegate_us[i]:.1f} us {mark}")
            else:
                cells.append(f"{rows}: {mark}")
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.k} -> {outs}, K {self.k_bits:g} codebook {self.codebook}, {dtype}: " + ", ".join(cells)


_records: dict[tuple, DelegationRecord] = {}
_warmed: set[tuple] = set()


def delegation_records() -> list[DelegationRecord]:
    """Every run shape measured in this process so far, in the order they were first prepared."""
    return list(_records.values())


def measure_delegated(run: PreparedShard, dtype: torch.dtype, delegate: Delegate | None) -> int:
    """The delegated row buckets of a trellis_mma run (a shard, or a layer's fused shards): which row buckets
    (:data:`.ops.ROW_BUCKETS`) go to ``delegate``. Called at load, before any CUDA-graph capture.

    With a delegate and ``QUANTPACK_TRELLIS_MMA_DELEGATE_ROWS`` unset, both run the run's shape at each bucket's
    largest row count with activations of the model's ``dtype``: ``TIMED_CALLS`` calls in one CUDA graph, the best
    of ``TIMED_REPLAYS`` replays, the two alternating. A bucket goes to the delegate where its time is at most
    :data:`DELEGATE_MARGIN` of trellis_mma's. A shape measured once in a process (per dtype) keeps its mask. With the
    setting, the mask is :func:`.ops.fixed_delegated`. Both also run once here at every row count either would need
    warmed before capture (:func:`warm_up`). Tensors off the GPU, or a GPU without a workspace, or no delegate:
    mask 0 (every call here), nothing timed.

    Returns:
        the delegated mask (an int, bit i for bucket i).

    Raises:
        quantpack_core.trellis_mma.library.LibraryError: a launch failed (the message names the shape).
    """
    trellis = _trellis_of(run)
    device = trellis[0].device
    if workspace(device) is None:
        return 0
    codebook, k_bits, outs = run.static[:3]
    outs = tuple(outs) if isinstance(outs, tuple) else (outs,)
    k = trellis[0].shape[0] * 16
    setting = current().delegate_rows
    name = None if delegate is None else delegate.name
    key = (k, tuple(tuple(t.shape) for t in trellis), codebook, k_bits, dtype, device, setting, name)
    known = _records.get(key)
    if known is not None:
        return known.delegated
    warm_up(run, k, delegate if setting != 0 else None, dtype)  # the delegate only where the mask can reach it
    if delegate is None:
        return 0
    if setting is not None:
        delegated, mine, theirs = fixed_delegated(setting), (), ()
    else:
        mine, theirs = _time_buckets(run, k, dtype)
        delegated = sum(1 << i for i, (m, t) in enumerate(zip(mine, theirs, strict=True)) if t <= DELEGATE_MARGIN * m)
    record = DelegationRecord(k, outs, k_bits, codebook, dtype, delegate.name, ROW_BUCKETS, mine, theirs, delegated)
    _records[key] = record
    logger.info("quantpack: trellis_mma row buckets delegated, %s", record.describe())
    return delegated


def _time_buckets(run: PreparedShard, k: int, dtype: torch.dtype) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Microseconds per call of trellis_mma's launches and of the delegate at each bucket's largest row count."""
    device = _trellis_of(run)[0].device
    mine, theirs = [], []
    generator = torch.Generator(device=device).manual_seed(0)
    for rows in ROW_BUCKETS:
        x = torch.randn((rows, k), generator=generator, device=device).to(dtype)
        out = torch.empty((rows, run.out_features), dtype=dtype, device=device)
        a, b = _graph_us(run, x, out, 0), _graph_us(run, x, out, ALL_BUCKETS)
        mine.append(min(a, _graph_us(run, x, out, 0)))
        theirs.append(min(b, _graph_us(run, x, out, ALL_BUCKETS)))
        del x, out
    torch.cuda.empty_cache()  # a delegate's large-row path may hold whole matrices in the graphs' pools
    return tuple(mine), tuple(theirs)


def _trellis_of(run: PreparedShard) -> list[torch.Tensor]:
    """The trellis tensors of a run: ``trellis`` of one shard, ``trellis0``, ``trellis1``, ... of a fused one."""
    return [t for name, t in run.tensors.items() if name.startswith("trellis")]


def _graph_us(run: PreparedShard, x: torch.Tensor, out: torch.Tensor, delegated: int) -> float:
    """Microseconds per call of ``run`` on ``x`` with ``delegated``: ``TIMED_CALLS`` calls captured in one CUDA graph,
    the best of ``TIMED_REPLAYS`` replays."""
    static = (*run.static[:3], delegated)
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


def warm_up(run: PreparedShard, in_features: int, delegate: Delegate | None, dtype: torch.dtype) -> None:
    """Run a new run shape once eagerly at every row count a CUDA-graph capture would otherwise meet first: the fused
    kernel (1 row), the unfused ones (2 and 17 rows), so that their shared-memory limits are set; and, with a
    ``delegate`` (it can take buckets), each of its ``warm_rows`` (e.g. kernels that time their launch shapes on a
    shape's first call, which must not happen during capture; with activations of the model's ``dtype``). A shape
    already warmed in this process the same way is skipped."""
    trellis = _trellis_of(run)
    device = trellis[0].device
    name = None if delegate is None else delegate.name
    key = (tuple(tuple(t.shape) for t in trellis), run.static[0], dtype, device, name, current().inline_transform_rows)
    if key in _warmed:
        return
    # one row (the in-CTA transform's kernel, unless inline_transform_rows is 0), two rows (the few-row kernel that
    # streams the transformed input), FUSED_ROWS + 1 (the 64-row kernel)
    calls = [(1, 0), (2, 0), (FUSED_ROWS + 1, 0)]
    if delegate is not None:
        calls += [(r, ALL_BUCKETS) for r in delegate.warm_rows]
    generator = torch.Generator(device=device).manual_seed(0)
    for rows, r in calls:
        x = torch.randn((rows, in_features), generator=generator, device=device).to(dtype)
        out = torch.empty((rows, run.out_features), dtype=dtype, device=device)
        run.run(x, *run.tensors.values(), *run.static[:3], r, out, 0)
    torch.cuda.synchronize(device)
    _warmed.add(key)
