"""Qwen3 (vLLM's qwen3.py): q_norm / k_norm always, q / k / v biased by ``attention_bias``, a gated MLP; SiLU only.
Qwen3-MoE (:mod:`.qwen3_moe`) takes its attention."""

from __future__ import annotations

from .base import ATTENTION, GATED_MLP, LAYER_NORMS, QK_NORMS, SILU_ONLY, Architecture, Layer, flag


def attention(config: dict) -> tuple[tuple[str, ...], dict[str, bool]]:
    """The Qwen3 family's attention: ``(modules, biases)``."""
    return (*ATTENTION, *QK_NORMS), dict.fromkeys(ATTENTION[:3], flag(config, "attention_bias"))


def layer(arch: str, config: dict, i: int) -> Layer:
    """The layer of qwen3.py (every layer alike)."""
    attn, bias = attention(config)
    return Layer((*attn, *GATED_MLP, *LAYER_NORMS), (), bias)


ARCHITECTURE = Architecture(("Qwen3ForCausalLM",), layer, {"Qwen3ForCausalLM": SILU_ONLY})
