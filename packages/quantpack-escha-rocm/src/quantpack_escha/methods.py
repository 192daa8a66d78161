"""The escha linear method: the format-free per-shard machinery of :mod:`quantpack_core.vllm.linear` bound to the
escha format, with escha's two rules on top: a shard's K must be the one ``layer_meta`` gives its module, and the
layer's bias (when vLLM's model has one) is never added (the format's published results were made without biases;
docs/escha-format.md)."""

from __future__ import annotations

import torch

from quantpack_core.errors import LayerLoadError
from quantpack_core.vllm.linear import QuantLinearMethod

from .format import ESCHA


class EschaLinearMethod(QuantLinearMethod):
    """Per-shard escha linear layers (see :class:`~quantpack_core.vllm.linear.QuantLinearMethod`)."""

    format = ESCHA

    def _parse(self, captured, plan):
        """The shard's tensors, checked against ``layer_meta``.

        Raises:
            LayerLoadError: the code's width says another K than ``layer_meta`` for this module.
        """
        shard = super()._parse(captured, plan)
        want = self.config.meta_k(plan.label)
        if want is not None and want != shard.k_bits:
            raise LayerLoadError(
                f"{self.where(plan)}: .escha_code {list(shard.code.shape)} holds K={shard.k_bits} "
                f"(16*K words per tile), layer_meta says K={want} - the pack's config.json does not match its "
                "tensors; re-download or re-convert the pack"
            )
        return shard

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output; ``bias`` is deliberately not added (see the module)."""
        return super().apply(layer, x, None)
