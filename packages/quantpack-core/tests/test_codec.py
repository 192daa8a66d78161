"""Dequantization and the reference forward agree with each other and with an fp64 oracle."""

import pytest
import torch

from quantpack_core import CodecError, Exl3Tensors, dequantize, reference_linear, unpack_signs
from quantpack_core.synthetic import random_exl3_layer


@pytest.mark.parametrize("k,codebook", [(2, "3inst"), (4, "mcg"), (2.5, "mul1"), (6, "mul1")])
def test_forward_equals_x_times_dequantized_weight(k, codebook):
    g = torch.Generator().manual_seed(3)
    t = Exl3Tensors.from_tensors(random_exl3_layer(256, 384, k, codebook, generator=g, bias=True))
    x = torch.randn(5, 256, generator=g, dtype=torch.float64)
    w = dequantize(t, torch.float64)
    y = reference_linear(x, t, torch.float64)
    expect = x @ w
    expect[:, :384] += t.bias.double()
    assert torch.allclose(y, expect, rtol=1e-10, atol=1e-10)
    y32 = x.float() @ dequantize(t, torch.float32)
    assert (y32.double() - x @ w).norm() / (x @ w).norm() < 1e-5


def test_padded_layer_zero_extends_input_and_trims_output():
    g = torch.Generator().manual_seed(4)
    t = Exl3Tensors.from_tensors(random_exl3_layer(200, 300, 3, "mul1", generator=g))
    assert t.padded_shape == (256, 384)
    x = torch.randn(3, 200, generator=g, dtype=torch.float64)
    y = reference_linear(x, t, torch.float64, out_features=300)
    assert y.shape == (3, 300)
    w = dequantize(t, torch.float64)
    assert torch.allclose(y, x @ w[:200, :300], atol=1e-10)


def test_legacy_packed_signs():
    packed = torch.tensor([0b101, -1], dtype=torch.int16)
    s = unpack_signs(packed)
    assert s.shape == (32,)
    assert s[:4].tolist() == [-1, 1, -1, 1]
    assert (s[16:] == -1).all()


def test_marker_value_and_clash_are_rejected():
    g = torch.Generator().manual_seed(5)
    layer = random_exl3_layer(128, 128, 4, "mul1", generator=g)
    bad = dict(layer, mul1=torch.tensor(12345, dtype=torch.int32))
    with pytest.raises(CodecError, match="0x00003039"):
        Exl3Tensors.from_tensors(bad)
    both = dict(layer, mcg=torch.tensor(0, dtype=torch.int32))
    with pytest.raises(CodecError, match="both"):
        Exl3Tensors.from_tensors(both)


def test_half_integer_k_needs_mul1():
    g = torch.Generator().manual_seed(6)
    layer = random_exl3_layer(128, 128, 2.5, "mul1", generator=g)
    del layer["mul1"]
    with pytest.raises(CodecError, match="mul1"):
        Exl3Tensors.from_tensors(layer)


def test_suh_length_must_match_trellis():
    g = torch.Generator().manual_seed(7)
    layer = random_exl3_layer(256, 128, 4, "mul1", generator=g)
    layer["suh"] = layer["suh"][:128]
    with pytest.raises(CodecError, match="suh"):
        Exl3Tensors.from_tensors(layer)


def test_non_finite_vectors_are_rejected():
    g = torch.Generator().manual_seed(8)
    layer = random_exl3_layer(128, 128, 4, "mul1", generator=g)
    layer["svh"][5] = float("nan")
    with pytest.raises(CodecError, match="svh holds 1 NaN"):
        Exl3Tensors.from_tensors(layer)
