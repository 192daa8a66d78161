"""How close two models' next-token distributions are: the oracles of every end-to-end test.

Logits are compared by KL divergence and top-1 agreement on fixed token ids, never by rendered text
(docs/design.md, "Oracles").
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """

    kl: float
    top1: float
    positions: int
    ties: int = 0
    top1_decided: float = 1.0
    kl_max: float = 0.0
    kl_worst: int = -1

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
    kl = (lp.exp() * (lp - lq)).sum(-1)
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
    return Agreement(float(kl.mean()), float(top1.mean()), int(kl.numel()), ties, top1_decided, kl_max, worst)


def mean_nll(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    """Mean next-token negative log-likelihood, nats per token.

    Args:
        logits: ``(batch, seq, vocab)``; position t predicts token t+1.
        tokens: ``(batch, seq)`` int64.
    """
    lp = torch.log_softmax(logits[:, :-1].double(), -1)
    return float(-lp.gather(-1, tokens[:, 1:, None]).mean())
