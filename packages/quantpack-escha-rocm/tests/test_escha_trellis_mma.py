"""The escha ``trellis_mma`` backend on CPU: the EXL3 shard whose trellis, codebook, K and scales it hands
quantpack-core's trellis_mma kernels computes the escha shard (both formats' float64 references), its float16 scales
and their refusal, and the CUDA priority list without quantpack-exl3 or without a GPU. The kernels themselves run on
the GPU tier (``test_escha_gpu.py``)."""

import math
import sys

import pytest
import torch

from quantpack_core.codec import reference_linear as exl3_reference
from quantpack_core.errors import LayerLoadError
from quantpack_core.kernels import CUDA, TP_WHOLE, LinearSpec, Platform, choose_kernel
from quantpack_core.synthetic import random_exl3_layer
from quantpack_escha.backends.trellis_mma import EschaTrellisMmaLinearKernel, exl3_shard
from quantpack_escha.codec import HAD_GAIN, EschaTensors, reference_linear
from quantpack_escha.convert import split_scale
from quantpack_escha.kernels import LINEAR_KERNELS

H100 = Platform(CUDA, capability=90)


def layer(k: int, seed: int, in_f: int = 384, out_f: int = 256, gain: float = 1.0) -> EschaTensors:
    g = torch.Generator().manual_seed(seed)
    t = random_exl3_layer(in_f, out_f, k, "mcg", generator=g)
    rin, s_in = split_scale(t["suh"].float() / math.sqrt(128) * gain, g)
    rout, s_out = split_scale(t["svh"].float() / math.sqrt(128), g)
    return EschaTensors(t["trellis"], rin, s_in, rout, s_out)


def spec(dtype=torch.float16, platform=H100) -> LinearSpec:
    return LinearSpec(platform, "escha", 2.0, "mcg", 384, 256, 384, 256, dtype, TP_WHOLE)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("gain", [1.0, 3e-3, 40.0])
def test_the_exl3_shard_computes_the_escha_shard(k, gain):
    """Exactly what escha computes with its scale products rounded to float16 (the algebra: Hadamard gains, the
    power of two), and within float16's rounding of the float32 products of the escha reference."""
    e = layer(k, seed=k, gain=gain)
    t = exl3_shard(e)
    assert t.trellis is e.code and t.codebook.value == "mcg"
    assert t.suh.dtype == t.svh.dtype == torch.float16
    assert float(t.suh.abs().max()) <= 16.0
    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    got = exl3_reference(x, t, torch.float64)
    alpha = float(e.input_scale(torch.float64).abs().max() / t.suh.double().abs().max())
    alpha = 2.0 ** round(math.log2(alpha))
    same = EschaTensors(
        e.code,
        t.suh.double() * alpha,
        torch.ones(384, dtype=torch.float64),
        t.svh.double() / (HAD_GAIN * HAD_GAIN * alpha),
        torch.ones(256, dtype=torch.float64),
    )
    torch.testing.assert_close(got, reference_linear(x, same, torch.float64), rtol=1e-12, atol=1e-12)
    ref = reference_linear(x, e, torch.float64)
    assert float((got - ref).norm() / ref.norm()) < 2**-10  # two float16 roundings of relative 2^-11 at most


def test_suh_peaks_at_one_where_svh_allows():
    t = exl3_shard(layer(2, seed=3))
    assert 0.5 < float(t.suh.abs().max()) <= 1.0


@pytest.mark.parametrize("side", ["input", "output"])
def test_an_all_zero_side_gives_zero_scales_not_overflow(side):
    """The shard computes zero; the other side's scales, however large, must not reach float16 unscaled."""
    e = layer(2, seed=5)
    zero_in, zero_out = side == "input", side == "output"
    t = exl3_shard(
        EschaTensors(
            e.code,
            e.rin.float() * (0 if zero_in else 1e6),
            e.s_in,
            e.rout.float() * (0 if zero_out else 1e6),
            e.s_out,
        )
    )
    assert not t.suh.any() and not t.svh.any()


def test_scales_float16_cannot_hold_are_refused_naming_the_fix():
    e = layer(2, seed=1)
    s_in = e.s_in.float().clone()
    s_in[:3] = 1e-9  # a = s_in * rin spans more magnitudes than float16 holds
    bad = EschaTensors(e.code, e.rin, s_in, e.rout, e.s_out)
    where = "model.layers.0.mlp.up_proj"
    with pytest.raises(LayerLoadError, match=r"model\.layers\.0\.mlp\.up_proj: its input scales s_in \* rin") as err:
        exl3_shard(bad, where)
    assert "QUANTPACK_ESCHA_BACKEND=triton" in str(err.value)
    wide = EschaTensors(e.code, e.rin, e.s_in, e.rout, e.s_out.float() * torch.logspace(-6, 6, 256))
    with pytest.raises(LayerLoadError, match=r"128 \* rout \* s_out"):
        exl3_shard(wide)


def test_cuda_lists_trellis_mma_first_then_triton():
    assert [k.name for k in LINEAR_KERNELS[CUDA]] == ["trellis_mma", "triton"]


def test_without_a_cuda_device_cuda_falls_to_triton(monkeypatch):
    """Where the kernels cannot run (no CUDA device here), the backend is unavailable with the reason, and the Triton
    kernel serves; quantpack-exl3 plays no part (made unimportable)."""
    pytest.importorskip("triton")
    monkeypatch.setitem(sys.modules, "quantpack_exl3", None)  # import fails as uninstalled
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    ok, why = EschaTrellisMmaLinearKernel.available(H100)
    assert not ok and "CUDA device" in why
    choice = choose_kernel(LINEAR_KERNELS[CUDA], spec(), "model.layers.0.self_attn.q_proj")
    assert choice.kernel.name == "triton" and choice.declined[0][0] == "trellis_mma"


def test_the_kernels_rules_apply_without_quantpack_exl3(monkeypatch):
    """quantpack-core's trellis_mma reasons come through, with quantpack-exl3 unimportable (float32 models are not
    trellis_mma's; no CUDA device on this machine)."""
    monkeypatch.setitem(sys.modules, "quantpack_exl3", None)
    ok, why = EschaTrellisMmaLinearKernel.can_implement(spec(torch.float32))
    assert not ok and "float32" in why
    assert EschaTrellisMmaLinearKernel.can_implement(spec(torch.bfloat16)) == (True, None)
    assert EschaTrellisMmaLinearKernel.can_implement(
        LinearSpec(H100, "exl3", 2.0, "mcg", 384, 256, 384, 256, torch.float16, TP_WHOLE)
    ) == (False, "runs escha only, this is exl3")
    if not torch.cuda.is_available():
        ok, why = EschaTrellisMmaLinearKernel.available(H100)
        assert not ok and "CUDA device" in why
