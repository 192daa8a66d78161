"""The trellis_mma kernels: the project's own CUDA kernels for EXL3 linear shards (sm_80 and newer, tuned on an H200).

Each lane of a warp decodes 8 weights of a 16x16 trellis tile straight into its tensor-core (``mma.m16n8k16``) B
fragment, so a tile is read and decoded once for up to 64 rows and the decoded weights never leave registers; k is
split over CTAs until the GPU is full, and the input / output Hadamard transforms run inside the same launch for up
to 16 rows (the decode case), for all shards of a layer that share its input in one launch (:meth:`fuse`).
``csrc/`` (linear.cu, moe.cu, common.cuh) describes the kernels; :mod:`.library` builds them with nvcc
(once per GPU architecture, cached) and loads them with ctypes. The trellis stays as the pack stores it (memory = the
pack's size). Every K (1..8, 1.5 / 2.5 / 3.5 with mul1) and codebook; float16 and bfloat16 models (the activations
are rounded to fp16 after the input transform, which keeps bf16 models' range in the kernels' own calls; float32
models go to exllamav3).

Where exllamav3's kernels import, each run (a shard, or a layer's fused shards) is timed at load against them on
its own shape, once per row bucket (:data:`.ops.ROW_BUCKETS`), and the buckets where exllamav3's are faster go to
them (:func:`measure_route`; the run's ``route``). The table is logged per shape and kept (:func:`route_records`).

Source: docs/exl3-format.md ("The math", tile placement), docs/kernels.md (how the kernels were measured).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from quantpack_core.codec import Codebook, Exl3Tensors
from quantpack_core.kernels import (
    ExpertKernel,
    ExpertSpec,
    LinearKernel,
    LinearSpec,
    Platform,
    PreparedBank,
    PreparedShard,
)
from quantpack_core.moe import Exl3MoeBank, grouped_inputs

from .library import compiler_reason
from .moe import MAX_EXPERTS as MOE_MAX_EXPERTS
from .moe import MAX_GROUPS as MOE_MAX_GROUPS
from .moe import reserve_moe, trellis_moe_
from .ops import (
    ALL_BUCKETS,
    FUSED_ROWS,
    MAX_SHARDS,
    ROW_BUCKETS,
    delegate_rows_now,
    fixed_route,
    inline_transform_rows_now,
    reserve,
    trellis_mma_,
    trellis_mma_shards_,
    workspace,
)

NAME = "trellis_mma"
#: mma.sync m16n8k16, ldmatrix and cp.async need sm_80
MIN_CAPABILITY = 80
CODEBOOK_IDS = {Codebook.INST3: 0, Codebook.MCG: 1, Codebook.MUL1: 2}
ACT_DTYPES = (torch.float16, torch.bfloat16)

#: exllamav3 takes a row bucket when its calls there take at most this fraction of trellis_mma's time (near-ties stay
#: here, where a CUDA-graph replay is bit-identical to an eager call)
ROUTE_MARGIN = 0.97
#: calls per timed CUDA graph, and replays of it (the best replay counts) when a route is measured
ROUTE_CALLS, ROUTE_REPLAYS = 8, 3

_warmed: set[tuple] = set()
_warned_bf16 = False
#: a prepared shard's trellis tensor -> its model's activation dtype, for fuse(), which sees only prepared shards
#: (keyed by identity: a tensor's == is elementwise)
_act_dtypes = WeakIdKeyDictionary()
logger = logging.getLogger("vllm.quantpack.exl3")


def _common_reason(spec: LinearSpec | ExpertSpec) -> str | None:
    """Why neither trellis_mma kernel takes ``spec`` (not EXL3, not CUDA sm_80+, not a float16 / bfloat16 model), or
    None."""
    if spec.format != "exl3":
        return f"runs EXL3 only, this is {spec.format}"
    why = spec.platform.cuda_reason(MIN_CAPABILITY)
    if why is not None:
        return why
    if spec.act_dtype not in ACT_DTYPES:
        return f"takes float16 / bfloat16 models, not {spec.act_dtype}"
    return None


class TrellisMmaLinearKernel(LinearKernel):
    """One EXL3 shard through the trellis_mma kernels (see the module)."""

    name = NAME

    @classmethod
    def available(cls, platform: Platform) -> tuple[bool, str | None]:
        """CUDA sm_80+, a device torch sees, and a compiler for the kernels (:func:`.library.compiler_reason`);
        neither initializes CUDA nor builds here (vLLM asks this in its front-end process): the build runs at the
        first shard's ``prepare``."""
        why = platform.cuda_reason(MIN_CAPABILITY)
        if why is not None:
            return False, why
        if not torch.cuda.is_available():  # counts devices without creating a CUDA context
            return False, "needs a CUDA device that torch can see (torch.cuda.is_available() is False here)"
        why = compiler_reason()
        if why is not None:
            return False, f"its kernels cannot be built here: {why}"
        return True, None

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str | None]:
        """Every EXL3 shard of a float16 / bfloat16 model on CUDA sm_80+."""
        why = _common_reason(spec)
        return why is None, why

    @classmethod
    def prepare(cls, shard: Exl3Tensors, spec: LinearSpec, device: torch.device) -> PreparedShard:
        """Move the shard's tensors to the GPU, reserve the GPU's workspace for its width, warm both launch kinds
        and measure the shard's route (:func:`measure_route`).

        Returns:
            a :class:`PreparedShard` running ``quantpack::trellis_mma_`` with static ``(codebook id, K,
            out_features, route)``.

        Raises:
            quantpack_exl3.backends.trellis_mma.library.LibraryError: the kernels cannot be built or loaded, or a
                warm-up launch failed (the message names the fix).
        """
        global _warned_bf16
        t = shard
        tensors = {
            "trellis": t.trellis.to(device).contiguous(),
            "suh": t.suh.to(device=device, dtype=torch.float16).contiguous(),
            "svh": t.svh.to(device=device, dtype=torch.float16).contiguous(),
        }
        ws = reserve(device, tensors["trellis"].shape[0] * 16)
        routed = ws.delegate is not None and delegate_rows_now() != 0
        if spec.act_dtype == torch.bfloat16 and routed and not _warned_bf16:
            _warned_bf16 = True
            logger.warning(
                "quantpack-exl3: the row counts of each layer where exllamav3's kernels are faster go to them, and "
                "they take float16 activations: this bfloat16 model's activations are cast there, and values beyond "
                "+-65504 would overflow. Serve with --dtype float16, or set QUANTPACK_TRELLIS_MMA_DELEGATE_ROWS=0 to "
                "keep every call in trellis_mma."
            )
        static = (CODEBOOK_IDS[t.codebook], float(t.k_bits), spec.out_features)
        _act_dtypes[tensors["trellis"]] = spec.act_dtype
        route = measure_route(PreparedShard(trellis_mma_, tensors, spec.out_features, (*static, 0)), spec.act_dtype)
        return PreparedShard(trellis_mma_, tensors, spec.out_features, (*static, route))

    @classmethod
    def fuse(cls, shards: list[PreparedShard]) -> PreparedShard | None:
        """One run for a layer's shards that share its input (q / k / v, gate / up): one launch runs them all from a
        table of shards (:func:`.ops.trellis_mma_shards_`; above 16 rows one launch per whole 64-row chunks that the
        shards' inputs fit in the workspace, :data:`.ops.WIDE_FUSED`).
        The shards keep their own tensors (no copy); the fused run's route is measured on its own
        (:func:`measure_route`; on a GPU whose workspace :meth:`prepare` reserved).

        Returns:
            the fused run (``out_features`` the shards' sum), or None when the shards differ in codebook, K or
            stored input width (one kernel instantiation runs a launch), or are more than :data:`.ops.MAX_SHARDS`.
        """
        if not 1 < len(shards) <= MAX_SHARDS or any(s.run is not trellis_mma_ for s in shards):
            return None
        codebook, k_bits = shards[0].static[:2]
        width = shards[0].tensors["trellis"].shape[0]
        if any(s.static[:2] != (codebook, k_bits) or s.tensors["trellis"].shape[0] != width for s in shards):
            return None
        tensors = {f"{name}{i}": s.tensors[name] for i, s in enumerate(shards) for name in ("trellis", "suh", "svh")}
        outs = tuple(s.out_features for s in shards)
        dtype = _act_dtypes.get(shards[0].tensors["trellis"], torch.float16)
        run = PreparedShard(trellis_mma_shards_, tensors, sum(outs), (codebook, k_bits, outs, 0))
        route = measure_route(run, dtype)
        return PreparedShard(trellis_mma_shards_, tensors, sum(outs), (codebook, k_bits, outs, route))


