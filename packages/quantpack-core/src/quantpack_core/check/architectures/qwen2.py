"""Qwen2 (vLLM's qwen2.py): q / k / v always biased, q_norm / k_norm where ``qk_norm`` is set, a gated MLP; SiLU
only. Qwen2-MoE (:mod:`.qwen2_moe`) takes its attention."""

from __future__ import annotations

from .base import ATTENTION, GATED_MLP, LAYER_NORMS, QK_NORMS, SILU_ONLY, Architecture, Layer, flag


def attention(qk_norm: bool) -> tuple[tuple[str, ...], tuple[str, ...], dict[str, bool]]:
    """The Qwen2 family's attention: ``(modules, absent modules, biases)``, with q_norm / k_norm where ``qk_norm``."""
    norms = QK_NORMS if qk_norm else ()
    return (*ATTENTION, *norms), () if norms else QK_NORMS, dict.fromkeys(ATTENTION[:3], True)


def layer(arch: str, config: dict, i: int) -> Layer:
    """The layer of qwen2.py (every layer alike)."""
    attn, absent, bias = attention(flag(config, "qk_norm"))
    return Layer((*attn, *GATED_MLP, *LAYER_NORMS), absent, bias)


ARCHITECTURE = Architecture(("Qwen2ForCausalLM",), layer, {"Qwen2ForCausalLM": SILU_ONLY})
