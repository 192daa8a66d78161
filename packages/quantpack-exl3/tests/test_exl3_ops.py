"""The registered custom ops: schema, fake implementation and eager implementation agree (torch.library.opcheck),
and torch.compile traces through them in one graph."""

import pytest
import torch

from quantpack_exl3 import ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_reference_gemm_opcheck(dtype, rows):
    x = torch.randn(rows, 256).to(dtype)
    w = torch.randn(256, 384).to(dtype)
    torch.library.opcheck(torch.ops.quantpack.exl3_reference_gemm.default, (x, w))
    y = ops.exl3_reference_gemm(x, w)
    assert y.shape == (rows, 384) and y.dtype == dtype
    assert torch.allclose(y.float(), x.float() @ w.float(), rtol=2e-2, atol=2e-2)


def test_compiles_without_graph_break():
    w = torch.randn(128, 256)

    def f(x):
        return torch.relu(ops.exl3_reference_gemm(x * 2, w)) + 1

    explained = torch._dynamo.explain(f)(torch.randn(5, 128))
    assert explained.graph_break_count == 0
    assert explained.graph_count == 1
    compiled = torch.compile(f, backend="eager", fullgraph=True, dynamic=True)
    for rows in (1, 3, 17):
        x = torch.randn(rows, 128)
        assert torch.allclose(compiled(x), f(x))