class TrellisMmaExpertKernel(ExpertKernel):
    """An EXL3 expert bank through the trellis_mma grouped kernels (``quantpack::trellis_moe_``, :mod:`.moe`): the
    routed picks bucketed per expert on the GPU, each expert's trellis decoded once per 16 of its tokens, gate and up
    in one launch for every K group (each work item at its group's K), silu(gate) * up inside the down launch, the
    routing weight applied and the token's picks summed in a fixed order. First in the CUDA list for float16 /
    bfloat16 banks of up to 16 K groups (docs/kernels.md)."""

    name = NAME

    @classmethod
    def available(cls, platform: Platform) -> tuple[bool, str | None]:
        """As the linear kernel: CUDA sm_80+, a device torch sees, a compiler."""
        return TrellisMmaLinearKernel.available(platform)

    @classmethod
    def can_implement(cls, spec: ExpertSpec) -> tuple[bool, str | None]:
        """EXL3 banks of float16 / bfloat16 models on CUDA sm_80+, up to :data:`.moe.MAX_EXPERTS` slots and
        :data:`.moe.MAX_GROUPS` K groups."""
        why = _common_reason(spec)
        if why is not None:
            return False, why
        if spec.num_experts > MOE_MAX_EXPERTS:
            return False, f"takes up to {MOE_MAX_EXPERTS} experts per bank, this one has {spec.num_experts}"
        if len(spec.k_groups) > MOE_MAX_GROUPS:
            return False, f"takes up to {MOE_MAX_GROUPS} K groups per bank, this one has {len(spec.k_groups)}"
        return True, None

    @classmethod
    def prepare(
        cls, bank: Exl3MoeBank, spec: ExpertSpec, hidden: int, intermediate: int, device: torch.device
    ) -> PreparedBank:
        """Keep the bank as stored, build its pointer tables, reserve the GPU's buffers for it and run the op once
        (which sets each kernel instantiation's shared-memory limit before any CUDA-graph capture).

        Returns:
            a :class:`PreparedBank` running ``quantpack::trellis_moe_`` (the inputs of
            :func:`quantpack_core.moe.grouped_inputs`).

        Raises:
            quantpack_exl3.backends.trellis_mma.library.LibraryError: the kernels cannot be built or loaded, or the
                warm-up launch failed.
        """
        plan = bank.plan
        tensors, static = grouped_inputs(bank, CODEBOOK_IDS[plan.codebook], device)
        reserve_moe(device, bank.num_experts, plan.hidden, plan.intermediate)
        dtype = spec.act_dtype
        x = torch.zeros((1, hidden), dtype=dtype, device=device)
        # one pick per group's first slot: every group's gate/up and down instantiation is configured
        firsts = [plan.inv_perm[g.lo] for g in plan.groups]
        ids = torch.tensor([firsts], dtype=torch.int32, device=device)
        w = torch.ones((1, len(firsts)), dtype=torch.float32, device=device)
        trellis_moe_(x, ids, w, *tensors.values(), *static, torch.empty_like(x))
        torch.cuda.synchronize(device)
        return PreparedBank(trellis_moe_, tensors, static)


