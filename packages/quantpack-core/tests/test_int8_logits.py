"""``quantpack::int8_rows_logits_``: logits from an int8-row table without dequantizing it, against an fp64 reference
``(x @ q.T) * s``. The chunked path (CPU, float32 activations) in this process with chunks forced small; the Triton
kernel under Triton's interpreter in a fresh process (float16: the interpreter converts bfloat16 wrongly, a NaN for
an int8 -1 among others, so bfloat16 is only compiled here) and compiled ahead of time for CUDA sm_90 and ROCm
gfx1201. The kernel's first GPU run is in the GPU tier."""

import json
import os
import subprocess
import sys

import pytest
import torch

from quantpack_core import int8_logits
from quantpack_core.compare import relative_error
from quantpack_core.int8_logits import int8_rows_logits

TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def case(rows: int, vocab: int, width: int, dtype: torch.dtype, seed: int = 0):
    """Random int8 rows with scales of a real table's size, activations, and the fp64 logits."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (vocab, width), generator=g, dtype=torch.int8)
    s = torch.rand(vocab, generator=g) * 0.01 + 1e-3
    x = torch.randn((rows, width), generator=g).to(dtype)
    return x, q, s, (x.double() @ q.double().T) * s.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,vocab,width", [(1, 1000, 256), (7, 333, 200), (64, 128, 384)])
def test_chunked_path_matches_fp64(monkeypatch, dtype, rows, vocab, width):
    """Chunks of 5 000 elements: several per table, a last one shorter, every column written once."""
    monkeypatch.setattr(int8_logits, "CHUNK_ELEMENTS", 5000)
    x, q, s, ref = case(rows, vocab, width, dtype, seed=rows)
    out = int8_rows_logits(x, q, s)
    assert out.dtype == dtype and out.shape == (rows, vocab)
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < TOL[dtype]


def test_float16_logits_beyond_the_int8_range_stay_finite():
    """A real head's rows (N(0, 0.02), quantized as the converter does) and activations whose true logits reach 60:
    the float16 result is finite and close, on the chunked path (the raw int8 product would pass 65504)."""
    from quantpack_core.embedding import quantize_rows

    g = torch.Generator().manual_seed(3)
    table = torch.randn((300, 512), generator=g) * 0.02
    q, s = quantize_rows(table)
    x = torch.stack([table[7] / table[7].norm() ** 2 * target for target in (30.0, 45.0, 60.0)]).half()
    out = int8_rows_logits(x, q, s)
    ref = x.double() @ (q.double() * s.double()[:, None]).T
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < TOL[torch.float16]
    assert out[2, 7].item() == pytest.approx(60.0, rel=1e-2)


def test_opcheck():
    x, q, s, _ = case(3, 200, 128, torch.float32)
    out = torch.empty((3, 200))
    torch.library.opcheck(torch.ops.quantpack.int8_rows_logits_.default, (x, q, s, out))


def test_bad_tables_are_named():
    x, q, s, _ = case(2, 10, 16, torch.float32)
    with pytest.raises(ValueError, match=r"int8 \(vocab, width\) table, got x \[2, 16\] and torch.float32"):
        int8_rows_logits(x, q.float(), s)
    with pytest.raises(ValueError, match="10 table rows need as many scales, got \\[9\\]"):
        int8_rows_logits(x, q, s[:9])
    with pytest.raises(ValueError, match=r"got x \[2, 8\]"):
        int8_rows_logits(x[:, :8], q, s)
    with pytest.raises(ValueError, match="must be contiguous"):
        int8_rows_logits(x, torch.cat([q, q], 1)[:, :16], s)


INTERPRETED = [(1, 300, 200), (16, 130, 256), (17, 200, 128), (70, 65, 136)]

SCRIPT = """
import json, sys, torch
from quantpack_core._int8_logits_triton import int8_rows_logits_triton
out = []
for rows, vocab, width in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (vocab, width), generator=g, dtype=torch.int8)
    s = torch.rand(vocab, generator=g) * 0.01 + 1e-3
    x = torch.randn((rows, width + 8), generator=g).half()[:, :width]  # a row stride wider than the width
    y = torch.full((rows, vocab + 3), float("nan"), dtype=torch.float16)
    int8_rows_logits_triton(x, q, s, y[:, :vocab])
    ref = (x.double() @ q.double().T) * s.double()
    err = ((y[:, :vocab].double() - ref).norm() / ref.norm()).item()
    out.append({"rel_err": err, "finite": bool(torch.isfinite(y[:, :vocab]).all()),
                "untouched": bool(torch.isnan(y[:, vocab:]).all())})
print(json.dumps(out))
"""


def test_triton_kernel_under_the_interpreter():
    """Rows below, at and above a 16-row block (64-row blocks above 16), vocabularies and widths not multiples of the
    blocks, a strided x and output: within float16 rounding of fp64, only the logits' columns written."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(INTERPRETED)], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for shape, res in zip(INTERPRETED, json.loads(done.stdout.strip().splitlines()[-1]), strict=True):
        assert res["finite"] and res["untouched"], (shape, res)
        assert res["rel_err"] < TOL[torch.float16], (shape, res)


@pytest.mark.parametrize("target", ["cuda", "hip"])
@pytest.mark.parametrize("act", ["fp16", "bf16"])
def test_triton_kernel_compiles_for_hopper_and_gfx1201(target, act):
    """The kernel compiles to device code (CUDA sm_90 cubin, ROCm gfx1201 code object; no GPU needed) with the
    argument types the op passes it, for both block heights."""
    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from quantpack_core import _int8_logits_triton as k

    gpu = GPUTarget("cuda", 90, 32) if target == "cuda" else GPUTarget("hip", "gfx1201", 32)
    sig = {"x_ptr": f"*{act}", "q_ptr": "*i8", "s_ptr": "*fp32", "out_ptr": f"*{act}"}
    sig |= {name: "i32" for name in ("rows", "vocab", "width", "x_stride", "out_stride")}
    sig |= {"BLOCK_M": "constexpr", "BLOCK_V": "constexpr", "BLOCK_H": "constexpr"}
    for block_m in (16, 64):
        consts = {"BLOCK_M": block_m, "BLOCK_V": k.BLOCK_V, "BLOCK_H": k.BLOCK_H}
        binary = triton.compile(ASTSource(fn=k.int8_rows_logits_kernel, signature=sig, constexprs=consts), target=gpu)
        assert binary.asm.get("cubin" if target == "cuda" else "hsaco")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU tier: nox -s gpu-tests)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 16, 17, 300])
def test_on_the_gpu(dtype, rows):
    """On the device (the Triton kernel for 16-bit activations, the chunked path for float32): within the dtype's
    rounding of fp64 at a vocabulary and width not multiples of the blocks, a CUDA-graph replay equal to the eager
    call, and opcheck."""
    x, q, s, ref = case(rows, 5003, 640 + 24, dtype, seed=rows)
    x, q, s = x.cuda(), q.cuda(), s.cuda()
    out = int8_rows_logits(x, q, s)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert relative_error(out.cpu(), ref) < TOL[dtype]
    static = torch.empty_like(out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.quantpack.int8_rows_logits_(x, q, s, static)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, out)
    torch.library.opcheck(torch.ops.quantpack.int8_rows_logits_.default, (x, q, s, torch.empty_like(out)))
