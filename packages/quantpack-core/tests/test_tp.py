"""Tensor-parallel cuts of one EXL3 linear layer, simulated for 2, 4 and 8 ranks in one process: the ranks' outputs
(gathered for column parallel, summed for row parallel) equal the unsharded layer in float64, for block-aligned
slices and for the whole-tensor fallbacks of cuts inside a 128-feature block."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from quantpack_core import GeometryError, reference_linear
from quantpack_core.codec import Exl3Tensors
from quantpack_core.synthetic import random_exl3_layer
from quantpack_core.tp import COLUMN, ROW, cut_tensors, expert_split, plan_cut, rank_forward

# (in, out) logical features, all divisible by 8 (vLLM splits evenly); 640 at TP 2 gives 320 per rank (inside a
# block), 200 is a padded layer
SHAPES = [(256, 512), (1024, 256), (640, 640), (256, 1024), (1024, 200)]


def layer(i, o, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Exl3Tensors.from_tensors(random_exl3_layer(i, o, k, "mul1", generator=g))


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize(("i", "o"), SHAPES)
def test_column_parallel_gather_equals_the_layer(tp, i, o):
    t = layer(i, o)
    x = torch.randn(5, i, dtype=torch.float64)
    want = reference_linear(x, t, torch.float64, out_features=o)
    parts = []
    for r in range(tp):
        cut = plan_cut(COLUMN, o, tp, r)
        kept = cut_tensors(t, cut)
        if cut.sliced:
            assert kept.trellis.shape[1] < t.trellis.shape[1]  # the rank holds only its blocks
        parts.append(rank_forward(x, kept, cut, i))
    torch.testing.assert_close(torch.cat(parts, -1), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize(("i", "o"), SHAPES)
def test_row_parallel_sum_equals_the_layer(tp, i, o):
    t = layer(i, o, seed=1)
    x = torch.randn(3, i, dtype=torch.float64)
    want = reference_linear(x, t, torch.float64)
    total = sum(
        rank_forward(x[:, c.start : c.stop], cut_tensors(t, c), c, i)
        for c in (plan_cut(ROW, i, tp, r) for r in range(tp))
    )
    torch.testing.assert_close(total, want, rtol=1e-10, atol=1e-10)


def test_which_cuts_are_sliced():
    assert plan_cut(COLUMN, 512, 4, 1).sliced  # 128 per rank: whole blocks
    assert not plan_cut(COLUMN, 640, 2, 0).sliced  # 320 per rank: inside a block -> whole tensor
    assert plan_cut(ROW, 1024, 8, 7).sliced
    assert not plan_cut(ROW, 512, 8, 3).sliced  # 64 per rank
    assert plan_cut(COLUMN, 200, 1, 0).sliced  # one rank ending in the padded last block


def test_uneven_split_named():
    with pytest.raises(GeometryError, match=r"down_proj: 200 features cannot be split evenly over 3"):
        plan_cut(ROW, 200, 3, 0, "model.layers.0.mlp.down_proj")


@given(experts=st.integers(1, 300), tp=st.integers(1, 64))
def test_expert_split_places_every_expert_once(experts, tp):
    """The ranks' expert sets partition 0..E-1, each at most ceil(E / tp) experts, and match vLLM's round-robin
    expert map (``fused_moe/expert_map_manager.py``: rank r holds r, r + tp, ...)."""
    parts = [expert_split(experts, tp, r) for r in range(tp)]
    flat = sorted(e for p in parts for e in p)
    assert flat == list(range(experts))
    assert max(len(p) for p in parts) == -(-experts // tp)
    for r, p in enumerate(parts):
        assert all(e % tp == r for e in p)


def test_expert_split_refuses_bad_input():
    with pytest.raises(ValueError):
        expert_split(8, 4, 4)
    with pytest.raises(ValueError):
        expert_split(0, 2, 0)
