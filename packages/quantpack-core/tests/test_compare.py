"""The end-to-end oracle (quantpack_core.compare.agreement): KL and top-1 against an independent float64
computation, and near-ties left out of the decided top-1 only within the given margin; the router near-tie
(quantpack_core.compare.ROUTER_NEAR_TIE) against what rounding moves a bundled MoE pack's router margins, and the
rule by which such a position leaves a mean."""

import math

import pytest
import torch

from quantpack_core.compare import ROUTER_NEAR_TIE, agreement, outside_router_ties, relative_error, router_margin


def test_kl_and_top1_match_a_direct_computation():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(3, 5, 11, generator=g)
    cand = ref + 0.1 * torch.randn(3, 5, 11, generator=g)
    a = agreement(ref, cand)
    kl, agree = 0.0, 0
    for p_row, q_row in zip(ref.reshape(-1, 11).tolist(), cand.reshape(-1, 11).tolist(), strict=True):
        zp, zq = math.log(sum(math.exp(v) for v in p_row)), math.log(sum(math.exp(v) for v in q_row))
        kl += sum(math.exp(p - zp) * ((p - zp) - (q - zq)) for p, q in zip(p_row, q_row, strict=True))
        agree += p_row.index(max(p_row)) == q_row.index(max(q_row))
    assert a.positions == 15
    assert a.kl == pytest.approx(kl / 15, rel=1e-9)
    assert a.top1 == pytest.approx(agree / 15)
    assert a.ties == 0 and a.top1_decided == a.top1


def test_the_worst_position_is_named():
    # one position far off among close ones: the mean hides it, kl_max / kl_worst name it
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(6, 9, generator=g)
    cand = ref + 1e-3 * torch.randn(6, 9, generator=g)
    cand[4] = ref[4].flip(0)
    a = agreement(ref, cand)
    p, q = torch.log_softmax(ref[4].double(), -1), torch.log_softmax(cand[4].double(), -1)
    assert a.kl_worst == 4
    assert a.kl_max == pytest.approx(float((p.exp() * (p - q)).sum()), rel=1e-12)
    assert a.kl_max > 5 * a.kl
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(cand.double(), -1)
    per = (lp.exp() * (lp - lq)).sum(-1)
    assert a.kl_median == pytest.approx(float(per.median()), rel=1e-12) and a.kl_median < a.kl


def test_a_flip_at_a_near_tie_is_left_out_of_the_decided_top1_only():
    # position 0: the reference's top two 0.01 nats apart, the candidate picks the other; position 1: 1 nat apart,
    # the candidate agrees; position 2: 0.2 nats apart, the candidate flips
    ref = torch.tensor([[2.0, 1.99, 0.0], [3.0, 2.0, 0.0], [1.2, 1.0, 0.0]])
    cand = torch.tensor([[1.99, 2.0, 0.0], [3.0, 2.0, 0.0], [1.0, 1.2, 0.0]])
    a = agreement(ref, cand, tie=0.05)
    assert a.top1 == pytest.approx(1 / 3)
    assert a.ties == 1
    assert a.top1_decided == pytest.approx(1 / 2)  # the 0.2-nat flip still counts
    wide = agreement(ref, cand, tie=0.5)
    assert wide.ties == 2 and wide.top1_decided == 1.0
    assert agreement(ref, cand).ties == 0  # no margin: every position decided


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="shape mismatch"):
        agreement(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="tie must be >= 0"):
        agreement(torch.zeros(2, 3), torch.zeros(2, 3), tie=-1.0)


def test_the_near_tie_of_a_kl_bound_is_the_spread_of_a_top2_gap_at_that_kl():
    # e2e_runner.near_tie(k) = 2 sqrt(k): logits moved by noise whose mean KL (agreement's, float64) is k move the gap
    # between two tokens by at least that much (one standard deviation; more where the distributions are peaked,
    # since the KL weighs each logit's shift by its probability), measured here over 20,000 positions
    from e2e_runner import GREEDY_TIE, near_tie

    g = torch.Generator().manual_seed(2)
    ref = 3.0 * torch.randn(20_000, 64, generator=g, dtype=torch.float64)
    noise = torch.randn(20_000, 64, generator=g, dtype=torch.float64)
    for bound in (5e-4, 3e-3):
        # scale the noise so that the candidate's mean KL is the bound
        lo, hi = 0.0, 1.0
        for _ in range(40):
            s = (lo + hi) / 2
            lo, hi = (s, hi) if agreement(ref, ref + s * noise).kl < bound else (lo, s)
        gap_shift = s * (noise[:, 0] - noise[:, 1])
        assert agreement(ref, ref + s * noise).kl == pytest.approx(bound, rel=1e-3)
        assert 2 * bound**0.5 <= float(gap_shift.std()) <= 1.5 * 2 * bound**0.5
    assert near_tie(3e-3) == pytest.approx(2 * 3e-3**0.5) and GREEDY_TIE == pytest.approx(2 * 1.5e-4**0.5)


