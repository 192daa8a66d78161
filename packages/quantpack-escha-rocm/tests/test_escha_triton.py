"""The escha Triton kernels, run under Triton's interpreter on CPU (in a fresh process: ``triton_cases.py``) against
the escha codec's fp64 reference: every integer K, padded layers (input zero-extended, output trimmed), rows below,
at and above a program's 16 and above a launch's piece (pieces of 24 rows here), every model dtype, only the shard's
columns written. The kernels on a GPU (CUDA, ROCm) were not run in this version."""

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
