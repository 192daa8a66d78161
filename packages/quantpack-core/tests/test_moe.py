"""The MoE expert bank: plan (K-sorted slots, groups, offsets, TP cut), loading, views, pointer tables, and the
reference forward against a plain per-expert loop over the core codec."""

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantpack_core import CodecError, Exl3Tensors, GeometryError, dequantize, reference_linear
from quantpack_core.codec.trellis import LEGAL_K, width_from_k
from quantpack_core.moe import (
    BANK_TENSORS,
    PROJECTIONS,
    Exl3MoeBank,
    KGroup,
    dequantize_expert,
    plan_moe_layer,
    reference_moe_forward,
    shard_slices,
    tp_shard,
    trellis_shape,
)
from quantpack_core.synthetic import random_exl3_layer

LAYER = "model.layers.5.mlp.experts"
H, INTER = 128, 1024  # 8 Hadamard blocks of intermediate channels: tp_size 8 leaves one block per rank
CB = "mul1"
# (K of w1 = w3, K of w2) per logical expert: mixed, unsorted, one pair repeated (a group of two), a half-integer K.
KS = [(4, 2), (2, 5), (3, 3), (5, 4), (2, 5), (2.5, 3)]
K_BITS = [(a, a, b) for a, b in KS]


def make_experts(ks, hidden, inter, codebook=CB, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "w1": random_exl3_layer(hidden, inter, kgu, codebook, generator=g),
            "w3": random_exl3_layer(hidden, inter, kgu, codebook, generator=g),
            "w2": random_exl3_layer(inter, hidden, kd, codebook, generator=g),
        }
        for kgu, kd in ks
    ]


def build(experts, k_bits, hidden, inter, tp_size=1, tp_rank=0, codebook=CB, order=None):
    plan = plan_moe_layer(LAYER, k_bits, hidden, inter, codebook=codebook, tp_size=tp_size, tp_rank=tp_rank)
    bank = Exl3MoeBank(plan)
    bank.allocate("cpu")
    for e in order if order is not None else range(len(experts)):
        bank.load_expert(e, experts[e])
    return bank


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These matrices are tiny: on a busy 2-core machine, torch's intra-op threads spend seconds waiting for each
    other (100x slower than one thread), so this module runs single-threaded."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def experts():
    return make_experts(KS, H, INTER, seed=11)


@pytest.fixture(scope="module")
def dense(experts):
    """Full fp64 weights per expert and projection, from the original tensors."""
    return [{p: dequantize(Exl3Tensors.from_tensors(ex[p]), torch.float64) for p in PROJECTIONS} for ex in experts]


@pytest.fixture(scope="module")
def banks(experts):
    """tp_size -> the banks of all its ranks."""
    return {tp: [build(experts, K_BITS, H, INTER, tp, r) for r in range(tp)] for tp in (1, 2, 4, 8)}


# ------------------------------------------------------------------------------------------------ plan


