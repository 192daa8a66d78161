"""Gemma 2 (vLLM's gemma2.py): attention biased by ``attention_bias``, a gated MLP, pre- and post-feedforward norms
beside the two layer norms, no q_norm / k_norm; the MLP takes ``gelu_pytorch_tanh`` only (vLLM: "... set
`hidden_activation` to `gelu_pytorch_tanh`"). Gemma 3 (:mod:`.gemma3`) extends it."""

from __future__ import annotations

from .base import (
    ATTENTION,
    FEEDFORWARD_NORMS,
    GATED_MLP,
    LAYER_NORMS,
    QK_NORMS,
    ActivationRule,
    Architecture,
    Layer,
    flag,
)


def layer(arch: str, config: dict, i: int, qk_norms: tuple[str, ...] = ()) -> Layer:
    """The layer of gemma2.py (every layer alike); with ``qk_norms``, Gemma 3's."""
    bias = dict.fromkeys(ATTENTION, flag(config, "attention_bias"))
    required = (*ATTENTION, *qk_norms, *GATED_MLP, *LAYER_NORMS, *FEEDFORWARD_NORMS)
    return Layer(required, () if qk_norms else QK_NORMS, bias)


ACTIVATION = ActivationRule("hidden_activation", frozenset({"gelu_pytorch_tanh"}))
ARCHITECTURE = Architecture(("Gemma2ForCausalLM",), layer, {"Gemma2ForCausalLM": ACTIVATION})