@dataclass(frozen=True)
class RouteRecord:
    """How one run shape was routed at load.

    Attributes:
        k: stored input features.
        out_features: the run's shards' output widths.
        k_bits, codebook: the shards' K and codebook id (0 = 3INST, 1 = mcg, 2 = mul1).
        dtype: the model's activation dtype, timed with.
        rows: the row count timed per bucket (:data:`.ops.ROW_BUCKETS`).
        trellis_mma_us, exllamav3_us: microseconds per call (CUDA-graph replay), per bucket; empty when the route was
            not measured (a fixed ``QUANTPACK_TRELLIS_MMA_DELEGATE_ROWS``).
        route: bit i set: bucket i goes to exllamav3.
    """

    k: int
    out_features: tuple[int, ...]
    k_bits: float
    codebook: int
    dtype: torch.dtype
    rows: tuple[int, ...]
    trellis_mma_us: tuple[float, ...]
    exllamav3_us: tuple[float, ...]
    route: int

    def describe(self) -> str:
        """One log line: the shape, then per bucket both times and the kernel that serves it."""
        outs = "+".join(str(n) for n in self.out_features)
        cells = []
        for i, rows in enumerate(self.rows):
            mark = "exllamav3" if (self.route >> i) & 1 else "trellis_mma"
            if self.trellis_mma_us:
                cells.append(f"{rows}: {self.trellis_mma_us[i]:.1f}/{self.exllamav3_us[i]:.1f} us {mark}")
            else:
                cells.append(f"{rows}: {mark}")
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.k} -> {outs}, K {self.k_bits:g} codebook {self.codebook}, {dtype}: " + ", ".join(cells)


