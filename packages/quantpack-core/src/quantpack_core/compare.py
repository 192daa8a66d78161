"""How close two models' next-token distributions are: the oracles of every end-to-end test.

Logits are compared by KL divergence and top-1 agreement on fixed token ids, never by rendered text
(docs/design.md, "Oracles"). A mixture-of-experts model adds one more way for two correct forwards to differ: where
a token's k-th and (k+1)-th router scores nearly tie, either may win under rounding, and that token's logits then
differ by whole experts. :data:`ROUTER_NEAR_TIE` is the one definition of such a token, and
:func:`outside_router_ties` the one rule by which a position may leave a mean for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Agreement:
    """Agreement of a candidate's logits with a reference.

    Attributes:
        kl: mean over positions of KL(reference || candidate), nats per token.
        top1: fraction of positions whose argmax agrees.
        positions: how many positions were compared.
        ties: positions whose reference top-2 log-probabilities lie within the ``tie`` given to :func:`agreement`
            (0 with the default, unless two are exactly equal).
        top1_decided: top-1 agreement over the other positions (1.0 when there are none): an argmax flip at a
            near-tie says nothing about the candidate when the tie is within its precision's noise.
        kl_max: the largest KL of one position, nats (0.0 with no positions): beside ``kl``, whether a mean above
            a bound is one broken position or noise spread over all.
        kl_worst: that position's index in the flattened positions (-1 with none).
        kl_median: the median KL over positions, nats (0.0 with none): the typical position, which one outlier
            does not move.
    """

    kl: float
    top1: float
    positions: int
    ties: int = 0
    top1_decided: float = 1.0
    kl_max: float = 0.0
    kl_worst: int = -1
    kl_median: float = 0.0

    def __str__(self) -> str:
        return f"KL {self.kl:.3g} nats/token, top-1 {100 * self.top1:.2f}% over {self.positions} positions"


def agreement(reference: torch.Tensor, candidate: torch.Tensor, tie: float = 0.0) -> Agreement:
    """Compare two logit (or log-probability) tensors of the same shape ``(..., vocab)``.

    Both are renormalised with log_softmax in float64, so full logits and full log-probabilities compare alike.
    ``tie`` (nats, >= 0): a position whose reference top-2 log-probabilities differ by at most this counts as a tie
    (:attr:`Agreement.ties`) and is left out of :attr:`Agreement.top1_decided`.

    Raises:
        ValueError: on a shape mismatch or a negative ``tie``.
    """
    if reference.shape != candidate.shape:
        raise ValueError(f"shape mismatch: reference {tuple(reference.shape)}, candidate {tuple(candidate.shape)}")
    if tie < 0:
        raise ValueError(f"tie must be >= 0 nats, got {tie}")
    lp = torch.log_softmax(reference.double().reshape(-1, reference.shape[-1]), -1)
    lq = torch.log_softmax(candidate.double().reshape(-1, candidate.shape[-1]), -1)
    kl = kl_per_position(lp, lq)
    top1 = (lp.argmax(-1) == lq.argmax(-1)).double()
    if lp.shape[-1] > 1:
        top2 = lp.topk(2, -1).values
        decided = (top2[:, 0] - top2[:, 1]) > tie
    else:
        decided = torch.ones_like(top1, dtype=torch.bool)
    ties = int((~decided).sum())
    top1_decided = float(top1[decided].mean()) if bool(decided.any()) else 1.0
    worst = int(kl.argmax()) if kl.numel() else -1
    kl_max = float(kl[worst]) if kl.numel() else 0.0
    median = float(kl.median()) if kl.numel() else 0.0
    return Agreement(float(kl.mean()), float(top1.mean()), int(kl.numel()), ties, top1_decided, kl_max, worst, median)


def kl_per_position(reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """KL(reference || candidate) of each position, nats, float64: both ``(..., vocab)`` logits or log-probabilities
    of the same shape, renormalised with log_softmax; the result has their shape without the vocabulary.

    Raises:
        ValueError: on a shape mismatch.
    """
    if reference.shape != candidate.shape:
        raise ValueError(f"shape mismatch: reference {tuple(reference.shape)}, candidate {tuple(candidate.shape)}")
    lp, lq = torch.log_softmax(reference.double(), -1), torch.log_softmax(candidate.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


#: a token is a router near-tie where, at some MoE layer of the reference forward, its k-th and (k+1)-th router
#: scores (the values the router ranks: softmax probabilities for Qwen3-MoE / Qwen3-Next, sigmoid scores plus the
#: correction bias for Nemotron-H) lie closer than this. It is the largest move of such a margin measured for a
#: forward the tests accept, at tokens whose routing no earlier layer changed: an all-bfloat16 forward of the tiny
#: Nemotron-3.5-Super language tower moves its two MoE layers' margins by up to 1.0e-2 and 1.5e-2
#: (``nemotron_vl_pack.router_near_ties``); all-bfloat16 transformers forwards of the bundled Qwen3-MoE and Qwen3-Next
#: packs by up to 2.8e-3 (layer 0) and 8.2e-3 (layer 1), all-float16 ones by up to 9.1e-4 and 4.5e-3
#: (test_compare.py measures the 4.0 bpw Qwen3-MoE pack's). The routes float16 forwards were seen to flip lay at
#: margins of 6.7e-5 (the mixed-K pack compiled on the GPU) and 8.3e-5 (the 3.0 bpw pack in exllamav3's forward).
ROUTER_NEAR_TIE = 1.5e-2


def router_margin(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Per token, how far the ``top_k``-th router score lies above the next one: ``scores`` ``(T, experts)`` (one MoE
    layer) -> ``(T,)`` float64.

    Raises:
        ValueError: ``top_k`` not below the number of experts (no (k+1)-th score).
    """
    if not 0 < top_k < scores.shape[-1]:
        raise ValueError(f"top_k {top_k} of {scores.shape[-1]} experts: a margin needs a (k+1)-th score")
    top = scores.double().topk(top_k + 1, dim=-1).values
    return top[..., -2] - top[..., -1]