def test_router_margin_is_the_gap_below_the_kth_score():
    scores = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.26, 0.25, 0.25, 0.24]])
    assert router_margin(scores, 2).tolist() == pytest.approx([0.15, 0.0])
    assert router_margin(scores, 1).tolist() == pytest.approx([0.2, 0.01])
    with pytest.raises(ValueError, match="top_k 4 of 4 experts"):
        router_margin(scores, 4)


def test_a_position_leaves_the_mean_only_at_a_router_near_tie_that_departed():
    # position 1: a near-tie at layer 1 that departed (0.4 nats); position 2: a near-tie that did not depart;
    # position 3: far off without a near-tie, which stays in the mean and raises it
    kl = torch.tensor([1e-5, 0.4, 2e-5, 0.3, 1e-5])
    margins = torch.tensor([[0.2, 0.3, 1e-4, 0.2, 0.1, 0.0], [0.2, 1e-3, 0.3, 0.2, 0.1, 0.0]])
    split = outside_router_ties(kl, margins, departs=5e-4)
    assert split.excluded == ({"position": 1, "margin": pytest.approx(1e-3), "kl": pytest.approx(0.4)},)
    assert split.positions == 4 and split.kept.tolist() == [True, False, True, True, True]
    assert split.kl == pytest.approx(float(kl[[0, 2, 3, 4]].mean()))
    with pytest.raises(ValueError, match="do not cover 5 positions"):
        outside_router_ties(kl, margins[:, :4], departs=5e-4)
    with pytest.raises(ValueError, match="not finite"):
        outside_router_ties(kl, margins * float("nan"), departs=5e-4)


def test_the_router_near_tie_covers_what_rounding_moves_a_bundled_pack_s_margins(fixtures_dir):
    """An all-bfloat16 and an all-float16 forward of the 4.0 bpw Qwen3-MoE pack's decoded weights move each layer's
    router margins (the float32 forward's k-th and (k+1)-th experts) by less than ROUTER_NEAR_TIE at every token
    no earlier layer routed otherwise (measured: 1.8e-3 / 8.2e-3 per layer in bfloat16, 8.4e-4 / 1.6e-3 in float16),
    and by more than a twentieth of it: the threshold is a measured one, not a wide net."""
    pytest.importorskip("transformers")
    from quantpack_core.reference import dense_transformers_model

    pack = fixtures_dir / "qwen3moe-tiny-exl3-4.0bpw-mul1"
    model = dense_transformers_model(pack)
    ids = torch.load(pack / "reference_logits.pt")["input_ids"]
    exact, top_k = router_probabilities(model, ids, torch.float32)
    moves = []
    for dtype in (torch.bfloat16, torch.float16):
        rounded, _ = router_probabilities(model, ids, dtype)
        rerouted = torch.zeros(ids.shape[1], dtype=torch.bool)
        for p, q in zip(exact, rounded, strict=True):
            pair = p.topk(top_k + 1, -1).indices[:, -2:]
            a, b = p.gather(1, pair), q.gather(1, pair)
            moves.append(float(((a[:, 0] - a[:, 1]) - (b[:, 0] - b[:, 1])).abs()[~rerouted].max()))
            rerouted |= (p.topk(top_k, -1).indices.sort(-1).values != q.topk(top_k, -1).indices.sort(-1).values).any(-1)
    assert ROUTER_NEAR_TIE / 20 < max(moves) <= ROUTER_NEAR_TIE, moves


def router_probabilities(model, ids, dtype) -> tuple[list[torch.Tensor], int]:
    """Each MoE layer's router probabilities (float64) of a forward of ``model`` in ``dtype``, and the top-k."""
    probs, top_k = [], []

    def keep(_module, _inputs, out) -> None:  # (logits, weights, indices)
        probs.append(out[0].double().softmax(-1))
        top_k.append(out[2].shape[-1])

    hooks = [layer.mlp.gate.register_forward_hook(keep) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model.to(dtype)(ids)
    finally:
        for h in hooks:
            h.remove()
        model.float()
    return probs, top_k[0]


def test_relative_error_is_the_float64_norm_ratio():
    """A float16 candidate one unit in the last place (2^-10) above a float64 reference of ones: 2^-10 exactly, however
    the candidate is laid out."""
    reference = torch.ones((64, 64), dtype=torch.float64)
    candidate = (reference + 2.0**-10).half()
    assert relative_error(candidate, reference) == 2.0**-10
    assert relative_error(candidate.T.contiguous().T, reference) == 2.0**-10
    assert relative_error(reference, reference) == 0.0
