"""Qwen3.5 text models (``Qwen3_5ForCausalLM``, model_type ``qwen3_5_text``) on vLLM releases that lack them.

vLLM 0.20 - 0.28 define ``Qwen3_5ForCausalLM`` in ``vllm/model_executor/models/qwen3_5.py`` (the language model
inside ``Qwen3_5ForConditionalGeneration``) but do not register the name, and its ``load_weights`` expects
``model.layers...``. Qwen3.5 checkpoints, and the EXL3 packs exllamav3 makes of them, name the text model
``model.language_model.layers...`` (and may carry ``mtp.`` and ``model.visual.`` tensors a text model does not use).
The class is also not marked hybrid there (only the multimodal wrapper is), so vLLM would size no Gated DeltaNet
state for it. This subclass loads the checkpoint through a prefix mapping and declares the hybrid state exactly as
the wrapper does, as vLLM 0.29 and newer do themselves (``Qwen3_5ForCausalLMBase``: ``hf_to_vllm_mapper``,
``IsHybrid``); the family module :mod:`quantpack_families.families.qwen3_5` registers it (and the wrapper's config
hook) only where vLLM does not know the architecture.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.model_executor.models.interfaces import IsHybrid
from vllm.model_executor.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper

from ..families.qwen3_5 import TEXT_PREFIXES


class Qwen3_5TextForCausalLM(Qwen3_5ForCausalLM, IsHybrid):
    """vLLM's Qwen3.5 text model, loading checkpoints named ``model.language_model.*`` or ``model.*``.

    The mapper is also what vLLM hands to the quantization config (``apply_vllm_mapper``), so quantized tensor
    names are mapped the same way.
    """

    hf_to_vllm_mapper = WeightsMapper(orig_to_new_prefix=TEXT_PREFIXES)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load ``(checkpoint name, tensor)`` pairs after mapping their prefixes.

        Returns:
            the vLLM parameter names loaded (as vLLM's ``AutoWeightsLoader`` reports them).
        """
        return AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config) -> tuple[torch.dtype, torch.dtype]:
        """Gated DeltaNet state dtypes (conv, recurrent), as ``Qwen3_5ForConditionalGeneration`` computes them."""
        return Qwen3_5ForConditionalGeneration.get_mamba_state_dtype_from_config(vllm_config)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config) -> tuple[tuple[int, int], tuple[int, int]]:
        """Gated DeltaNet state shapes per TP rank, as ``Qwen3_5ForConditionalGeneration`` computes them."""
        return Qwen3_5ForConditionalGeneration.get_mamba_state_shape_from_config(vllm_config)

    @classmethod
    def get_mamba_state_copy_func(cls):
        """How vLLM copies the Gated DeltaNet state between blocks (the wrapper's functions)."""
        return Qwen3_5ForConditionalGeneration.get_mamba_state_copy_func()
