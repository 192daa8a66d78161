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


def _whole_matrix(t: Exl3Tensors, dtype: torch.dtype) -> torch.Tensor:
    """The formula on the whole matrix at once (the codec before it worked in blocks)."""
    from quantpack_core.codec import decode_matrix, had128

    w = had128(had128(decode_matrix(t.trellis, t.codebook).to(dtype), 0), 1)
    return w.mul_(t.suh.to(dtype)[:, None]).mul_(t.svh.to(dtype)[None, :])


@pytest.mark.parametrize(
    "shape,k,codebook",
    [((128, 128), 2, "3inst"), ((256, 4224), 4, "mul1"), ((2048, 2048), 2.5, "mul1"), ((300, 500), 6, "mcg")],
)
def test_blocked_dequantize_is_bit_identical_to_the_whole_matrix(shape, k, codebook):
    """In float32 (the load path), blocks of 128 rows x DEQUANT_BLOCK_COLUMNS (4224 columns: two blocks, the last one
    partial) give the same bits as transforming the whole matrix, also written through ``out`` into a trimmed bf16
    (out, in) buffer. float64 may round the Hadamard sums in another order (the BLAS picks its kernel by shape)."""
    g = torch.Generator().manual_seed(7)
    t = Exl3Tensors.from_tensors(random_exl3_layer(*shape, k, codebook, generator=g))
    whole = _whole_matrix(t, torch.float32)
    assert torch.equal(dequantize(t, torch.float32), whole)
    buf = torch.empty((shape[1], shape[0]), dtype=torch.bfloat16)
    assert dequantize(t, torch.float32, out=buf.t()).data_ptr() == buf.data_ptr()
    assert torch.equal(buf, whole[: shape[0], : shape[1]].to(torch.bfloat16).t())
    torch.testing.assert_close(dequantize(t, torch.float64), _whole_matrix(t, torch.float64), rtol=1e-14, atol=1e-17)


def test_decode_rows_equals_decode_matrix_for_every_k():
    from quantpack_core.codec import LEGAL_K, codebook_table, decode_matrix, width_from_k
    from quantpack_core.codec.trellis import decode_rows

    g = torch.Generator().manual_seed(8)
    for k in LEGAL_K:
        tr = torch.randint(-32768, 32768, (8, 5, width_from_k(k)), dtype=torch.int32, generator=g).to(torch.int16)
        got = decode_rows(tr, codebook_table("mul1").float(), k)
        assert torch.equal(got, decode_matrix(tr, "mul1").float()), k


def test_dequantize_out_larger_than_the_matrix_is_rejected():
    t = Exl3Tensors.from_tensors(random_exl3_layer(128, 128, 4, generator=torch.Generator().manual_seed(0)))
    with pytest.raises(CodecError, match="larger than the stored 128x128"):
        dequantize(t, out=torch.empty(129, 128))
