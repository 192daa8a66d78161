"""GPU tier: every CUDA linear kernel (exllamav3's through ``quantpack::exl3_gemm_``, the project's own through
``quantpack::trellis_mma_``), each test once per kernel (``-k trellis_mma`` selects one).

For every tensor of the bundled packs and for random layers of every K and codebook over 1..4096 rows, the op's
relative error against the fp64 reference (core codec) must be no worse than 1.1x that of exllamav3's own
``LinearEXL3.forward`` against the same reference; results are never NaN, every column of the shard is written and
no other. Plus opcheck, torch.compile without graph breaks, and CUDA-graph capture and replay (bit-identical to an
eager call for the deterministic trellis_mma kernels).
"""

import contextlib
from pathlib import Path

import pytest
import torch
from ops_check import opcheck

from quantpack_core import Exl3Tensors, Pack, reference_linear
from quantpack_core.codec.trellis import HALF_K
from quantpack_core.compare import relative_error
from quantpack_core.synthetic import random_exl3_layer
from quantpack_core.trellis_mma import settings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU tier: nox -s gpu-tests)"),
]

EXL3_PACKS = [
    "llama-tiny-exl3-4.0bpw-mul1",
    "llama-tiny-exl3-4.0bpw-mcg",
    "llama-tiny-exl3-3.0bpw-3inst-h8",
    "llama-tiny-exl3-2.5bpw-mul1",
    "qwen3_5-tiny-exl3-4.0bpw-mul1",
]
RANDOM_K = [1, 2, 2.5, 3, 4, 5, 6, 8]
RANDOM_CASES = [(k, cb) for k in RANDOM_K for cb in ("3inst", "mcg", "mul1") if k not in HALF_K or cb == "mul1"]
ROWS = [1, 2, 7, 33, 145, 1024, 4096, 8192]
#: allowed ratio of our relative error to exllamav3's own, and an absolute floor for near-exact cases
RATIO = 1.1
FLOOR = 1e-4
#: the fused and per-bucket runs' relative error against the fp64 reference, per model dtype (:class:`Fp64Checks`).
#: Measured (ci/gpu/records/vllm-0.25.1/20261207-152935-fp64, H100): float16 3.0e-4 to 5.8e-4, bfloat16 1.75e-3 to
#: 2.38e-3; each bound 17x / 8.4x the worst (both were 2e-2: 34x for float16)
FP64_BOUND = {torch.float16: 1e-2, torch.bfloat16: 2e-2}
FIXTURES = Path(__file__).resolve().parents[3] / "fixtures"


class Exllamav3Shards:
    """The exllamav3 linear kernel, prepared for a whole (unsharded) shard of the given logical size on this GPU."""

    name = "exllamav3"
    op = "exl3_gemm_"
    wide_kernel = None
    #: model dtypes compared with exllamav3's own error (bf16 inputs would add their own rounding)
    ratio_dtypes = (torch.float32, torch.float16)
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    deterministic = False

    @staticmethod
    def kernel():
        from quantpack_exl3.backends.exllamav3 import Exllamav3LinearKernel

        return Exllamav3LinearKernel

    @classmethod
    def prepare_shard(cls, t: Exl3Tensors, in_f: int, out_f: int, dtype: torch.dtype, device: torch.device):
        from quantpack_core.kernels import TP_WHOLE
        from quantpack_exl3.format import EXL3

        spec = EXL3.spec(t, current_platform(), in_f, out_f, dtype, TP_WHOLE)
        assert cls.kernel().can_implement(spec) == (True, None)
        return cls.kernel().prepare(t, spec, device)

    @staticmethod
    def op_args(kernel, x: torch.Tensor, out: torch.Tensor, col: int) -> tuple:
        """The op's arguments for one prepared shard."""
        return (x, *kernel.tensors.values(), *kernel.static, out, col)


