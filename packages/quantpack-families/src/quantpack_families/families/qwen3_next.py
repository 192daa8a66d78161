"""Qwen3-Next: ``Qwen3NextModel`` and its MTP draft build ``embed_tokens`` without a name or quant config, so the
family announces the name (every vLLM version). Quantpack packs need nothing more: quantpack-core's constructor wrap
hands their config to the embedding and head these model files build without one.

Source: vLLM ``vllm/model_executor/models/qwen3_next.py`` / ``qwen3_next_mtp.py``; docs/families.md.
"""

from __future__ import annotations

from ..registry import Family

FAMILY = Family(
    name="qwen3_next",
    why="the model file builds embed_tokens without a name, which compressed-tensors embeddings need",
    announces={
        "vllm.model_executor.models.qwen3_next": ("Qwen3NextModel",),
        "vllm.model_executor.models.qwen3_next_mtp": ("Qwen3NextMultiTokenPredictor",),
    },
)