@dataclass(frozen=True)
class RouterSplit:
    """A mean KL with the router near-ties that departed left out (:func:`outside_router_ties`).

    Attributes:
        kl: mean KL over the positions kept, nats per token.
        positions: how many positions were kept.
        excluded: per position left out, ``{"position", "margin", "kl"}``: its smallest router margin over the
            layers (below :data:`ROUTER_NEAR_TIE`) and its KL (above the ``departs`` given).
        kept: bool ``(T,)``, the positions kept (for other per-position figures over the same ones, e.g. top-1).
    """

    kl: float
    positions: int
    excluded: tuple[dict, ...]
    kept: torch.Tensor = field(repr=False, compare=False)  # figures print the split: its positions, not the mask


def outside_router_ties(kl: torch.Tensor, margins: torch.Tensor, departs: float) -> RouterSplit:
    """The mean of per-position KL ``kl`` ``(T,)`` over every position but the router near-ties that departed: a
    position leaves the mean only where its smallest margin over the MoE layers (``margins`` ``(layers, T')``,
    :func:`router_margin` of the reference forward's scores, ``T' >= T``: row t of ``kl`` follows token t) is below
    :data:`ROUTER_NEAR_TIE` *and* its KL exceeds ``departs`` (the job's mean bound: a token that took the other
    expert lies tenths of a nat off; one that did not stays in the mean, however close its tie).

    Raises:
        ValueError: margins for fewer tokens than ``kl`` has positions, or a margin that is not finite (a broken
            reference would set positions apart unseen).
    """
    if margins.dim() != 2 or margins.shape[1] < kl.shape[0]:
        raise ValueError(f"router margins {tuple(margins.shape)} do not cover {kl.shape[0]} positions")
    if not bool(margins.isfinite().all()):
        raise ValueError("router margins of the reference are not finite: its forward is broken")
    low = margins[:, : kl.shape[0]].double().amin(0)
    out = (low < ROUTER_NEAR_TIE) & (kl.double() > departs)
    excluded = tuple(
        {"position": t, "margin": float(low[t]), "kl": float(kl[t])} for t in out.nonzero().flatten().tolist()
    )
    kept = kl.double()[~out]
    return RouterSplit(float(kept.mean()) if kept.numel() else 0.0, int(kept.numel()), excluded, ~out)


def mean_nll(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    """Mean next-token negative log-likelihood, nats per token.

    Args:
        logits: ``(batch, seq, vocab)``; position t predicts token t+1.
        tokens: ``(batch, seq)`` int64.
    """
    lp = torch.log_softmax(logits[:, :-1].double(), -1)
    return float(-lp.gather(-1, tokens[:, 1:, None]).mean())


def relative_error(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    """``||candidate - reference|| / ||reference||`` (Frobenius norms), computed in float64 on the reference's device:
    the measure of every kernel test against its float64 (or exllamav3's) reference."""
    reference = reference.detach().double()
    return float((candidate.detach().to(reference.device, torch.float64) - reference).norm() / reference.norm())
