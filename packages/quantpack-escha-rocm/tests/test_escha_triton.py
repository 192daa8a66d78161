"""The escha Triton kernels, run under Triton's interpreter on CPU (in a fresh process: ``triton_cases.py``) against
the escha codec's fp64 reference: every integer K, padded layers (input zero-extended, output trimmed), rows below,
at and above a program's 16 and above a launch's piece (pieces of 24 rows here), every model dtype, only the shard's
columns written; and both kernels compiled ahead of time for CUDA sm_90 and ROCm gfx1201 (the interpreter accepts code
that compiled Triton refuses). Their first H200 run (2026-12-02) failed to compile on a non-constexpr global, which
the compile test now catches here. Shards whose row blocks times column blocks fill fewer programs than the
interpreter's target (8 "SMs" x 2) split k (most cases here: 2-6 slices, an uneven last one included); one case
fills it and runs one slice."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CASES = [
    {"in": 256, "out": 384, "k": k, "rows": rows, "dtype": "float32", "seed": k * 10 + rows}
    for k in range(1, 9)
    for rows in (1, 17)
] + [
    {"in": 200, "out": 300, "k": 4, "rows": 5, "dtype": "float32"},
    {"in": 256, "out": 256, "k": 3, "rows": 53, "dtype": "float32"},
    {"in": 384, "out": 256, "k": 2, "rows": 7, "dtype": "float16"},
    {"in": 384, "out": 256, "k": 2, "rows": 7, "dtype": "bfloat16"},
    # 16 column blocks fill the interpreter's target of 16 programs: the one-slice path (the others split k)
    {"in": 256, "out": 2048, "k": 3, "rows": 3, "dtype": "float32"},
]
TOL = {"float32": 2e-3, "float16": 3e-3, "bfloat16": 1.5e-2}


@pytest.fixture(scope="module")
def results():
    env = {**os.environ, "ESCHA_TRITON_MAX_ROWS": "24"}
    script = Path(__file__).with_name("triton_cases.py")
    done = subprocess.run(
        [sys.executable, str(script), json.dumps([*CASES, "opcheck"])],
        capture_output=True, text=True, timeout=1200, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


IDS = [f"K{c['k']}-{c['in']}x{c['out']}-r{c['rows']}-{c['dtype']}" for c in CASES]


@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_triton_kernels_match_the_reference(results, i):
    case, res = CASES[i], results[i]
    assert res["finite"] and res["outside_untouched"], res
    assert res["rel_err"] < TOL[case["dtype"]], (case, res)


def test_opcheck(results):
    """``torch.library.opcheck`` of ``quantpack::escha_triton_`` (schema, fake implementation, tracing), under the
    interpreter (quantpack-exl3's tests list it among the project's ops)."""
    assert results[-1] == {"opcheck": "passed"}


#: (target, K, activation dtype) compiled ahead of time below: both GPU kinds the kernel serves, K at both ends and
#: in the middle, each model dtype once
COMPILED = [("cuda", k, "fp16") for k in (1, 2, 3, 8)] + [("cuda", 2, "bf16"), ("cuda", 2, "fp32"), ("hip", 2, "fp16")]


@pytest.mark.parametrize("target,k,act", COMPILED)
def test_kernels_compile_for_hopper_and_gfx1201(target, k, act):
    """The interpreter runs kernels as Python, so it takes what compiled Triton refuses (a non-constexpr global, say):
    compile both kernels to device code here (CUDA sm_90 cubin, ROCm gfx1201 code object; no GPU needed) with the
    argument types the op passes them (``ops.run_escha_triton``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from quantpack_escha.backends.triton import escha_triton as et
    from quantpack_escha.backends.triton.ops import BK, BM, GEMM_STAGES, GEMM_WARPS

    gpu = GPUTarget("cuda", 90, 32) if target == "cuda" else GPUTarget("hip", "gfx1201", 32)
    i32 = "i32"
    inputs = {"x_ptr": f"*{act}", "a_ptr": "*fp32", "h_ptr": "*fp32", "xt_ptr": "*fp16", "rows": i32, "width": i32}
    inputs |= {"k": i32, "x_stride": i32, "BM": "constexpr"}
    gemm = {"xt_ptr": "*fp16", "code_ptr": "*i32", "place_ptr": "*i32", "part_ptr": "*fp32", "rows": i32, "k": i32}
    gemm |= {"n": i32, "slice_k": i32, "rows_pad": i32, "KBITS": "constexpr", "BM": "constexpr", "BK": "constexpr"}
    reduce = {"part_ptr": "*fp32", "h_ptr": "*fp32", "b_ptr": "*fp32", "out_ptr": f"*{act}", "rows": i32, "n": i32}
    reduce |= {"out_stride": i32, "col": i32, "out_features": i32, "splits": i32, "rows_pad": i32, "BM": "constexpr"}
    gemm_options = {"num_warps": GEMM_WARPS, "num_stages": GEMM_STAGES}
    for fn, sig, consts, options in (
        (et.input_kernel, inputs, {"BM": BM}, {}),
        (et.gemm_kernel, gemm, {"KBITS": k, "BM": BM, "BK": BK}, gemm_options),
        (et.reduce_kernel, reduce, {"BM": BM}, {}),
    ):
        binary = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=gpu, options=options)
        assert binary.asm.get("cubin" if target == "cuda" else "hsaco"), f"{fn.__name__}: no device code"


def test_split_plan_covers_k_and_fits_the_workspace():
    """Every plan's slices are whole BK steps covering k exactly once, the grid reaches the target where k and the
    partials allow, and a piece's partials fit the workspace; the test cases above split."""
    from quantpack_escha.backends.triton.ops import BK, BM, PART_ELEMS, piece_rows, split_plan

    assert split_plan(1, 256, 384, 16) == (6, 48)
    assert split_plan(17, 256, 384, 16) == (3, 96)
    assert split_plan(3, 256, 2048, 16) == (1, 256)
    for target in (16, 264, 512):
        for k in (128, 256, 4096, 14336):
            for n in (128, 1024, 4096, 14336, 128256, 524288):
                piece = piece_rows(n)
                assert piece % BM == 0 and piece * n <= PART_ELEMS
                for rows in {1, 5, 16, 17, 64, 300, piece}:
                    rows = min(rows, piece)
                    splits, slice_k = split_plan(rows, k, n, target)
                    row_blocks = -(-rows // BM)
                    assert slice_k % BK == 0 and (splits - 1) * slice_k < k <= splits * slice_k
                    assert splits * row_blocks * BM * n <= PART_ELEMS
                    if splits > 1:
                        assert splits * row_blocks * (n // 128) < 2 * target
