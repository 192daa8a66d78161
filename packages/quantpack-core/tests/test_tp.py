"""Tensor-parallel cuts of one EXL3 linear layer, simulated for 2, 4 and 8 ranks in one process: the ranks' outputs
(gathered for column parallel, summed for row parallel) equal the unsharded layer in float64, for block-aligned
slices and for the fallbacks of shares inside a 128-feature block (run on the blocks the share touches)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantpack_core import GeometryError, reference_linear
from quantpack_core.codec import Exl3Tensors, cut_tensors, rank_forward
from quantpack_core.synthetic import random_exl3_layer
from quantpack_core.tp import COLUMN, ROW, expert_split, make_cut, plan_cut

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
        # the rank holds only the blocks its share touches: its own, or at most one more block at each end
        assert kept.svh.shape[0] == sum(b - a for a, b in cut.spans) == kept.trellis.shape[1] * 16
        assert kept.svh.shape[0] <= -(-cut.width // 128) * 128 + (0 if cut.sliced else 128)
        parts.append(rank_forward(x, kept, cut))
    torch.testing.assert_close(torch.cat(parts, -1), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize(("i", "o"), SHAPES)
def test_row_parallel_sum_equals_the_layer(tp, i, o):
    t = layer(i, o, seed=1)
    x = torch.randn(3, i, dtype=torch.float64)
    want = reference_linear(x, t, torch.float64)
    total = sum(
        rank_forward(x[:, c.start : c.stop], cut_tensors(t, c), c) for c in (plan_cut(ROW, i, tp, r) for r in range(tp))
    )
    torch.testing.assert_close(total, want, rtol=1e-10, atol=1e-10)


def test_which_cuts_are_sliced():
    assert plan_cut(COLUMN, 512, 4, 1).sliced  # 128 per rank: whole blocks
    assert not plan_cut(COLUMN, 640, 2, 0).sliced  # 320 per rank: ends inside a block
    assert plan_cut(ROW, 1024, 8, 7).sliced
    assert not plan_cut(ROW, 512, 8, 3).sliced  # 64 per rank
    assert plan_cut(COLUMN, 200, 1, 0).sliced  # one rank ending in the padded last block


def test_fallback_keeps_the_blocks_its_share_touches():
    """640 features over 2 ranks (320 each): rank 0 keeps blocks [0, 384) and selects its 320; rank 1 keeps
    [256, 640) and selects from 64 on; a row cut puts the input slice at the same place."""
    c0, c1 = plan_cut(COLUMN, 640, 2, 0), plan_cut(COLUMN, 640, 2, 1)
    assert (c0.spans, c1.spans) == (((0, 384),), ((256, 640),))
    assert c0.kept_positions() == list(range(320)) and c1.kept_positions() == list(range(64, 384))
    assert plan_cut(ROW, 640, 2, 1).row_pad() == (64, 0) and plan_cut(ROW, 640, 2, 0).row_pad() == (0, 64)
    # two ranges in one block merge into one span; the padded end (200 -> 256) is not a feature
    c = make_cut(COLUMN, [(10, 20), (100, 140), (150, 200)], 200)
    assert c.spans == ((0, 256),) and c.kept_features == 200
    assert c.kept_positions() == [*range(10, 20), *range(100, 140), *range(150, 200)]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), blocks=st.integers(1, 5), tail=st.integers(0, 127), kind=st.sampled_from([COLUMN, ROW]))
def test_any_cut_runs_exactly(data, blocks, tail, kind):
    """Any ordered ranges (one for a row cut) of a layer of any width: the kept spans' forward equals the owned
    columns of the full product (column), or the full product of the input zero outside the range (row)."""
    features = blocks * 128 - tail
    cuts = sorted(set(data.draw(st.lists(st.integers(0, features), min_size=2, max_size=6 if kind == COLUMN else 2))))
    ranges = [(a, b) for a, b in zip(cuts[::2], cuts[1::2], strict=False) if a < b] or [(0, features)]
    cut = make_cut(kind, ranges[:1] if kind == ROW else ranges, features)
    i, o = (128, features) if kind == COLUMN else (features, 128)
    t = layer(i, o, seed=features)
    x = torch.randn(2, i, dtype=torch.float64)
    full = reference_linear(x, t, torch.float64, out_features=o)
    if kind == COLUMN:
        got, want = rank_forward(x, cut_tensors(t, cut), cut), full[:, cut.columns()]
    else:
        masked = torch.zeros_like(x)
        masked[:, cut.start : cut.stop] = x[:, cut.start : cut.stop]
        got = rank_forward(x[:, cut.start : cut.stop], cut_tensors(t, cut), cut)
        want = reference_linear(masked, t, torch.float64, out_features=o)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


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
