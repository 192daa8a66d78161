"""GPU tier: the escha kernels of CUDA (quantpack-core's trellis_mma through the escha backend, and the Triton kernel)
against the escha codec's fp64 reference, on random escha layers of K 1..4 over 1..4096 rows: relative error within
1.1x of what exllamav3's EXL3 kernels make of the same trellis as an EXL3 layer (when exllamav3 imports), never NaN,
only the shard's columns written; and the kernels the GPU chooses."""

import math

import pytest
import torch

from quantpack_core.codec import Exl3Tensors
from quantpack_core.kernels import CUDA, TP_WHOLE, LinearSpec, Platform
from quantpack_core.synthetic import random_exl3_layer
from quantpack_escha.codec import EschaTensors, reference_linear
from quantpack_escha.convert import split_scale

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU tier: nox -s gpu-tests)"),
]

ROWS = [1, 7, 33, 145, 1024, 4096]
RATIO, FLOOR = 1.1, 1e-3


def platform():
    major, minor = torch.cuda.get_device_capability()
    return Platform(CUDA, capability=major * 10 + minor)


def layer(k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    t = random_exl3_layer(768, 512, k, "mcg", generator=g)
    rin, s_in = split_scale(t["suh"].float() / math.sqrt(128), g)
    rout, s_out = split_scale(t["svh"].float() / math.sqrt(128), g)
    return EschaTensors(t["trellis"], rin, s_in, rout, s_out)


def exllamav3_error(e: EschaTensors, x16: torch.Tensor, ref: torch.Tensor) -> float | None:
    """exllamav3's own EXL3 layer on the same trellis (suh / svh from escha's scale products), or None without it."""
    try:
        from exllamav3.modules.quant.exl3 import LinearEXL3
    except Exception:
        return None
    dev = x16.device
    suh = (e.input_scale(torch.float32) * math.sqrt(128)).half().to(dev)
    svh = (e.output_scale(torch.float32) * math.sqrt(128)).half().to(dev)
    t = Exl3Tensors(e.code.to(dev), suh, svh, "mcg")
    mcg = torch.tensor(0xCBAC1FED - (1 << 32), dtype=torch.int32, device=dev)
    lin = LinearEXL3(None, 768, 512, suh=t.suh, svh=t.svh, trellis=t.trellis, key="test", mcg=mcg)
    y = lin.forward(x16, {}).double().cpu()
    return float((y - ref).norm() / ref.norm())


def kernel_class(name: str):
    """The escha linear kernel ``name`` of CUDA's list."""
    if name == "trellis_mma":
        from quantpack_escha.backends.trellis_mma import EschaTrellisMmaLinearKernel

        return EschaTrellisMmaLinearKernel
    from quantpack_escha.backends.triton import EschaTritonLinearKernel

    return EschaTritonLinearKernel


@pytest.mark.parametrize("name", ["trellis_mma", "triton"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("rows", ROWS)
def test_kernel_against_the_reference(name, k, rows):
    kernel = kernel_class(name)
    dev = torch.device("cuda")
    e = layer(k, seed=k * 100 + rows)
    spec = LinearSpec(platform(), "escha", float(k), "mcg", 768, 512, 768, 512, torch.float16, TP_WHOLE)
    assert kernel.available(platform()) == (True, None)
    assert kernel.can_implement(spec) == (True, None)
    p = kernel.prepare(e, spec, dev)
    x16 = torch.randn(rows, 768, device=dev).half()
    out = torch.full((rows, 512 + 48), float("nan"), dtype=torch.float16, device=dev)
    p.run(x16, *p.tensors.values(), *p.static, out, 16)
    ref = reference_linear(x16.double().cpu(), e, torch.float64)
    got = out[:, 16:528].double().cpu()
    assert torch.isfinite(got).all() and torch.isnan(out[:, :16]).all() and torch.isnan(out[:, 528:]).all()
    ours = float((got - ref).norm() / ref.norm())
    theirs = exllamav3_error(e, x16, ref)
    assert ours <= max(RATIO * theirs, FLOOR) if theirs is not None else ours <= 2e-3, (ours, theirs)


def test_this_gpu_chooses_trellis_mma_and_triton_for_float32():
    from quantpack_core.kernels import choose_kernel
    from quantpack_escha.config import EschaConfig

    linear, _ = EschaConfig.resolve_kernels(platform())
    assert [kk.name for kk in linear] == ["trellis_mma", "triton"]
    spec = LinearSpec(platform(), "escha", 2.0, "mcg", 4096, 4096, 4096, 4096, torch.bfloat16, TP_WHOLE)
    assert choose_kernel(linear, spec, "test").kernel.name == "trellis_mma"
    spec32 = LinearSpec(platform(), "escha", 2.0, "mcg", 4096, 4096, 4096, 4096, torch.float32, TP_WHOLE)
    assert choose_kernel(linear, spec32, "test").kernel.name == "triton"
