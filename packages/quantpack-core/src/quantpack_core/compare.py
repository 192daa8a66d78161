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
    """

    kl: float
    top1: float
    positions: int

    def __str__(self) -> str:
        return f"KL {self.kl:.3g} nats/token, top-1 {100 * self.top1:.2f}% over {self.positions} positions"


def agreement(reference: torch.Tensor, candidate: torch.Tensor) -> Agreement:
    """Compare two logit (or log-probability) tensors of the same shape ``(..., vocab)``.

    Both are renormalised with log_softmax in float64, so full logits and full log-probabilities compare alike.

    Raises:
        ValueError: on a shape mismatch.
    """
    if reference.shape != candidate.shape:
        raise ValueError(f"shape mismatch: reference {tuple(reference.shape)}, candidate {tuple(candidate.shape)}")
    lp = torch.log_softmax(reference.double().reshape(-1, reference.shape[-1]), -1)
    lq = torch.log_softmax(candidate.double().reshape(-1, candidate.shape[-1]), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    top1 = (lp.argmax(-1) == lq.argmax(-1)).double()
    return Agreement(float(kl.mean()), float(top1.mean()), int(kl.numel()))


def mean_nll(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    """Mean next-token negative log-likelihood, nats per token.

    Args:
        logits: ``(batch, seq, vocab)``; position t predicts token t+1.
        tokens: ``(batch, seq)`` int64.
    """
    lp = torch.log_softmax(logits[:, :-1].double(), -1)
    return float(-lp.gather(-1, tokens[:, 1:, None]).mean())