class TrellisMmaShards(Exllamav3Shards):
    """The project's trellis_mma linear kernel (float16 / bfloat16 models; split-K sums in a fixed order)."""

    name = "trellis_mma"
    op = "trellis_mma_"
    #: the kernel above 16 rows (QUANTPACK_TRELLIS_MMA_WIDE_KERNEL)
    wide_kernel = "split"
    ratio_dtypes = (torch.float16,)
    dtypes = (torch.float16, torch.bfloat16)
    deterministic = True

    @staticmethod
    def kernel():
        from quantpack_exl3.backends.trellis_mma import TrellisMmaLinearKernel

        return TrellisMmaLinearKernel

    @staticmethod
    def op_args(kernel, x: torch.Tensor, out: torch.Tensor, col: int) -> tuple:
        """The op takes lists of shards: one here."""
        t = kernel.tensors
        codebook, k_bits, out_features, bucket_kernels = kernel.static
        return (x, [t["trellis"]], [t["suh"]], [t["svh"]], codebook, k_bits, [out_features], bucket_kernels, out, col)


class TrellisMmaTcShards(TrellisMmaShards):
    """trellis_mma with its tensor-core kernel above 16 rows (Hopper; the split-K kernel up to 16 rows)."""

    name = "trellis_mma_tc"
    wide_kernel = "tc"


class TrellisMmaDenseShards(TrellisMmaShards):
    """trellis_mma with its dense route above 16 rows (the weights rebuilt in the model dtype per call, then cuBLAS;
    the split-K kernel up to 16 rows)."""

    name = "trellis_mma_dense"
    wide_kernel = "dense"


BACKENDS = [Exllamav3Shards, TrellisMmaShards, TrellisMmaTcShards, TrellisMmaDenseShards]


def current_platform():
    from quantpack_core.kernels import CUDA, Platform

    major, minor = torch.cuda.get_device_capability()
    return Platform(CUDA, capability=major * 10 + minor)


@pytest.fixture(scope="module", params=BACKENDS, ids=[b.name for b in BACKENDS])
def backend(request):
    """Each CUDA linear kernel; on a GPU machine it must be available (a failure here fails the tier). trellis_mma
    runs every row count itself here (no hand-over of large calls to exllamav3), with the kernel the backend names
    above 16 rows (its tensor-core kernel on Hopper only)."""
    assert request.param.kernel().available(current_platform()) == (True, None)
    if request.param.wide_kernel == "tc" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the tensor-core kernel runs on Hopper (compute capability 9.0)")
    with settings.using(delegate_rows=0, wide_kernel=request.param.wide_kernel):
        yield request.param


@pytest.fixture
def use():
    """``use(**changes)``: the rest of the test runs under the trellis_mma settings with ``changes``
    (:func:`quantpack_core.trellis_mma.settings.using`), each call on top of the ones before; restored after it."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(settings.using(**changes))


def exllamav3_forward(t: Exl3Tensors, x16: torch.Tensor) -> torch.Tensor:
    """exllamav3's own layer (``exllamav3.modules.quant.exl3.LinearEXL3``) on the same tensors."""
    from exllamav3.modules.quant.exl3 import LinearEXL3

    marker = (
        {}
        if t.codebook.marker is None
        else {
            t.codebook.marker: torch.tensor(
                t.codebook.multiplier - (1 << 32) if t.codebook.multiplier >= 1 << 31 else t.codebook.multiplier,
                dtype=torch.int32,
                device=x16.device,
            )
        }
    )
    k, n = t.padded_shape
    layer = LinearEXL3(None, k, n, suh=t.suh, svh=t.svh, trellis=t.trellis, key="test", **marker)
    return layer.forward(x16, {}).float()


def check_shard(backend, t: Exl3Tensors, rows: int, seed: int):
    """Run one shard through the op (fp32 and fp16 outputs) and exllamav3; compare with the fp64 reference."""
    dev = torch.device("cuda")
    t = Exl3Tensors(t.trellis.to(dev), t.suh.to(dev), t.svh.to(dev), t.codebook)
    k, n = t.padded_shape
    g = torch.Generator(device=dev).manual_seed(seed)
    x16 = torch.randn((rows, k), generator=g, device=dev).half()
    ref = reference_linear(x16.double(), t, torch.float64)
    theirs = relative_error(exllamav3_forward(t, x16), ref)
    for dtype in backend.ratio_dtypes:
        kernel = backend.prepare_shard(t, k, n, dtype, dev)
        out = torch.full((rows, n + 64), float("nan"), dtype=dtype, device=dev)
        kernel.run(x16.to(dtype), *kernel.tensors.values(), *kernel.static, out, 32)
        written = out[:, 32 : 32 + n]
        assert torch.isfinite(written).all(), "NaN/inf in the result, or a column left unwritten"
        assert torch.isnan(out[:, :32]).all() and torch.isnan(out[:, 32 + n :]).all(), "wrote outside its columns"
        ours = relative_error(written, ref)
        assert ours <= max(RATIO * theirs, FLOOR), (dtype, ours, theirs)
    return theirs


