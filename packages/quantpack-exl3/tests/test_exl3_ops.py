"""The registered custom ops: schema, fake implementation and eager implementation agree (the shared ``opcheck``
helper, on every op the project defines), each writes exactly its columns of the shared output, and torch.compile
traces through them in one graph."""

import pytest
import torch
from ops_check import COVERED, opcheck

from quantpack_core.dense import dense_gemm_
from quantpack_core.ops import defined_ops


def test_every_op_the_project_defines_has_an_opcheck_case():
    import importlib.util

    import quantpack_core.int8_logits
    import quantpack_core.trellis_mma.moe
    import quantpack_core.trellis_mma.ops
    import quantpack_core.vllm.cpu_linear
    import quantpack_core.vllm.cpu_moe  # noqa: F401
    import quantpack_exl3.backends.exllamav3.ops
    import quantpack_exl3.backends.reference.ops  # noqa: F401

    expected = set(COVERED)
    if importlib.util.find_spec("quantpack_escha") is not None:  # the workspace's other format
        import quantpack_escha.backends.hip.ops
        import quantpack_escha.backends.triton.ops  # noqa: F401
    else:
        expected = {n for n in expected if not n.startswith("escha_")}
    assert set(defined_ops()) == expected, set(defined_ops()) ^ expected


#: worst |out - ref| / (1 + |ref|) against the float64 product, measured over 20 seeds x rows 1 / 7 / 64 on CPU:
#: float32 1.9e-5, float16 4.7e-4, bfloat16 3.8e-3 (the output's rounding); each tolerance about 20x / 10x / 5x that
DENSE_TOL = {torch.float32: 4e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_dense_gemm_opcheck_and_columns(dtype, rows):
    x = torch.randn(rows, 256).to(dtype)
    w = torch.randn(256, 384).to(dtype)
    out = torch.full((rows, 500), float("nan"), dtype=dtype)
    opcheck("dense_gemm_", (x, w, out.clone(), 100))
    dense_gemm_(x, w, out, 100)
    assert torch.isnan(out[:, :100]).all() and torch.isnan(out[:, 484:]).all()
    tol = DENSE_TOL[dtype]
    torch.testing.assert_close(out[:, 100:484].double(), x.double() @ w.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("tokens", [1, 9])
def test_reference_moe_opcheck(tokens):
    """The CPU MoE op, picks of id -1 (another rank's experts) included, against a per-token float64 sum."""
    from quantpack_exl3.backends.reference.ops import exl3_moe_reference_

    g = torch.Generator().manual_seed(tokens)
    e, h, i = 4, 64, 32
    w13, w2 = torch.randn(e, h, 2 * i, generator=g) / 8, torch.randn(e, i, h, generator=g) / 8
    x = torch.randn(tokens, h, generator=g)
    ids = torch.randint(-1, e, (tokens, 2), generator=g, dtype=torch.int32)
    w = torch.rand(tokens, 2, generator=g)
    opcheck("exl3_moe_reference_", (x, ids, w, w13, w2, torch.empty_like(x)))
    out = torch.empty_like(x)
    exl3_moe_reference_(x, ids, w, w13, w2, out)
    want = torch.zeros(tokens, h, dtype=torch.float64)
    for t in range(tokens):
        for j in range(2):
            ex = int(ids[t, j])
            if ex >= 0:
                hh = x[t].double() @ w13[ex].double()
                want[t] += w[t, j].double() * (torch.nn.functional.silu(hh[:i]) * hh[i:]) @ w2[ex].double()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_compiles_without_graph_break():
    w1, w2 = torch.randn(128, 256), torch.randn(128, 64)

    def f(x):
        out = torch.empty((x.shape[0], 320))
        dense_gemm_(x * 2, w1, out, 0)
        dense_gemm_(x * 2, w2, out, 256)
        return torch.relu(out) + 1

    explained = torch._dynamo.explain(f)(torch.randn(5, 128))
    assert explained.graph_break_count == 0
    assert explained.graph_count == 1
    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for rows in (1, 3, 17):
        x = torch.randn(rows, 128)
        assert torch.allclose(compiled(x), f(x), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_cpu_linear_opcheck_and_columns(dtype, rows):
    """A dense run handed to vLLM's CPU GEMM (``quantpack_core.vllm.cpu_linear``) computes ``x @ W`` into its
    columns only, whichever path vLLM's dispatch took (oneDNN with a prepacked weight here), and passes opcheck."""
    from quantpack_core.kernels import PreparedShard
    from quantpack_core.vllm.cpu_linear import CpuGemm, pack

    w = torch.randn(256, 384).to(dtype)
    p = pack(PreparedShard(dense_gemm_, {"weight": w}, 384))
    assert isinstance(p.run, CpuGemm) and p.out_features == 384
    x = torch.randn(rows, 256).to(dtype)
    out = torch.full((rows, 500), float("nan"), dtype=dtype)
    p.run(x, *p.tensors.values(), out, 100)
    assert torch.isnan(out[:, :100]).all() and torch.isnan(out[:, 484:]).all()
    ref = x.double() @ w.double()
    err = float((out[:, 100:484].double() - ref).norm() / ref.norm())
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err
    opcheck("cpu_linear_", (x, p.tensors["weight"], p.run.handle, out.clone(), 100))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_cpu_fused_moe_matches_the_reference_loop(dtype, tokens):
    """vLLM's CPU MoE kernel on a bank packed by ``quantpack_core.vllm.cpu_moe.pack_bank`` (intermediate 80, padded
    to 96 inside) equals the project's own loop over experts (``exl3_moe_reference_``) on the same dense weights;
    opcheck of ``quantpack::cpu_fused_moe_``."""
    from quantpack_core.vllm.cpu_moe import available, pack_bank
    from quantpack_exl3.backends.reference.ops import exl3_moe_reference_

    if not available():
        pytest.skip("this vLLM build has no CPU MoE kernel")
    g = torch.Generator().manual_seed(tokens)
    e, h, inter, top = 8, 128, 80, 2
    w13 = (torch.randn(e, h, 2 * inter, generator=g) * 0.05).to(dtype)
    w2 = (torch.randn(e, inter, h, generator=g) * 0.05).to(dtype)
    x = torch.randn(tokens, h, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:top] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, top, generator=g).to(torch.float32)
    ref = torch.empty(tokens, h, dtype=dtype)
    exl3_moe_reference_(x, ids, weights, w13, w2, ref)
    bank = pack_bank(w13, w2)
    out = torch.full((tokens, h), float("nan"), dtype=dtype)
    bank.run(x, ids, weights, *bank.tensors.values(), *bank.static, out)
    err = float((out.double() - ref.double()).norm() / ref.double().norm())
    assert err < (1e-4 if dtype == torch.float32 else 2e-2), err
    opcheck("cpu_fused_moe_", (x, ids, weights, *bank.tensors.values(), *bank.static, out.clone()))
