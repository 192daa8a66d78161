"""The escha codec on its own (no vLLM): the same trellis as an EXL3 layer gives the same layer once the scales are
split as the converter splits them; pre- and post-scales are not interchangeable; tensor-parallel cuts reproduce
the layer's columns and partial sums; bad tensors are refused with the tensor named."""

import math

import pytest
import torch

from quantpack_core.codec import Exl3Tensors
from quantpack_core.codec import reference_linear as exl3_linear
from quantpack_core.compare import relative_error
from quantpack_core.errors import CodecError
from quantpack_core.synthetic import random_exl3_layer
from quantpack_core.tp import COLUMN, ROW, make_cut, plan_cut
from quantpack_escha.codec import EschaTensors, cut_tensors, dequantize, reference_linear
from quantpack_escha.convert import split_scale


def escha_twin(t: Exl3Tensors, seed: int = 0) -> EschaTensors:
    g = torch.Generator().manual_seed(seed)
    rin, s_in = split_scale(t.suh.float() / math.sqrt(128), g)
    rout, s_out = split_scale(t.svh.float() / math.sqrt(128), g)
    return EschaTensors(t.trellis, rin, s_in, rout, s_out)


def layer(in_f, out_f, k, seed):
    g = torch.Generator().manual_seed(seed)
    return Exl3Tensors.from_tensors(random_exl3_layer(in_f, out_f, k, "mcg", generator=g))


@pytest.mark.parametrize("k", [1, 2, 3, 4, 6, 8])
def test_escha_forward_equals_the_exl3_layer_with_the_same_trellis(k):
    t = layer(256, 384, k, seed=k)
    e = escha_twin(t, seed=k)
    x = torch.randn(5, 256, dtype=torch.float64)
    # EXL3's scales against the escha split's products (fp16 each): the split is exact to fp16 rounding of r * s
    ref = exl3_linear(
        x,
        Exl3Tensors(
            t.trellis,
            (e.input_scale(torch.float64) * math.sqrt(128)),
            (e.output_scale(torch.float64) * math.sqrt(128)),
            t.codebook,
        ),
        torch.float64,
    )
    y = reference_linear(x, e, torch.float64)
    assert relative_error(y, ref) < 1e-12
    assert relative_error(y, exl3_linear(x, t, torch.float64)) < 3e-3  # fp16 rounding of the split
    w = dequantize(e, torch.float64)
    assert relative_error(x @ w, y) < 1e-12
    assert e.k_bits == k


def test_pre_and_post_scales_are_not_interchangeable():
    """Applying rin after the input transform (or rout before the output one) gives another layer."""
    from quantpack_core.codec import decode_matrix, had128

    t = layer(256, 256, 4, seed=3)
    e = escha_twin(t, seed=3)
    x = torch.randn(4, 256, dtype=torch.float64)
    y = reference_linear(x, e, torch.float64)
    what = decode_matrix(e.code, "mcg").double() * 128
    swapped = had128(had128(x * e.s_in.double()) * e.rin.double() @ what) * e.rout.double() * e.s_out.double()
    assert relative_error(swapped, y) > 0.1


def test_column_cut_over_two_partitions_and_row_cut_reproduce_the_layer():
    t = escha_twin(layer(256, 512, 3, seed=5), seed=5)
    x = torch.randn(3, 256, dtype=torch.float64)
    full = reference_linear(x, t, torch.float64)
    # a source spanning two partitions of 256 columns, TP 2 rank 1: columns [128, 256) and [384, 512)
    cut = make_cut(COLUMN, [(128, 256), (384, 512)], 512)
    kept = cut_tensors(t, cut)
    assert kept.stored_shape == (256, 256)
    assert (
        relative_error(reference_linear(x, kept, torch.float64), torch.cat([full[:, 128:256], full[:, 384:]], 1))
        < 1e-12
    )
    total = sum(
        reference_linear(x[:, r * 128 : (r + 1) * 128], cut_tensors(t, plan_cut(ROW, 256, 2, r)), torch.float64)
        for r in range(2)
    )
    assert relative_error(total, full) < 1e-12


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda d: d.update(code=d["code"].to(torch.int32)), "escha_code must be int16"),
        (lambda d: d.update(code=d["code"][..., :40]), "16\\*K words"),
        (lambda d: d.update(rin=d["rin"][:100]), "escha_rin must be a float vector of 256"),
        (lambda d: d.update(s_out=d["s_out"].to(torch.int16)), "escha_s_out must be a float vector"),
        (lambda d: d["rout"].__setitem__(3, float("nan")), "escha_rout holds 1 NaN"),
    ],
)
def test_bad_tensors_are_refused_naming_the_tensor(change, match):
    e = escha_twin(layer(256, 256, 4, seed=1))
    d = {"code": e.code.clone(), "rin": e.rin.clone(), "s_in": e.s_in.clone(), "rout": e.rout.clone(),
         "s_out": e.s_out.clone()}  # fmt: skip
    change(d)
    with pytest.raises(CodecError, match=match):
        EschaTensors(**d)


def test_missing_tensor_is_named():
    e = escha_twin(layer(256, 256, 2, seed=2))
    with pytest.raises(CodecError, match=r"missing \.escha_s_in"):
        EschaTensors.from_tensors({"escha_code": e.code, "escha_rin": e.rin, "escha_rout": e.rout,
                                   "escha_s_out": e.s_out})  # fmt: skip
