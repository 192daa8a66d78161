"""trellis_mma's dense route on the GPU (csrc/dense.cu rebuilds a shard's weights in the model dtype, cuBLAS runs the
GEMM): each call against the fp64 reference, held to the rounding the route cannot avoid, which the test computes
itself: the weights ``dequantize()`` gives in float64, rounded once to the model dtype, multiplied in float64, the
output rounded to the model dtype. A kernel that decodes, transforms or scales one block wrongly is far outside it.
Needs a CUDA device (the GPU tier's core job)."""

from __future__ import annotations

import pytest
import torch

from quantpack_core import Exl3Tensors, reference_linear
from quantpack_core.codec.exl3 import dequantize
from quantpack_core.codec.trellis import HALF_K
from quantpack_core.compare import relative_error
from quantpack_core.synthetic import random_exl3_layer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU tier: nox -s gpu-tests)"),
]

CODEBOOKS = ("3inst", "mcg", "mul1")
K_BITS = (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8)
CASES = [(k, cb) for k in K_BITS for cb in CODEBOOKS if k not in HALF_K or cb == "mul1"]
#: the route's error may exceed the unavoidable rounding's (computed in float64) by this ratio: the kernel's float32
#: transforms and cuBLAS's float32 sums (ops.float32_sums) add orders of magnitude less than one float16 rounding of
#: the weights (an emulation of the route measures 1.000; partial sums rounded to the output dtype, which
#: float32_sums rules out, 1.22-1.29 in a simulation of 2-6 splits of k)
RATIO = 1.1
#: what torch.library.opcheck checks (as the packages' opcheck helper)
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def prepared(t: Exl3Tensors, out_features: int, dtype: torch.dtype):
    """The shard prepared by trellis_mma with the dense route above 16 rows (nothing measured, no delegate)."""
    from quantpack_core.trellis_mma import kernels, settings

    with settings.using(delegate_rows=0, wide_kernel="dense"):
        return kernels.prepare_shard(
            t.trellis, t.suh, t.svh, t.codebook.kernel_id, float(t.k_bits), out_features, dtype,
            torch.device("cuda"),
        )  # fmt: skip


def unavoidable(x: torch.Tensor, t: Exl3Tensors, out_features: int) -> torch.Tensor:
    """``x @ W`` with W rounded once to x's dtype, summed in float64, rounded to x's dtype."""
    w = dequantize(t, torch.float64)[: x.shape[1], :out_features].to(x.dtype).double()
    return (x.double().cpu() @ w).to(x.dtype)


def within_rounding(y: torch.Tensor, x: torch.Tensor, ts, widths, where: object = None) -> None:
    """Each shard's columns of a call (side by side in ``y``: one shard, or a fused call's) finite and within
    :data:`RATIO` of its unavoidable rounding; ``where`` names the case in a failure."""
    x = x.cpu()
    for i, (t, n) in enumerate(zip(ts, widths, strict=True)):
        c = sum(widths[:i])
        got = y[:, c : c + n]
        assert torch.isfinite(got).all(), (where, i)
        ref = reference_linear(x.double(), t, torch.float64, out_features=n)
        floor = relative_error(unavoidable(x, t, n), ref)
        assert relative_error(got, ref) <= RATIO * floor, (where, i, relative_error(got, ref), floor)


def run(p, x: torch.Tensor, width: int, col: int = 0) -> torch.Tensor:
    """The prepared shard's output columns, written into a NaN-filled buffer ``col`` columns in."""
    out = torch.full((x.shape[0], width + col + 8), float("nan"), dtype=x.dtype, device=x.device)
    p.run(x, *p.tensors.values(), *p.static, out, col)
    assert torch.isnan(out[:, :col]).all() and torch.isnan(out[:, col + width :]).all(), "wrote outside its columns"
    return out[:, col : col + width]


@pytest.mark.parametrize("k_bits,codebook", CASES, ids=[f"K{k:g}-{cb}" for k, cb in CASES])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_k_and_codebook(k_bits, codebook, dtype):
    g = torch.Generator().manual_seed(int(k_bits * 10))
    t = Exl3Tensors.from_tensors(random_exl3_layer(768, 512, k_bits, codebook, generator=g))
    p = prepared(t, 512, dtype)
    for rows in (17, 300, 4096):
        x = torch.randn((rows, 768), generator=g).to(dtype)
        within_rounding(run(p, x.cuda(), 512, col=24), x, [t], (512,), rows)


