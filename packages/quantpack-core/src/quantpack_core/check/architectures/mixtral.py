"""Mixtral (vLLM's mixtral.py): attention without bias, a router and an expert bank (``w1`` / ``w3`` / ``w2``, each
expert ``intermediate_size`` wide) in ``block_sparse_moe``; the router built dense; the experts take SiLU whatever
the config says (no activation rule)."""

from __future__ import annotations

from .base import ATTENTION, LAYER_NORMS, QK_NORMS, Architecture, Layer, Sizes, bank_sizes

ROUTER, BANK = "block_sparse_moe.gate", "block_sparse_moe.experts"


def layer(arch: str, config: dict, i: int) -> Layer:
    """The layer of mixtral.py (every layer alike)."""
    return Layer((*ATTENTION, ROUTER, BANK, *LAYER_NORMS), QK_NORMS, {})


def sizes(config: dict, s: Sizes) -> dict[str, dict]:
    """The router over ``num_local_experts`` experts; each expert of the bank ``intermediate_size`` wide."""
    return {
        ROUTER: {ROUTER: (s.hidden, s.experts)},
        BANK: bank_sizes(BANK, ("w1", "w3", "w2"), s, s.intermediate),
    }


ARCHITECTURE = Architecture(("MixtralForCausalLM",), layer, dense_modules=(ROUTER,), sizes=sizes)
