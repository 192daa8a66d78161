import pytest
from hypothesis import given
from hypothesis import strategies as st

from quantpack_core.names import constituents, expand_fused, normalize_prefix, shard_partitions, shard_slot


@pytest.mark.parametrize(
    "a,b",
    [
        ("model.language_model.layers.3.mlp.up_proj", "language_model.model.layers.3.mlp.up_proj"),
        ("model.layers.0.self_attn.q_proj", "layers.0.self_attn.q_proj"),
        ("lm_head", "language_model.lm_head"),
        ("model.visual.blocks.0.attn.qkv", "visual.blocks.0.attn.qkv"),
        ("backbone.layers.1.mixer.in_proj", "model.layers.1.mixer.in_proj"),
    ],
)
def test_checkpoint_and_vllm_names_meet(a, b):
    assert normalize_prefix(a) == normalize_prefix(b)


def test_distinct_modules_stay_distinct():
    assert normalize_prefix("mtp.layers.0.mlp") != normalize_prefix("model.layers.0.mlp")
    assert normalize_prefix("model") == "model"


def test_fused_expansion():
    assert expand_fused("model.layers.0.self_attn.qkv_proj") == [
        ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"]
    ]
    assert expand_fused("x.in_proj_qkvz") == [["x.in_proj_qkvz"], ["x.in_proj_qkv", "x.in_proj_z"]]
    assert expand_fused("x.in_proj_ba") == [["x.in_proj_ba"], ["x.in_proj_b", "x.in_proj_a"]]
    assert expand_fused("gate_up_proj") == [["gate_proj", "up_proj"]]
    assert expand_fused("x.o_proj") == [["x.o_proj"]]
    assert constituents("x.in_proj_qkvz") == ["x.in_proj_qkvz", "x.in_proj_qkv", "x.in_proj_z"]


def test_shard_slots_sort_in_output_order():
    assert [shard_slot(s) for s in ("q", "k", "v")] == [0, 1, 2]
    assert shard_slot(None) == 0 and shard_slot(1) == 1 and shard_slot((0, 1, 2)) == 0
    assert sorted([3, (0, 1, 2)], key=shard_slot) == [(0, 1, 2), 3]
    for bad in ("x", 1.5, (), ("a",), True):
        with pytest.raises(ValueError):
            shard_slot(bad)


@given(st.integers(1, 8).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n - 1), st.integers(1, n))))
def test_tuple_partitions(args):
    n, start, length = args
    ids = tuple(range(start, min(n, start + length)))
    assert shard_partitions(ids, n) == ids
    assert shard_partitions(None, n) == tuple(range(n))
    with pytest.raises(ValueError):
        shard_partitions(n, n)