_routes: dict[tuple, RouteRecord] = {}


def route_records() -> list[RouteRecord]:
    """Every run shape routed in this process so far, in the order they were first prepared."""
    return list(_routes.values())


def measure_route(run: PreparedShard, dtype: torch.dtype = torch.float16) -> int:
    """The route of a trellis_mma run (a shard, or a layer's fused shards): which row buckets
    (:data:`.ops.ROW_BUCKETS`) go to exllamav3's kernels. Called at load, before any CUDA-graph capture.

    With exllamav3's extension importable and ``QUANTPACK_TRELLIS_MMA_DELEGATE_ROWS`` unset, both kernels run the
    run's shape at each bucket's largest row count with activations of the model's ``dtype`` (exllamav3's calls of a
    bfloat16 model cast and copy, and tune as a float32-output shape): ``ROUTE_CALLS`` calls in one CUDA graph, the
    best of ``ROUTE_REPLAYS`` replays, the two kernels alternating. A bucket goes to exllamav3 where its time is at
    most :data:`ROUTE_MARGIN` of trellis_mma's. A shape measured once in a process (per dtype) keeps its route. With
    the setting, the route is :func:`.ops.fixed_route`. Both kernels also run once here at every row count either
    would need warmed before capture (each trellis_mma launch kind; exllamav3's autotune buckets). Tensors off the
    GPU, or a GPU without a workspace, or no exllamav3: route 0 (every call here), nothing timed.

    Returns:
        the route (an int bit mask).

    Raises:
        quantpack_exl3.backends.trellis_mma.library.LibraryError: a launch failed (the message names the shape).

    Source: docs/kernels.md ("The selection").
    """
    trellis = _trellis_of(run)
    device = trellis[0].device
    ws = workspace(device)
    if ws is None:
        return 0
    codebook, k_bits, outs = run.static[:3]
    outs = tuple(outs) if isinstance(outs, tuple) else (outs,)
    k = trellis[0].shape[0] * 16
    setting = delegate_rows_now()
    key = (k, tuple(tuple(t.shape) for t in trellis), codebook, k_bits, dtype, device, setting)
    known = _routes.get(key)
    if known is not None:
        return known.route
    warm_up(run, k, ws.delegate is not None and setting != 0, dtype)  # exllamav3 only where a route can reach it
    if ws.delegate is None:
        return 0
    if setting is not None:
        route, mine, theirs = fixed_route(setting), (), ()
    else:
        mine, theirs = [], []
        generator = torch.Generator(device=device).manual_seed(0)
        for rows in ROW_BUCKETS:
            x = torch.randn((rows, k), generator=generator, device=device).to(dtype)
            out = torch.empty((rows, run.out_features), dtype=dtype, device=device)
            a, b = _graph_us(run, x, out, 0), _graph_us(run, x, out, ALL_BUCKETS)
            mine.append(min(a, _graph_us(run, x, out, 0)))
            theirs.append(min(b, _graph_us(run, x, out, ALL_BUCKETS)))
            del x, out
        route = sum(1 << i for i, (m, t) in enumerate(zip(mine, theirs, strict=True)) if t <= ROUTE_MARGIN * m)
        torch.cuda.empty_cache()  # exllamav3's large-row path reconstructs whole matrices in the graphs' pools
    record = RouteRecord(k, outs, k_bits, codebook, dtype, ROW_BUCKETS, tuple(mine), tuple(theirs), route)
    _routes[key] = record
    logger.info("quantpack-exl3: trellis_mma route, %s", record.describe())
    return route