def test_a_padded_layer_and_a_large_call():
    """A 200 -> 300 layer stored 256 x 384 (input zero-extended, output trimmed), and 8,192 rows of a 4096 -> 1024
    layer, one prefill chunk."""
    g = torch.Generator().manual_seed(5)
    for (k, n), rows in (((200, 300), 333), ((4096, 1024), 8192)):
        t = Exl3Tensors.from_tensors(random_exl3_layer(k, n, 4, "mul1", generator=g))
        p = prepared(t, n, torch.bfloat16)
        x = torch.randn((rows, k), generator=g).bfloat16()
        within_rounding(run(p, x.cuda(), n), x, [t], (n,), (k, n))


def test_fused_shards_a_graph_replay_and_opcheck():
    """q / k / v fused, rebuilt side by side into one GEMM: each shard's columns against its own reference; a CUDA-graph
    replay on new input equals an eager call bit for bit; the op passes opcheck."""
    from quantpack_core.trellis_mma import kernels, settings

    g = torch.Generator().manual_seed(7)
    ts = [Exl3Tensors.from_tensors(random_exl3_layer(768, n, 4, "mul1", generator=g)) for n in (512, 128, 128)]
    shards = [prepared(t, t.padded_shape[1], torch.float16) for t in ts]
    with settings.using(delegate_rows=0, wide_kernel="dense"):
        fused = kernels.fuse_shards(shards)
    x = torch.randn((200, 768), generator=g).half().cuda()
    together = run(fused, x, 768)
    within_rounding(together, x, ts, (512, 128, 128))
    out = torch.zeros((200, 768), dtype=torch.float16, device="cuda")
    fused.run(x, *fused.tensors.values(), *fused.static, out, 0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused.run(x, *fused.tensors.values(), *fused.static, out, 0)
    x.copy_(torch.randn((200, 768), generator=g).half())
    graph.replay()
    assert torch.equal(out, run(fused, x, 768))
    tensors = fused.tensors
    lists = [[tensors[f"{name}{i}"] for i in range(3)] for name in ("trellis", "suh", "svh")]
    args = (x, *lists, *fused.static[:2], list(fused.static[2]), fused.static[3], out, 0)
    torch.library.opcheck(torch.ops.quantpack.trellis_mma_.default, args, test_utils=OPCHECK_UTILS)


def test_a_call_over_several_pieces_of_columns():
    """A shard wider than the workspace's piece: with a workspace that holds three 128-column blocks at this k, a
    1000-column shard (stored 1024) runs in pieces of 384, 384 and 232 columns, each rebuilt at its own offset."""
    from quantpack_core.trellis_mma import ops

    g = torch.Generator().manual_seed(9)
    t = Exl3Tensors.from_tensors(random_exl3_layer(768, 1000, 4, "mul1", generator=g))
    p = prepared(t, 1000, torch.float16)
    ws = ops.workspace(torch.device("cuda"))
    whole = ws.dense
    ws.dense = torch.empty(3 * 128 * 768 * 2, dtype=torch.uint8, device="cuda")
    try:
        x = torch.randn((300, 768), generator=g).half()
        y = run(p, x.cuda(), 1000, col=8)
    finally:
        ws.dense = whole
    within_rounding(y, x, [t], (1000,))


def test_fused_shards_over_several_pieces():
    """Shards of 300 (stored 384), 200 (stored 256) and 640 columns fused, with a workspace of three 128-column
    blocks: the first GEMM holds the 300 columns (the 84 left cannot take a block of the next shard), the second the
    200 and the first 128 of the third, then 384 and 128: every cut at a block of its own shard, each GEMM's columns
    where its first shard's output starts."""
    from quantpack_core.trellis_mma import kernels, ops, settings

    g = torch.Generator().manual_seed(11)
    widths = (300, 200, 640)
    ts = [Exl3Tensors.from_tensors(random_exl3_layer(768, n, 3, "3inst", generator=g)) for n in widths]
    shards = [prepared(t, n, torch.bfloat16) for t, n in zip(ts, widths, strict=True)]
    with settings.using(delegate_rows=0, wide_kernel="dense"):
        fused = kernels.fuse_shards(shards)
    ws = ops.workspace(torch.device("cuda"))
    whole = ws.dense
    ws.dense = torch.empty(3 * 128 * 768 * 2, dtype=torch.uint8, device="cuda")
    try:
        x = torch.randn((700, 768), generator=g).bfloat16()
        y = run(fused, x.cuda(), sum(widths), col=40)
    finally:
        ws.dense = whole
    within_rounding(y, x, ts, widths)
