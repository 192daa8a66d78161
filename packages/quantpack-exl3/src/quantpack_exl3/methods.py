"""The EXL3 methods: the format-free machinery of :mod:`quantpack_core.vllm` bound to the EXL3 format
(:data:`quantpack_exl3.format.EXL3`). Embeddings (int8 rows or dense) use
:class:`quantpack_core.vllm.embedding.Int8RowsEmbeddingMethod` as they are."""

from __future__ import annotations

from quantpack_core.vllm.linear import QuantLinearMethod
from quantpack_core.vllm.moe import QuantMoEMethod

from .format import EXL3


class Exl3LinearMethod(QuantLinearMethod):
    """Per-shard EXL3 linear layers and heads (see :class:`~quantpack_core.vllm.linear.QuantLinearMethod`)."""

    format = EXL3


class Exl3MoEMethod(QuantMoEMethod):
    """EXL3 expert banks (see :class:`~quantpack_core.vllm.moe.QuantMoEMethod`)."""

    format = EXL3
