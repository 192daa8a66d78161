"""Llama (vLLM's llama.py): attention, a gated MLP and two norms per layer; q / k / v / o biased by
``attention_bias`` (or ``bias``), ``qkv_bias`` over it for q / k / v, the MLP by ``mlp_bias``; SiLU only."""

from __future__ import annotations

from .base import (
    ATTENTION,
    GATED_MLP,
    LAYER_NORMS,
    LOGIT_SCALE,
    QK_NORMS,
    SILU_ONLY,
    SLIDING_LAYERS,
    SLIDING_WINDOW,
    Architecture,
    Layer,
    flag,
)


def layer(arch: str, config: dict, i: int) -> Layer:
    """The layer of llama.py (every layer alike); Mistral's and Ministral 3's extend it (:mod:`.mistral`)."""
    attn = flag(config, "attention_bias", "bias")
    qkv = flag(config, "qkv_bias") if "qkv_bias" in config else attn
    bias = {**dict.fromkeys(ATTENTION[:3], qkv), ATTENTION[3]: attn}
    bias.update(dict.fromkeys(GATED_MLP, flag(config, "mlp_bias")))
    return Layer((*ATTENTION, *GATED_MLP, *LAYER_NORMS), QK_NORMS, bias)


#: transformers' Llama has neither a logit scale nor a sliding window; vLLM's llama.py reads both
UNVERIFIED = (LOGIT_SCALE, SLIDING_WINDOW, SLIDING_LAYERS)
ARCHITECTURE = Architecture(("LlamaForCausalLM",), layer, {"LlamaForCausalLM": SILU_ONLY}, unverified=UNVERIFIED)
