"""vLLM general-plugin entry point of quantpack-families (``vllm.general_plugins``: ``quantpack_families``).

vLLM calls :func:`register` in every process it starts, sometimes twice; it must be cheap and idempotent and import
no model code. It applies every family of the registry (:data:`quantpack_families.families.FAMILIES`) that applies
to the installed vLLM (:func:`quantpack_families.registry.apply`). Follows vLLM's ``vllm/plugins/__init__.py``.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.quantpack.families")

_registered = False


def register() -> None:
    """Apply the family fixes the installed vLLM needs, and give embeddings and heads that model files build
    without a quant config the quantpack one (:func:`quantpack_core.vllm.layers.patch_embedding_constructors`)."""
    global _registered
    if _registered:
        return
    from quantpack_core.vllm.layers import patch_embedding_constructors

    from .families import FAMILIES
    from .registry import apply

    patch_embedding_constructors()
    apply(FAMILIES)
    _registered = True