def test_plan_sorts_slots_by_k_and_groups_them():
    plan = plan_moe_layer(LAYER, K_BITS, H, INTER, codebook=CB)
    # sorted by (K_gu, K_d), ties in logical order: e1 (2,5), e4 (2,5), e5 (2.5,3), e2 (3,3), e0 (4,2), e3 (5,4)
    assert plan.inv_perm == (1, 4, 5, 2, 0, 3)
    assert [plan.perm[e] for e in plan.inv_perm] == list(range(6))
    assert plan.groups == (
        KGroup(2, 5, 0, 2),
        KGroup(2.5, 3, 2, 3),
        KGroup(3, 3, 3, 4),
        KGroup(4, 2, 4, 5),
        KGroup(5, 4, 5, 6),
    )
    tiles = (H // 16) * (INTER // 16)
    assert plan.words_w13 == tuple(tiles * width_from_k(KS[e][0]) for e in plan.inv_perm)
    assert plan.words_w2 == tuple(tiles * width_from_k(KS[e][1]) for e in plan.inv_perm)
    assert plan.off_w1[0] == 0 and plan.off_w2[0] == 0
    assert plan.total_w13 == 2 * sum(plan.words_w13) and plan.total_w2 == sum(plan.words_w2)
    assert plan.bank_shapes()["w13_svh"] == ((6, 2, INTER), torch.float16)


def test_plan_tp_cut_per_rank():
    plan = plan_moe_layer(LAYER, K_BITS, H, INTER, codebook=CB, tp_size=4, tp_rank=3)
    assert (plan.inter_start, plan.inter_local) == (768, 256)
    assert plan.full_shape(0, "w1", "trellis") == (8, 64, 64)
    assert plan.local_shape(0, "w1", "trellis") == (8, 16, 64)
    assert plan.local_shape(0, "w2", "trellis") == (16, 8, 32)
    assert plan.local_shape(0, "w2", "suh") == (256,) and plan.local_shape(0, "w2", "svh") == (H,)
    gate, down = plan.slices("w1"), plan.slices("w2")
    assert (gate.trellis_dim, gate.trellis_range, gate.suh_range, gate.svh_range) == (1, (48, 64), None, (768, 1024))
    assert (down.trellis_dim, down.trellis_range, down.suh_range, down.svh_range) == (0, (48, 64), (768, 1024), None)


@settings(max_examples=60, deadline=None)
@given(
    ks=st.lists(st.tuples(st.sampled_from(LEGAL_K), st.sampled_from(LEGAL_K)), min_size=1, max_size=12),
    hidden_blocks=st.integers(1, 4),
    blocks=st.sampled_from([1, 2, 3, 4, 6, 8, 12]),
    data=st.data(),
)
def test_plan_invariants(ks, hidden_blocks, blocks, data):
    tp = data.draw(st.sampled_from([d for d in (1, 2, 3, 4, 6, 8) if blocks % d == 0]))
    rank = data.draw(st.integers(0, tp - 1))
    hidden, inter = 128 * hidden_blocks, 128 * blocks
    plan = plan_moe_layer(LAYER, [(a, a, b) for a, b in ks], hidden, inter, codebook="mul1", tp_size=tp, tp_rank=rank)
    n = len(ks)
    assert sorted(plan.perm) == list(range(n))
    assert all(plan.inv_perm[plan.perm[e]] == e for e in range(n))
    keys = [(plan.bits[e].k_gu, plan.bits[e].k_d, e) for e in plan.inv_perm]
    assert keys == sorted(keys)
    # groups: contiguous, covering, uniform K inside, distinct K between neighbours
    assert plan.groups[0].lo == 0 and plan.groups[-1].hi == n
    for g, g2 in zip(plan.groups, plan.groups[1:], strict=False):
        assert g.hi == g2.lo and (g.k_gu, g.k_d) != (g2.k_gu, g2.k_d)
    for g in plan.groups:
        assert g.size > 0
        inside = {(plan.bits[plan.inv_perm[s]].k_gu, plan.bits[plan.inv_perm[s]].k_d) for s in range(g.lo, g.hi)}
        assert inside == {(g.k_gu, g.k_d)}
    # offsets: [w1 | w3] per slot, back to back; w2 back to back; 16-byte aligned
    assert plan.inter_local == inter // tp and plan.inter_start == rank * inter // tp
    for s in range(n):
        e = plan.inv_perm[s]
        words = 1
        for d in trellis_shape(hidden, plan.inter_local, plan.bits[e].k_gu):
            words *= d
        assert plan.words_w13[s] == words
        assert plan.off_w3[s] == plan.off_w1[s] + words
        assert plan.off_w1[s] % 8 == 0 and plan.off_w2[s] % 8 == 0
        end13 = plan.off_w1[s + 1] if s + 1 < n else plan.total_w13
        end2 = plan.off_w2[s + 1] if s + 1 < n else plan.total_w2
        assert end13 == plan.off_w3[s] + words
        assert end2 == plan.off_w2[s] + plan.words_w2[s]


@settings(max_examples=80, deadline=None)
@given(blocks=st.integers(1, 40), tp=st.integers(1, 16))
def test_tp_shard_tiles_the_dimension_or_refuses(blocks, tp):
    inter = 128 * blocks
    if blocks % tp == 0:
        ranges = [tp_shard(inter, tp, r) for r in range(tp)]
        assert ranges[0][0] == 0 and ranges[-1][1] == inter
        assert all(a % 128 == 0 and b - a == inter // tp for a, b in ranges)
        assert all(ranges[r][1] == ranges[r + 1][0] for r in range(tp - 1))
    else:
        with pytest.raises(GeometryError, match=re.escape(f"{blocks} Hadamard blocks of 128")):
            tp_shard(inter, tp, 0, LAYER)


def test_tp_cut_off_a_block_names_layer_dimension_rule_and_ways_out():
    # a Qwen3-30B-A3B-like expert: I = 768 = 6 blocks; 4 ranks would keep 192 channels each
    with pytest.raises(GeometryError) as exc:
        plan_moe_layer(LAYER, K_BITS, H, 768, codebook=CB, tp_size=4, tp_rank=1)
    msg = str(exc.value)
    parts = [LAYER, "intermediate dimension (768 channels", "192 channels", "whole 128-channel blocks"]
    parts += ["16-row tiles", "(1, 2, 3, 6)", "expert parallelism", "pipeline parallelism"]
    for part in parts:
        assert part in msg, (part, msg)
    with pytest.raises(GeometryError, match="over 8 tensor-parallel ranks"):
        shard_slices("w2", 512, 8, 0, LAYER)


def test_plan_rejects_bad_geometry_and_bitrates():
    with pytest.raises(GeometryError, match=f"{re.escape(LAYER)}: stored hidden size 200"):
        plan_moe_layer(LAYER, K_BITS, 200, INTER, codebook=CB)
    with pytest.raises(GeometryError, match="intermediate size is 1000"):
        plan_moe_layer(LAYER, K_BITS, H, 1000, codebook=CB)
    with pytest.raises(GeometryError, match=r"expert 1: w1 \(gate_proj\) has K=3 but w3 \(up_proj\) has K=4"):
        plan_moe_layer(LAYER, [(2, 2, 2), (3, 4, 2)], H, INTER, codebook=CB)
    with pytest.raises(CodecError, match=r"expert 1 w2 \(down_proj\): K=9 is not a legal"):
        plan_moe_layer(LAYER, [(2, 2, 2), (3, 3, 9)], H, INTER, codebook=CB)
    with pytest.raises(CodecError, match=r"expert 0 w1 \(gate_proj\): half-integer K=2.5 requires the mul1"):
        plan_moe_layer(LAYER, [(2.5, 2.5, 2)], H, INTER, codebook="mcg")
    with pytest.raises(ValueError, match="no experts"):
        plan_moe_layer(LAYER, [], H, INTER, codebook=CB)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        plan_moe_layer(LAYER, K_BITS, H, INTER, codebook=CB, tp_size=2, tp_rank=2)


# ------------------------------------------------------------------------------------------------ bank


def test_views_round_trip_exactly(experts, banks):
    bank = banks[1][0]
    assert bank.missing() == []
    for e, ex in enumerate(experts):
        v = bank.expert_views(e)
        for p in PROJECTIONS:
            pv = v.proj(p)
            assert pv.k == bank.plan.k_of(e, p)
            for kind in ("trellis", "suh", "svh"):
                got = getattr(pv, kind)
                assert got.dtype == ex[p][kind].dtype and torch.equal(got, ex[p][kind]), (e, p, kind)
                assert got.data_ptr() == bank.piece_view(e, p, kind).data_ptr()
    # the views are views: writing through one lands in the flat bank
    before = bank.tensors["w2_trellis"].clone()
    v = bank.expert_views(3).w2.trellis
    v[0, 0, 0] += 1
    changed = (bank.tensors["w2_trellis"] != before).nonzero().flatten().tolist()
    assert changed == [bank.plan.off_w2[bank.plan.perm[3]]]
    v[0, 0, 0] -= 1


def test_load_order_does_not_matter_and_bind_shares_storage(experts, banks):
    ref = banks[2][1]
    shuffled = build(experts, K_BITS, H, INTER, 2, 1, order=[4, 0, 5, 2, 1, 3])
    for n in BANK_TENSORS:
        assert torch.equal(shuffled.tensors[n], ref.tensors[n]), n
    other = Exl3MoeBank(ref.plan)
    other.bind({n: t.clone() for n, t in ref.tensors.items()}, loaded=True)
    assert other.missing() == []
    assert torch.equal(other.expert_views(5).w3.trellis, ref.expert_views(5).w3.trellis)
    assert other.expert_views(5).w3.trellis.data_ptr() != ref.expert_views(5).w3.trellis.data_ptr()


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tp_cut_gathers_back_to_the_unsharded_weights(experts, dense, banks, tp):
    ranks = banks[tp]
    for e, ex in enumerate(experts):
        parts = [dequantize_expert(b, e, torch.float64) for b in ranks]
        w1 = torch.cat([p[0] for p in parts], dim=1)
        w3 = torch.cat([p[1] for p in parts], dim=1)
        w2 = torch.cat([p[2] for p in parts], dim=0)
        for got, p in ((w1, "w1"), (w3, "w3"), (w2, "w2")):
            assert torch.allclose(got, dense[e][p], rtol=0, atol=1e-12), (tp, e, p)
        # and the stored pieces are exact cuts of the full tensors
        for r, b in enumerate(ranks):
            i0, i1 = b.plan.inter_start, b.plan.inter_start + b.plan.inter_local
            v = b.expert_views(e)
            assert torch.equal(v.w1.trellis, ex["w1"]["trellis"][:, i0 // 16 : i1 // 16])
            assert torch.equal(v.w3.svh, ex["w3"]["svh"][i0:i1])
            assert torch.equal(v.w3.suh, ex["w3"]["suh"])
            assert torch.equal(v.w2.trellis, ex["w2"]["trellis"][i0 // 16 : i1 // 16])
            assert torch.equal(v.w2.suh, ex["w2"]["suh"][i0:i1])
            assert torch.equal(v.w2.svh, ex["w2"]["svh"]), (tp, r, e)


def test_pointer_tables_point_at_the_views(banks):
    bank = banks[2][0]
    tables = bank.pointer_tables()
    plan = bank.plan
    for t in (tables.gate, tables.up, tables.down):
        for col in (t.trellis, t.suh, t.svh):
            assert col.dtype == torch.int64 and col.shape == (6,) and col.device == bank.device
    base13 = bank.tensors["w13_trellis"].data_ptr()
    for s in range(6):
        v = bank.slot_views(s)
        assert tables.gate.trellis[s] == v.w1.trellis.data_ptr() == base13 + 2 * plan.off_w1[s]
        assert tables.up.trellis[s] == v.w3.trellis.data_ptr() == base13 + 2 * plan.off_w3[s]
        assert tables.down.trellis[s] == v.w2.trellis.data_ptr()
        assert tables.gate.suh[s] == v.w1.suh.data_ptr() and tables.up.svh[s] == v.w3.svh.data_ptr()
        assert tables.down.suh[s] == v.w2.suh.data_ptr() and tables.down.svh[s] == v.w2.svh.data_ptr()
        assert tables.gate.trellis[s] % 16 == 0 and tables.down.trellis[s] % 16 == 0
    assert [(g.k_gu, g.k_d, g.lo, g.hi) for g in tables.groups] == [(g.k_gu, g.k_d, g.lo, g.hi) for g in plan.groups]
    for g in tables.groups:
        assert torch.equal(g.gate.trellis, tables.gate.trellis[g.lo : g.hi])
        assert torch.equal(g.down.svh, tables.down.svh[g.lo : g.hi])
        for s in range(g.lo, g.hi):
            assert bank.slot_views(s).w1.k == g.k_gu and bank.slot_views(s).w2.k == g.k_d


def test_grouped_inputs_name_the_layers_experts(banks):
    """The grouped op's inputs of a bank: permutation with its trailing -1, the 9 pointer rows in gate / up / down x
    trellis / suh / svh order, and the scalars in schema order, the layer's expert count second (a rank's bank of the
    expert split holds fewer: its kernel counts picks per expert over the layer's)."""
    from quantpack_core.moe import GROUPED_OP_SCHEMA, grouped_inputs

    bank = banks[2][0]
    tensors, static = grouped_inputs(bank, 2, 24, bank.device)
    plan, tables = bank.plan, bank.pointer_tables()
    assert tensors["perm"].tolist() == [*plan.perm, -1]
    rows = [getattr(t, f) for t in (tables.gate, tables.up, tables.down) for f in ("trellis", "suh", "svh")]
    assert torch.equal(tensors["tables"], torch.stack(rows))
    assert static == (
        2, 24, [g.lo for g in plan.groups], [g.hi for g in plan.groups], [float(g.k_gu) for g in plan.groups],
        [float(g.k_d) for g in plan.groups],
    )  # fmt: skip
    scalars = GROUPED_OP_SCHEMA.split("Tensor w2_svh, ")[1].split(", Tensor(a!) out")[0]
    names = [a.split()[1] for a in scalars.split(", ")]
    assert names == ["codebook", "layer_experts", "group_lo", "group_hi", "k_gu", "k_d"]


@settings(max_examples=12, deadline=None)
@given(
    ks=st.lists(
        st.tuples(st.sampled_from([1, 2, 3, 4, 5, 8, 1.5, 3.5]), st.sampled_from([2, 3, 4, 2.5])),
        min_size=1,
        max_size=4,
    ),
    blocks=st.sampled_from([1, 2, 4]),
    data=st.data(),
    seed=st.integers(0, 2**31),
)
def test_random_banks_round_trip(ks, blocks, data, seed):
    tp = data.draw(st.sampled_from([d for d in (1, 2, 4) if blocks % d == 0]))
    rank = data.draw(st.integers(0, tp - 1))
    inter = 128 * blocks
    ex = make_experts(ks, 128, inter, seed=seed)
    bank = build(ex, [(a, a, b) for a, b in ks], 128, inter, tp, rank)
    assert bank.missing() == []
    i0, i1 = bank.plan.inter_start, bank.plan.inter_start + bank.plan.inter_local
    for e in range(len(ks)):
        v = bank.expert_views(e)
        tiles = slice(i0 // 16, i1 // 16)
        assert torch.equal(v.w1.trellis, ex[e]["w1"]["trellis"][:, tiles])
        assert torch.equal(v.w3.trellis, ex[e]["w3"]["trellis"][:, tiles])
        assert torch.equal(v.w2.trellis, ex[e]["w2"]["trellis"][tiles])
        assert torch.equal(v.w3.svh, ex[e]["w3"]["svh"][i0:i1]) and torch.equal(v.w2.suh, ex[e]["w2"]["suh"][i0:i1])


# ------------------------------------------------------------------------------------------------ loading errors


def fresh(experts):
    bank = Exl3MoeBank(plan_moe_layer(LAYER, K_BITS, H, INTER, codebook=CB, tp_size=2, tp_rank=0))
    bank.allocate("cpu")
    return bank


def test_trellis_of_another_k_names_layer_expert_tensor_and_shapes(experts):
    bank = fresh(experts)
    wrong = experts[1]["w1"]["trellis"]  # expert 1 has K=2 (32 words); expert 0 wants K=4 (64 words)
    with pytest.raises(GeometryError) as exc:
        bank.load_piece(0, "w1", "trellis", wrong)
    msg = str(exc.value)
    assert msg.startswith(
        f"{LAYER}: expert 0 w1 (gate_proj).trellis: got (8, 64, 32) int16, expected (8, 64, 64) int16"
    )
    assert "K=4 in the plan" in msg and "the tensor holds K=2" in msg
    with pytest.raises(GeometryError, match=re.escape("expert 2 w2 (down_proj).trellis: got (64, 8, 48) int32")):
        bank.load_piece(2, "w2", "trellis", experts[2]["w2"]["trellis"].to(torch.int32))
    with pytest.raises(GeometryError, match=re.escape("got (32, 8, 48) int16, expected (64, 8, 48) int16")):
        bank.load_piece(2, "w2", "trellis", experts[2]["w2"]["trellis"][:32])  # an already-cut tensor


def test_vectors_of_wrong_shape_or_dtype_are_refused(experts):
    bank = fresh(experts)
    with pytest.raises(GeometryError, match=re.escape("expert 3 w3 (up_proj).svh: got (1024,) float32, expected")):
        bank.load_piece(3, "w3", "svh", experts[3]["w3"]["svh"].float())
    with pytest.raises(
        GeometryError, match=re.escape("expert 3 w2 (down_proj).suh: got (128,) float16, expected (1024,)")
    ):
        bank.load_piece(3, "w2", "suh", experts[3]["w2"]["svh"])
    assert (3, "w2", "suh") in bank.missing()


def test_markers_and_bad_arguments(experts):
    bank = fresh(experts)
    bank.load_piece(0, "w1", "mul1", experts[0]["w1"]["mul1"])
    assert (0, "w1", "mul1") not in bank.missing()
    with pytest.raises(CodecError, match=r"expert 0 w2 \(down_proj\).mcg: .*plan's codebook is mul1"):
        bank.load_piece(0, "w2", "mcg", torch.tensor(0, dtype=torch.int32))
    with pytest.raises(CodecError, match=r"expert 0 w2 \(down_proj\).mul1: .*0x00000007"):
        bank.load_piece(0, "w2", "mul1", torch.tensor(7, dtype=torch.int32))
    with pytest.raises(ValueError, match=re.escape("expert 6 outside 0..5")):
        bank.load_piece(6, "w1", "trellis", experts[0]["w1"]["trellis"])
    with pytest.raises(ValueError, match="unknown projection 'gate'"):
        bank.load_piece(0, "gate", "trellis", experts[0]["w1"]["trellis"])
    with pytest.raises(ValueError, match="stores no 'bias'"):
        bank.load_expert(0, {"w2": {"bias": torch.zeros(H, dtype=torch.float16)}})
    with pytest.raises(ValueError, match="allocate"):
        Exl3MoeBank(bank.plan).load_piece(0, "w1", "suh", experts[0]["w1"]["suh"])


def test_missing_lists_pieces_not_loaded(experts):
    bank = fresh(experts)
    assert len(bank.missing()) == 6 * 3 * 4  # experts x projections x (trellis, suh, svh, mul1)
    bank.load_expert(0, experts[0])
    assert bank.missing()[0] == (1, "w1", "trellis") and len(bank.missing()) == 5 * 3 * 4
    plain = Exl3MoeBank(plan_moe_layer(LAYER, [(2, 2, 3)], H, INTER, codebook="3inst"))
    assert plain.missing() == [(0, p, k) for p in PROJECTIONS for k in ("trellis", "suh", "svh")]


def test_bind_checks_shapes(banks):
    ref = banks[2][0]
    ts = dict(ref.tensors)
    ts["w13_svh"] = torch.empty(6, 2, INTER, dtype=torch.float16)  # full I where the rank keeps I/2
    with pytest.raises(GeometryError, match=re.escape("w13_svh: got (6, 2, 1024) float16, the plan needs (6, 2, 512)")):
        Exl3MoeBank(ref.plan).bind(ts)
    ts = dict(ref.tensors)
    del ts["w2_suh"]
    with pytest.raises(GeometryError, match="w2_suh not given"):
        Exl3MoeBank(ref.plan).bind(ts)


# ------------------------------------------------------------------------------------------------ reference forward


def loop_forward(experts, x, ids, wts):
    """The plain way, on the original (unsharded) tensors: each expert through the codec's reference_linear (which
    transforms the activations instead of dequantizing), then a loop over tokens and their top-k entries."""
    outs = {}
    for e in sorted(set(ids.flatten().tolist())):
        g, u, d = (Exl3Tensors.from_tensors(experts[e][p]) for p in ("w1", "w3", "w2"))
        h = torch.nn.functional.silu(reference_linear(x, g, torch.float64)) * reference_linear(x, u, torch.float64)
        outs[e] = reference_linear(h, d, torch.float64)
    y = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            y[t] += float(wts[t, j]) * outs[int(ids[t, j])][t]
    return y


def test_reference_forward_equals_per_expert_loop_and_tp_ranks_sum_to_it(experts, banks):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, H, generator=g, dtype=torch.float64)
    ids = torch.tensor([[0, 3], [5, 1], [2, 2], [4, 0], [1, 5], [3, 4]])  # token 2 lists expert 2 twice
    wts = torch.rand(6, 2, generator=g, dtype=torch.float64)
    expect = loop_forward(experts, x, ids, wts)
    got = reference_moe_forward(banks[1][0], x, ids, wts)
    assert got.dtype == torch.float64 and got.shape == (6, H)
    assert torch.allclose(got, expect, rtol=1e-10, atol=1e-12)
    assert expect.abs().max() > 1e-3  # not vacuous
    for tp in (2, 8):
        partial = sum(reference_moe_forward(b, x, ids, wts) for b in banks[tp])  # what the all-reduce would give
        assert torch.allclose(partial, expect, rtol=1e-10, atol=1e-12), tp
    y32 = reference_moe_forward(banks[1][0], x.float(), ids, wts.float(), dtype=torch.float32)
    assert (y32.double() - expect).norm() / expect.norm() < 1e-5


def test_reference_forward_argument_checks(banks):
    bank = banks[1][0]
    x = torch.zeros(2, H)
    with pytest.raises(ValueError, match="expected \\(tokens, 128\\)"):
        reference_moe_forward(bank, torch.zeros(2, 64), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1))
    with pytest.raises(ValueError, match=re.escape("0..5")):
        reference_moe_forward(bank, x, torch.tensor([[6], [0]]), torch.ones(2, 1))
    with pytest.raises(ValueError, match="must both be"):
        reference_moe_forward(bank, x, torch.zeros(2, 2, dtype=torch.int64), torch.ones(2, 1))
    with pytest.raises(ValueError, match="unknown activation"):
        reference_moe_forward(bank, x, torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1), activation="relu6")


# ------------------------------------------------------------------------------------------------ ungated experts


@pytest.fixture(scope="module")
def ungated(experts):
    """The same experts without w3: ungated ``down(relu(x W1)^2)`` (Nemotron-H's relu2 experts)."""
    return [{"w1": ex["w1"], "w2": ex["w2"]} for ex in experts]


def build_ungated(ungated, tp_size=1, tp_rank=0):
    plan = plan_moe_layer(LAYER, KS, H, INTER, codebook=CB, tp_size=tp_size, tp_rank=tp_rank, gated=False)
    bank = Exl3MoeBank(plan)
    bank.allocate("cpu")
    for e, ex in enumerate(ungated):
        bank.load_expert(e, ex)
    return bank


def test_ungated_plan_holds_w1_alone():
    gated = plan_moe_layer(LAYER, K_BITS, H, INTER, codebook=CB)
    plan = plan_moe_layer(LAYER, KS, H, INTER, codebook=CB, gated=False)
    assert not plan.gated and plan.projections == ("w1", "w2")
    assert (plan.inv_perm, plan.groups, plan.words_w13, plan.words_w2) == (
        gated.inv_perm,
        gated.groups,
        gated.words_w13,
        gated.words_w2,
    )
    assert plan.total_w13 == sum(plan.words_w13) == gated.total_w13 // 2
    assert plan.off_w3 == plan.off_w1 and plan.off_w1[1] == plan.words_w13[0]
    assert plan.bank_shapes()["w13_suh"] == ((6, 1, H), torch.float16)
    assert plan.bank_shapes()["w13_svh"] == ((6, 1, INTER), torch.float16)
    with pytest.raises(ValueError, match=r"\(K of w1, K of w2\) of an ungated expert"):
        plan_moe_layer(LAYER, K_BITS, H, INTER, codebook=CB, gated=False)
    with pytest.raises(ValueError, match=r"\(K of w1, K of w3, K of w2\)"):
        plan_moe_layer(LAYER, KS, H, INTER, codebook=CB)


def test_ungated_bank_round_trips_refuses_w3_and_points_up_at_gate(ungated, experts):
    bank = build_ungated(ungated)
    assert bank.missing() == []
    for e, ex in enumerate(ungated):
        v = bank.expert_views(e)
        assert v.w3 is None
        for p in ("w1", "w2"):
            for kind in ("trellis", "suh", "svh"):
                assert torch.equal(getattr(v.proj(p), kind), ex[p][kind]), (e, p, kind)
        with pytest.raises(ValueError, match="no w3"):
            v.proj("w3")
        assert bank.expert_tensors(e)[1] is None
    with pytest.raises(GeometryError, match=r"expert 2: an up_proj \(w3\) for a layer of ungated experts"):
        bank.load_piece(2, "w3", "trellis", experts[2]["w3"]["trellis"])
    tables = bank.pointer_tables()
    assert torch.equal(tables.up.trellis, tables.gate.trellis)  # never read for an ungated bank
    views = [bank.slot_views(s) for s in range(6)]
    assert tables.gate.trellis.tolist() == [v.w1.trellis.data_ptr() for v in views]
    assert tables.down.suh.tolist() == [v.w2.suh.data_ptr() for v in views]


def test_ungated_reference_forward_is_relu2_and_tp_ranks_sum_to_it(ungated):
    """The oracle of an ungated bank against the plain per-expert loop (each expert through the codec's
    reference_linear, ``relu(x W1)^2 W2``), and the sum of its tensor-parallel ranks' partial sums."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, H, generator=g, dtype=torch.float64)
    ids = torch.tensor([[0, 3], [5, 1], [2, 2], [4, 0], [1, 5]])
    wts = torch.rand(5, 2, generator=g, dtype=torch.float64)
    expect = torch.zeros(5, H, dtype=torch.float64)
    for t in range(5):
        for j in range(2):
            e = int(ids[t, j])
            w1, w2 = (Exl3Tensors.from_tensors(ungated[e][p]) for p in ("w1", "w2"))
            h = torch.relu(reference_linear(x[t : t + 1], w1, torch.float64)).square()
            expect[t] += float(wts[t, j]) * reference_linear(h, w2, torch.float64)[0]
    assert expect.abs().max() > 1e-3
    got = reference_moe_forward(build_ungated(ungated), x, ids, wts)
    assert torch.allclose(got, expect, rtol=1e-10, atol=1e-12)
    partial = sum(reference_moe_forward(build_ungated(ungated, 4, r), x, ids, wts) for r in range(4))
    assert torch.allclose(partial, expect, rtol=1e-10, atol=1e-12)
    # the gated SiLU form of the same w1 differs: the activation is the one the bank is for, not a default
    silu = reference_moe_forward(build_ungated(ungated), x, ids, wts, activation="silu")
    assert (silu - expect).norm() > 0.1 * expect.norm()


def test_bank_from_tensors_names_missing_and_mixed_experts(experts, ungated):
    """A layer's experts are all gated or all ungated, ids 0..E-1, each with w1 and w2: anything else is named."""
    from quantpack_core.moe import bank_from_tensors

    def codec(exs):
        return {(e, p): Exl3Tensors.from_tensors(t) for e, ex in enumerate(exs) for p, t in ex.items()}

    mixed = codec(ungated)
    mixed[(0, "w3")] = Exl3Tensors.from_tensors(experts[0]["w3"])
    with pytest.raises(GeometryError, match=r"no expert 1 w3 .*experts \[0\] have a w3 .*all gated or all ungated"):
        bank_from_tensors(LAYER, mixed)
    gap = {k: v for k, v in codec(ungated).items() if k[0] != 2}
    with pytest.raises(GeometryError, match=r"no expert 2 w1 \(gate_proj\), expert 2 w2 \(down_proj\) among experts"):
        bank_from_tensors(LAYER, gap)
    with pytest.raises(GeometryError, match="no expert tensors"):
        bank_from_tensors(LAYER, {})
    with pytest.raises(TypeError, match="gated must be True or False"):
        plan_moe_layer(LAYER, KS, H, INTER, codebook=CB, gated="no")


def test_reference_forward_refuses_a_bank_never_fully_loaded(ungated):
    plan = plan_moe_layer(LAYER, KS, H, INTER, codebook=CB, gated=False)
    bank = Exl3MoeBank(plan)
    bank.allocate("cpu")
    for e, ex in enumerate(ungated):
        pieces = {p: {k: v for k, v in t.items() if (e, p, k) != (1, "w2", "trellis")} for p, t in ex.items()}
        bank.load_expert(e, pieces)
    with pytest.raises(ValueError, match=r"never given expert 1 w2\.trellis: load every piece first"):
        reference_moe_forward(bank, torch.zeros(1, H), torch.tensor([[0]]), torch.ones(1, 1))
