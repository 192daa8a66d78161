"""Gemma 3 (vLLM's gemma3.py): Gemma 2's layer (:mod:`.gemma2`) with q_norm / k_norm; the MLP takes the activations
of ``get_act_and_mul_fn``'s registry, compared lowercased (vLLM: "Activation function ... is not supported")."""

from __future__ import annotations

from .base import QK_NORMS, ActivationRule, Architecture, Layer
from .gemma2 import layer as gemma2_layer


def layer(arch: str, config: dict, i: int) -> Layer:
    """Gemma 2's layer with q_norm / k_norm (every layer alike)."""
    return gemma2_layer(arch, config, i, QK_NORMS)


ACTIVATION = ActivationRule(
    "hidden_activation", frozenset({"gelu", "gelu_pytorch_tanh", "silu", "swish", "geglu", "swigluoai"}), True
)
ARCHITECTURE = Architecture(("Gemma3ForCausalLM",), layer, {"Gemma3ForCausalLM": ACTIVATION})