def _trellis_of(run: PreparedShard) -> list[torch.Tensor]:
    """The trellis tensors of a run: ``trellis`` of one shard, ``trellis0``, ``trellis1``, ... of a fused one."""
    return [t for name, t in run.tensors.items() if name.startswith("trellis")]


def _graph_us(run: PreparedShard, x: torch.Tensor, out: torch.Tensor, route: int) -> float:
    """Microseconds per call of ``run`` on ``x`` with ``route``: ``ROUTE_CALLS`` calls captured in one CUDA graph,
    the best of ``ROUTE_REPLAYS`` replays."""
    static = (*run.static[:3], route)
    run.run(x, *run.tensors.values(), *static, out, 0)  # eager first: nothing lazy happens during the capture
    torch.cuda.synchronize(x.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ROUTE_CALLS):
            run.run(x, *run.tensors.values(), *static, out, 0)
    best = float("inf")
    for _ in range(ROUTE_REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / ROUTE_CALLS)
    del graph
    return best


def warm_up(run: PreparedShard, in_features: int, exllamav3: bool, dtype: torch.dtype = torch.float16) -> None:
    """Run a new run shape once eagerly at every row count a CUDA-graph capture would otherwise meet first: the fused
    kernel (1 row), the unfused ones (2 and 17 rows), so that their shared-memory limits are set; and, with
    ``exllamav3`` (its kernels can take buckets), each of exllamav3's autotune buckets (its kernels time their launch
    shapes on a shape's first call, which must not happen during capture; its key includes the output's dtype, so
    activations of the model's ``dtype``). A shape already warmed in this process the same way is skipped."""
    trellis = _trellis_of(run)
    device = trellis[0].device
    key = (tuple(tuple(t.shape) for t in trellis), run.static[0], dtype, device, exllamav3, inline_transform_rows_now())
    if key in _warmed:
        return
    # one row (the in-CTA transform's kernel, unless INLINE_TRANSFORM_ROWS is 0), two rows (the few-row kernel that
    # streams the transformed input), FUSED_ROWS + 1 (the 64-row kernel)
    calls = [(1, 0), (2, 0), (FUSED_ROWS + 1, 0)]
    if exllamav3:
        from ..exllamav3.kernels import WARMUP_ROWS

        calls += [(r, ALL_BUCKETS) for r in WARMUP_ROWS]
    generator = torch.Generator(device=device).manual_seed(0)
    for rows, r in calls:
        x = torch.randn((rows, in_features), generator=generator, device=device).to(dtype)
        out = torch.empty((rows, run.out_features), dtype=dtype, device=device)
        run.run(x, *run.tensors.values(), *run.static[:3], r, out, 0)
    torch.cuda.synchronize(device)
    _warmed.add(key)
