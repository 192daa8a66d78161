"""The registered custom ops: schema, fake implementation and eager implementation agree (torch.library.opcheck),
each writes exactly its columns of the shared output, and torch.compile traces through them in one graph."""

import pytest
import torch

from quantpack_exl3 import ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_reference_gemm_opcheck_and_columns(dtype, rows):
    x = torch.randn(rows, 256).to(dtype)
    w = torch.randn(256, 384).to(dtype)
    out = torch.full((rows, 500), float("nan"), dtype=dtype)
    torch.library.opcheck(torch.ops.quantpack.exl3_reference_gemm_.default, (x, w, out.clone(), 100))
    ops.exl3_reference_gemm_(x, w, out, 100)
    assert torch.isnan(out[:, :100]).all() and torch.isnan(out[:, 484:]).all()
    assert torch.allclose(out[:, 100:484].float(), x.float() @ w.float(), rtol=2e-2, atol=2e-2)


def test_compiles_without_graph_break():
    w1, w2 = torch.randn(128, 256), torch.randn(128, 64)

    def f(x):
        out = torch.empty((x.shape[0], 320))
        ops.exl3_reference_gemm_(x * 2, w1, out, 0)
        ops.exl3_reference_gemm_(x * 2, w2, out, 256)
        return torch.relu(out) + 1

    explained = torch._dynamo.explain(f)(torch.randn(5, 128))
    assert explained.graph_break_count == 0
    assert explained.graph_count == 1
    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for rows in (1, 3, 17):
        x = torch.randn(rows, 128)
        assert torch.allclose(compiled(x), f(x), atol=1e-5)
