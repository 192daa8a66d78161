"""Runs the escha Triton kernels under Triton's interpreter (CPU) on a list of cases and prints one JSON line of
results; ``test_escha_triton.py`` starts it in a fresh process, because ``TRITON_INTERPRET`` must be set before the
kernels are defined."""

import json
import math
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch

from quantpack_core.kernels import CUDA, TP_WHOLE, LinearSpec, Platform
from quantpack_core.synthetic import random_exl3_layer
from quantpack_escha.backends.triton import EschaTritonLinearKernel, ops
from quantpack_escha.codec import EschaTensors, reference_linear
from quantpack_escha.convert import split_scale

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def run(case: dict) -> dict:
    in_f, out_f, k, rows, dtype = case["in"], case["out"], case["k"], case["rows"], DTYPES[case["dtype"]]
    g = torch.Generator().manual_seed(case.get("seed", 0))
    t = random_exl3_layer(in_f, out_f, k, "mcg", generator=g)
    rin, s_in = split_scale(t["suh"].float() / math.sqrt(128), g)
    rout, s_out = split_scale(t["svh"].float() / math.sqrt(128), g)
    e = EschaTensors(t["trellis"], rin, s_in, rout, s_out)
    kp, n = e.stored_shape
    spec = LinearSpec(Platform(CUDA, capability=90), "escha", float(k), "mcg", kp, n, in_f, out_f, dtype, TP_WHOLE)
    p = EschaTritonLinearKernel.prepare(e, spec, torch.device("cpu"))
    x = torch.randn(rows, in_f, generator=g).to(dtype)
    col = 8
    out = torch.full((rows, out_f + 24), float("nan"), dtype=dtype)
    p.run(x, *p.tensors.values(), *p.static, out, col)
    ref = reference_linear(x.double(), e, torch.float64, out_features=out_f)
    got = out[:, col : col + out_f].double()
    return {
        "rel_err": float((got - ref).norm() / ref.norm()),
        "finite": bool(torch.isfinite(got).all()),
        "outside_untouched": bool(torch.isnan(out[:, :col]).all() and torch.isnan(out[:, col + out_f :]).all()),
    }


def opcheck() -> dict:
    """``torch.library.opcheck`` of ``quantpack::escha_triton_`` on one prepared shard."""
    g = torch.Generator().manual_seed(5)
    t = random_exl3_layer(256, 256, 3, "mcg", generator=g)
    e = EschaTensors(t["trellis"], t["suh"], t["suh"], t["svh"], t["svh"])
    spec = LinearSpec(Platform(CUDA, capability=90), "escha", 3.0, "mcg", 256, 256, 256, 256, torch.float32, TP_WHOLE)
    p = EschaTritonLinearKernel.prepare(e, spec, torch.device("cpu"))
    args = (torch.randn(3, 256), *p.tensors.values(), *p.static, torch.zeros(3, 300), 16)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.quantpack.escha_triton_.default, args, test_utils=utils)
    return {"opcheck": "passed"}


def main() -> None:
    cases = json.loads(sys.argv[1])
    ops.MAX_ROWS = int(os.environ.get("ESCHA_TRITON_MAX_ROWS", ops.MAX_ROWS))
    print(json.dumps([opcheck() if c == "opcheck" else run(c) for c in cases]))


if __name__ == "__main__":
    main()
