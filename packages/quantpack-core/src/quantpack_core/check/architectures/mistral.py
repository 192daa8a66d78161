"""Mistral and Ministral 3 (vLLM's mistral.py, which builds both): Llama's layer (:mod:`.llama`), but where
``ada_rms_norm_t_cond`` gives the layer a time-conditioned norm's modules (Voxtral's), which are not stated; SiLU
only."""

from __future__ import annotations

from .base import LOGIT_SCALE, SILU_ONLY, Architecture, Layer, flag
from .llama import layer as llama_layer

CLASSES = ("MistralForCausalLM", "Ministral3ForCausalLM")


def layer(arch: str, config: dict, i: int) -> Layer:
    """Llama's layer, none with ``ada_rms_norm_t_cond``."""
    if flag(config, "ada_rms_norm_t_cond"):
        return Layer()  # a time-conditioned norm's modules in the layer (Voxtral's): not stated
    return llama_layer(arch, config, i)


#: vLLM's MistralForCausalLM is its LlamaForCausalLM (logit_scale read); transformers' Mistral and Ministral 3 have a
#: sliding window of their own, but no logit scale
ARCHITECTURE = Architecture(CLASSES, layer, dict.fromkeys(CLASSES, SILU_ONLY), unverified=(LOGIT_SCALE,))