def pack_modules():
    cases = []
    for name in EXL3_PACKS:
        pack = Pack.open(FIXTURES / name)
        cases += [(name, key) for key, m in pack.modules.items() if m.format == "exl3"]
    return cases


@pytest.mark.parametrize("pack_name,module", pack_modules())
def test_every_tensor_of_the_bundled_packs(backend, fixtures_dir, pack_name, module):
    t = Pack.open(fixtures_dir / pack_name).exl3_tensors(module)
    for rows in (1, 300):  # the fused GEMM and the reconstruct path
        check_shard(backend, t, rows, seed=rows)


@pytest.mark.parametrize("k_bits,codebook", RANDOM_CASES, ids=[f"K{k:g}-{cb}" for k, cb in RANDOM_CASES])
@pytest.mark.parametrize("rows", ROWS)
def test_random_layers(backend, k_bits, codebook, rows):
    g = torch.Generator().manual_seed(int(k_bits * 10) + rows)
    t = Exl3Tensors.from_tensors(random_exl3_layer(768, 512, k_bits, codebook, generator=g))
    check_shard(backend, t, rows, seed=rows)


def test_padded_layer_and_dtypes(backend):
    """A 200 -> 300 layer stored 256 x 384: zero-extended input, trimmed output, bf16 / fp16 / fp32 activations."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(11)
    t = Exl3Tensors.from_tensors(random_exl3_layer(200, 300, 4, "mul1", generator=g))
    tols = {torch.float32: 2e-3, torch.float16: 2e-3, torch.bfloat16: 1e-2}
    for dtype in backend.dtypes:
        tol = tols[dtype]
        kernel = backend.prepare_shard(t, 200, 300, dtype, dev)
        for rows in (1, 7, 200):
            x = torch.randn((rows, 200), device=dev).to(dtype)
            out = torch.empty((rows, 300), dtype=dtype, device=dev)
            kernel.run(x, *kernel.tensors.values(), *kernel.static, out, 0)
            ref = reference_linear(x.double().cpu(), t, torch.float64, out_features=300)
            assert relative_error(out.cpu(), ref) < tol, (dtype, rows)


def test_opcheck(backend):
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(12)
    t = Exl3Tensors.from_tensors(random_exl3_layer(256, 384, 3, "mcg", generator=g))
    kernel = backend.prepare_shard(t, 256, 384, torch.float16, dev)
    for rows in (1, 40, 200):
        x = torch.randn((rows, 256), device=dev).half()
        out = torch.zeros((rows, 400), dtype=torch.float16, device=dev)
        opcheck(backend.op, backend.op_args(kernel, x, out, 16))


def assert_replay_is_eager(run, rows: int, k: int, n: int, dtype: torch.dtype, replays: int = 1) -> torch.Tensor:
    """Capture ``run`` (a prepared run) on a ``(rows, k)`` input in a CUDA graph and check that each replay on new
    input equals an eager call bit for bit; returns the last input and the output (for opcheck)."""
    dev = torch.device("cuda")
    x = torch.randn((rows, k), device=dev).to(dtype)
    out = torch.zeros((rows, n), dtype=dtype, device=dev)
    run.run(x, *run.tensors.values(), *run.static, out, 0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run.run(x, *run.tensors.values(), *run.static, out, 0)
    eager = torch.empty_like(out)
    for _ in range(replays):
        x.copy_(torch.randn((rows, k), device=dev).to(dtype))
        graph.replay()
        run.run(x, *run.tensors.values(), *run.static, eager, 0)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), "graph replay differs from eager"
    return x, out


def fused_layer(shapes: list[tuple[int, int]], seed: int, dtype: torch.dtype):
    """Random K=4 mul1 shards of one input width, prepared by trellis_mma and fused as the linear method does (a
    layer's q / k / v): returns (their tensors, the prepared shards, the fused run)."""
    from quantpack_exl3.backends.trellis_mma import TrellisMmaLinearKernel

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(seed)
    ts = [Exl3Tensors.from_tensors(random_exl3_layer(i, o, 4, "mul1", generator=g)) for i, o in shapes]
    prepared = [TrellisMmaShards.prepare_shard(t, i, o, dtype, dev) for t, (i, o) in zip(ts, shapes, strict=True)]
    return ts, prepared, TrellisMmaLinearKernel.fuse(prepared)


class Fp64Checks:
    """One test's checks of served outputs against the fp64 reference (the fused and per-bucket runs, which have no
    exllamav3 twin to compare with): each relative error below :data:`FP64_BOUND` of the output's dtype.
    :meth:`report` adds the worst and where it was to the run's figures and writes it as a ``measure`` record
    (tests/gpu_records.py), the measurement behind the bound."""

    def __init__(self, figures: list[str], what: str):
        self.figures, self.what, self.worst, self.where, self.dtype = figures, what, 0.0, None, None

    def check(self, got: torch.Tensor, ref: torch.Tensor, where) -> None:
        err, self.dtype = relative_error(got.cpu(), ref), got.dtype
        if err > self.worst:
            self.worst, self.where = err, where
        assert err < FP64_BOUND[got.dtype], (where, err)

    def shards(self, out: torch.Tensor, x: torch.Tensor, ts, prepared, where) -> None:
        """Each shard's columns of a fused run's output (in order from column 0 of ``out``) against the fp64
        reference of that shard."""
        col = 0
        for p, t in zip(prepared, ts, strict=True):
            ref = reference_linear(x.double().cpu(), t, torch.float64, out_features=p.out_features)
            self.check(out[:, col : col + p.out_features], ref, where)
            col += p.out_features

    def report(self) -> None:
        from gpu_records import write

        dtype = str(self.dtype).removeprefix("torch.")
        self.figures.append(
            f"GPU {self.what} ({dtype}): worst relative error against fp64 {self.worst:.3g} ({self.where})"
        )
        write(f"measure-fp64-{self.what}", {"kind": "measure", "what": self.what, "dtype": dtype,
                                            "fp64_rel_err": self.worst, "at": str(self.where),
                                            "bound": FP64_BOUND[self.dtype]})  # fmt: skip


@pytest.mark.parametrize(
    "wide_fused,wide_kernel",
    [(False, "split"), (True, "split"), (True, "tc"), (True, "dense")],
    ids=["split-per-shard-above-16", "split-wide-fused", "tensor-core", "dense"],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_trellis_mma_runs_a_layers_shards_in_one_launch(dtype, wide_fused, wide_kernel, use, figures, request):
    """q / k / v of one K and codebook fused (one launch up to 16 rows; above, with the split-K kernel a launch per
    shard, or with QUANTPACK_TRELLIS_MMA_WIDE_FUSED one launch per whole 64-row chunks that three shards' inputs fit in
    the workspace's rows; with the tensor-core kernel one launch per such piece; with the dense route a rebuild and a
    GEMM per shard) give each shard's columns as its own
    launch does, within fp32 summation order (the split of k depends on the launch's column blocks), and within the
    fp64 reference's bound; 1500 rows take several pieces; a graph replay is bit-identical to eager; shards of another
    K are not fused; the fused op passes opcheck."""
    from quantpack_exl3.backends.trellis_mma import TrellisMmaLinearKernel

    if wide_kernel == "tc" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the tensor-core kernel runs on Hopper (compute capability 9.0)")
    use(delegate_rows=0, wide_fused=wide_fused, wide_kernel=wide_kernel)  # every row count in trellis_mma's launches
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(121)
    ts, prepared, fused = fused_layer([(768, 512), (768, 128), (768, 128)], 21, dtype)
    fp64 = Fp64Checks(figures, f"fused q/k/v {request.node.callspec.id}")
    assert fused is not None and fused.out_features == 768 and fused.static[2] == (512, 128, 128)
    other = Exl3Tensors.from_tensors(random_exl3_layer(768, 128, 3, "mul1", generator=g))
    assert TrellisMmaLinearKernel.fuse([*prepared, TrellisMmaShards.prepare_shard(other, 768, 128, dtype, dev)]) is None
    for rows in (1, 3, 16, 17, 70, 400, 1500):
        x = torch.randn((rows, 768), device=dev).to(dtype)
        one = torch.full((rows, 800), float("nan"), dtype=dtype, device=dev)
        fused.run(x, *fused.tensors.values(), *fused.static, one, 16)
        assert torch.isnan(one[:, :16]).all() and torch.isnan(one[:, 784:]).all(), "wrote outside its columns"
        col = 16
        for p, t in zip(prepared, ts, strict=True):
            alone = torch.empty((rows, p.out_features), dtype=dtype, device=dev)
            p.run(x, *p.tensors.values(), *p.static, alone, 0)
            mine = one[:, col : col + p.out_features]
            assert torch.isfinite(mine).all()
            assert relative_error(mine.float(), alone.double()) < 2e-3, rows
            ref = reference_linear(x.double().cpu(), t, torch.float64, out_features=p.out_features)
            fp64.check(mine, ref, f"{rows} rows")
            col += p.out_features
    fp64.report()
    assert_replay_is_eager(fused, 70, 768, 768, dtype)
    x, out = assert_replay_is_eager(fused, 5, 768, 768, dtype, replays=2)
    t = fused.tensors
    lists = [[t[f"{name}{i}"] for i in range(3)] for name in ("trellis", "suh", "svh")]
    opcheck("trellis_mma_", (x, *lists, *fused.static[:2], list(fused.static[2]), fused.static[3], out, 0))


@pytest.mark.parametrize("k_in", [1024, 1152, 2304])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_trellis_mma_input_transformed_once_per_call(dtype, k_in, monkeypatch, use, figures, request):
    """A fused q / k / v call of 1-16 rows whose input one launch transforms first (every call from two rows on; at one
    row with QUANTPACK_TRELLIS_MMA_INLINE_TRANSFORM_ROWS=0), the GEMM streaming its slices from the workspace, equals
    the one-row kernel's in-CTA transform (its panel holds the one row, every lane's fragment row reading it) within
    fp32 summation order and the fp64 reference's bound, writes every column, and a graph replay is bit-identical to
    eager. Inputs of 72 and 144 tiles run as one split (a low CTA target): several 64-tile panels per CTA, the last
    one ending in a partial round of the cp.async ring."""
    from quantpack_core.trellis_mma import ops

    use(delegate_rows=0)
    dev = torch.device("cuda")
    ts, prepared, fused = fused_layer([(k_in, 512), (k_in, 256), (k_in, 128)], 22, dtype)
    fp64 = Fp64Checks(figures, f"input transformed once {request.node.callspec.id}")
    if k_in != 1024:
        monkeypatch.setattr(ops.workspace(dev), "target_ctas", 8)  # 7 column blocks: one split, the whole k per CTA
    x = torch.randn((1, k_in), device=dev).to(dtype)
    use(inline_transform_rows=1)
    in_cta = torch.full((1, 896), float("nan"), dtype=dtype, device=dev)
    fused.run(x, *fused.tensors.values(), *fused.static, in_cta, 0)
    assert torch.isfinite(in_cta).all()
    fp64.shards(in_cta, x, ts, prepared, "1 row, in-CTA")
    use(inline_transform_rows=0)
    for rows in (1, 2, 5, 16):
        x_rows = torch.cat([x, torch.randn((rows - 1, k_in), device=dev).to(dtype)])
        once = torch.full((rows, 896), float("nan"), dtype=dtype, device=dev)
        fused.run(x_rows, *fused.tensors.values(), *fused.static, once, 0)
        assert torch.isfinite(once).all(), rows
        assert relative_error(once[:1].float(), in_cta.double()) < 2e-3, rows
        fp64.shards(once, x_rows, ts, prepared, f"{rows} rows")
    fp64.report()
    assert_replay_is_eager(fused, 7, k_in, 896, dtype)
    for inline in (0, 1):
        use(inline_transform_rows=inline)
        assert_replay_is_eager(fused, 1, k_in, 896, dtype)


@pytest.mark.parametrize(
    "setting,dtype",
    [(None, torch.float16), (None, torch.bfloat16), (16, torch.float16)],
    ids=["measured-float16", "measured-bfloat16", "fixed-16"],
)
def test_trellis_mma_runs_each_row_bucket_on_the_kernel_its_codes_name(setting, dtype, use, caplog, figures, request):
    """A prepared run's bucket_kernels are the ones its load-time timings give (per bucket the fastest of the
    project's kernels - the split-K one, on Hopper the tensor-core one at each row count per CTA, from 513 rows the
    dense route - unless exllamav3
    takes at most DELEGATE_MARGIN of its time; a fixed QUANTPACK_TRELLIS_MMA_DELEGATE_ROWS sends the buckets above it
    to exllamav3), the timings are logged, and every call runs the kernel its bucket names: bit-equal to that kernel's
    own launch, unequal to the split-K kernel's where exllamav3 serves it, within the fp64 reference's bound."""
    import logging

    from quantpack_core.trellis_mma import ops
    from quantpack_core.trellis_mma import selection as sel

    use(delegate_rows=setting, wide_kernel=None)
    dev = torch.device("cuda")
    t = Exl3Tensors.from_tensors(random_exl3_layer(1024, 2048, 3, "mcg", generator=torch.Generator().manual_seed(31)))
    with caplog.at_level(logging.INFO, logger="vllm.quantpack"):
        p = TrellisMmaShards.prepare_shard(t, 1024, 2048, dtype, dev)
    codes = p.static[3]
    key = (1024, (2048,), 3, 1, dtype)
    records = [r for r in sel.selection_records() if (r.k, r.out_features, r.k_bits, r.codebook, r.dtype) == key]
    assert records and records[-1].bucket_kernels == codes and records[-1].describe() in caplog.text
    check_bucket_choices(records[-1], setting, ops.workspace(dev).tensor_cores)
    fp64 = Fp64Checks(figures, f"row buckets {request.node.callspec.id}")
    every = lambda code: ops.bucket_kernels_of([code] * len(ops.ROW_BUCKETS))  # noqa: E731
    args = tuple(p.tensors.values())
    for i, bound in enumerate(ops.ROW_BUCKETS):
        for rows in {bound, max(1, bound // 2 + 1), 3000 if i == len(ops.ROW_BUCKETS) - 1 else bound}:
            assert ops.row_bucket(rows) == i
            code = ops.kernel_of(codes, rows)
            x = torch.randn((rows, 1024), device=dev).to(dtype)
            served, direct, split = (torch.empty((rows, 2048), dtype=dtype, device=dev) for _ in range(3))
            p.run(x, *args, *p.static, served, 0)
            p.run(x, *args, *p.static[:3], every(code), direct, 0)
            p.run(x, *args, *p.static[:3], every(ops.SPLIT), split, 0)
            assert torch.equal(served, direct), (rows, code)
            if code == ops.DELEGATE:
                assert not torch.equal(served, split), rows
            ref = reference_linear(x.double().cpu(), t, torch.float64)
            assert torch.isfinite(served).all(), (rows, code)
            fp64.check(served, ref, f"{rows} rows, {sel.KERNEL_NAMES.get(code, 'exllamav3')}")
    fp64.report()


def check_bucket_choices(record, setting, tensor_cores: bool) -> None:
    """A selection record's choices: measured, each bucket's candidates timed (all of them, within 0.1 s a call) and
    the chosen one the fastest own kernel or exllamav3 within the margin of it; the split-K kernel alone up to 16
    rows, the tensor-core kernel's row counts among the candidates above 16 rows on Hopper, the dense route among
    them from DENSE_ROWS rows. Fixed at 16 rows: the split-K
    kernel up to 16 rows, exllamav3 above, nothing timed."""
    from quantpack_core.trellis_mma import ops
    from quantpack_core.trellis_mma import selection as sel

    if setting is not None:
        want = [ops.SPLIT] * 5 + [ops.DELEGATE] * (len(ops.ROW_BUCKETS) - 5)
        assert record.bucket_kernels == ops.bucket_kernels_of(want) and record.times_us == ()
        return
    assert len(record.times_us) == len(ops.ROW_BUCKETS)
    for bound, timed in zip(ops.ROW_BUCKETS, record.times_us, strict=True):
        assert all(0 < us < 1e5 for _, us in timed), bound
        own = [c for c, _ in timed if c != ops.DELEGATE]
        assert ops.DELEGATE in dict(timed) and own[0] == ops.SPLIT and (bound > 16 or own == [ops.SPLIT]), bound
        assert (ops.DENSE in own) == (bound >= ops.DENSE_ROWS), bound
        if bound > 16 and tensor_cores:
            assert ops.TC64 in own and (bound < 256 or ops.TC256 in own), bound
        fastest = min((us, c) for c, us in timed if c != ops.DELEGATE)
        theirs = dict(timed)[ops.DELEGATE]
        want = ops.DELEGATE if theirs <= sel.DELEGATE_MARGIN * fastest[0] else fastest[1]
        assert ops.kernel_of(record.bucket_kernels, bound) == want, bound


def test_compiles_in_one_graph_and_captures_in_a_cuda_graph(backend):
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(13)
    q = Exl3Tensors.from_tensors(random_exl3_layer(256, 256, 4, "mul1", generator=g))
    k = Exl3Tensors.from_tensors(random_exl3_layer(256, 128, 2.5, "mul1", generator=g))
    kq = backend.prepare_shard(q, 256, 256, torch.bfloat16, dev)
    kk = backend.prepare_shard(k, 256, 128, torch.bfloat16, dev)

    def fused(x):
        out = torch.empty((x.shape[0], 384), dtype=x.dtype, device=x.device)
        kq.run(x, *kq.tensors.values(), *kq.static, out, 0)
        kk.run(x, *kk.tensors.values(), *kk.static, out, 256)
        return torch.nn.functional.silu(out)

    explained = torch._dynamo.explain(fused)(torch.randn((3, 256), device=dev).bfloat16())
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(fused, fullgraph=True, dynamic=True)
    for rows in (1, 5, 150):
        x = torch.randn((rows, 256), device=dev).bfloat16()
        assert relative_error(compiled(x).float(), fused(x).double()) < 1e-2, rows

    for rows in (1, 33, 145):  # fused-GEMM buckets and the reconstruct path
        static_x = torch.randn((rows, 256), device=dev).bfloat16()
        fused(static_x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = fused(static_x)
        for _ in range(2):
            static_x.copy_(torch.randn((rows, 256), device=dev).bfloat16())
            graph.replay()
            torch.cuda.synchronize()
            eager = fused(static_x)
            assert relative_error(static_y.float(), eager.double()) < 1e-3, rows
            if backend.deterministic:
                assert torch.equal(static_y, eager), f"graph replay differs from eager at {rows} rows"


def test_this_gpu_chooses_trellis_mma_for_16_bit_models_and_exllamav3_for_fp32():
    """On the GPU machine itself, with real availability: the platform's priority list takes every K and codebook of
    a float16 / bfloat16 model to trellis_mma with no kernel declining before it, and a float32 model's to
    exllamav3 with trellis_mma's reason; the expert list is trellis_mma then exllamav3 (the support matrix's CUDA
    rows, on a device)."""
    from quantpack_core.kernels import TP_WHOLE, LinearSpec, choose_kernel
    from quantpack_exl3.config import Exl3Config

    linear, experts = Exl3Config.resolve_kernels(current_platform())
    assert [k.name for k in linear] == ["trellis_mma", "exllamav3"]
    assert [k.name for k in experts] == ["trellis_mma", "exllamav3"]  # the bank's own test: test_exl3_gpu_moe.py
    for k_bits, codebook in RANDOM_CASES:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            spec = LinearSpec(current_platform(), "exl3", k_bits, codebook, 4096, 14336, 4096, 14336, dtype, TP_WHOLE)
            choice = choose_kernel(linear, spec, "test")
            if dtype == torch.float32:
                assert choice.kernel.name == "exllamav3"
                assert [name for name, _ in choice.declined] == ["trellis_mma"]
            else:
                assert choice.kernel.name == "trellis_mma" and choice.declined == ()
