"""Qwen3.5 (``Qwen3_5ForCausalLM`` text packs, and the multimodal model's embedding).

* vLLM 0.20 - 0.28 define ``Qwen3_5ForCausalLM`` but neither register the name nor its config hook, do not mark it
  hybrid (so no Gated DeltaNet state would be sized) and read ``model.layers.*`` while Qwen3.5 checkpoints, and the
  packs made of them, say ``model.language_model.layers.*``: the family registers
  :class:`quantpack_families.models.qwen3_5.Qwen3_5TextForCausalLM` there (vLLM 0.29+ registers its own).
* ``Qwen3_5Model`` and its MTP draft build ``embed_tokens`` without a name (announced on every version).

Source: vLLM ``vllm/model_executor/models/qwen3_5.py`` (0.25 and 0.29: ``Qwen3_5ForCausalLMBase``,
``hf_to_vllm_mapper``); docs/families.md.
"""

from __future__ import annotations

from ..registry import Architecture, Family

#: Qwen3.5 text model: checkpoint prefix -> vLLM prefix (None: not part of the text model). ``mtp.`` (the
#: multi-token-prediction head) and ``model.visual.`` (the vision tower) are not loaded by a text model.
TEXT_PREFIXES: dict[str, str | None] = {"model.language_model.": "model.", "mtp.": None, "model.visual.": None}

FAMILY = Family(
    name="qwen3_5",
    why=(
        "vLLM before 0.29 ships the text-only Qwen3.5 class without registering its name, marking it hybrid or "
        "stripping the model.language_model. prefix of Qwen3.5 checkpoints"
    ),
    vllm="<0.29",
    registers={
        "Qwen3_5ForCausalLM": Architecture(
            "quantpack_families.models.qwen3_5:Qwen3_5TextForCausalLM", "Qwen3_5ForConditionalGenerationConfig"
        )
    },
    announces={
        "vllm.model_executor.models.qwen3_5": ("Qwen3_5Model",),
        "vllm.model_executor.models.qwen3_5_mtp": ("Qwen3_5MultiTokenPredictor",),
    },
    remaps=TEXT_PREFIXES,
)
