"""Qwen3-MoE (vLLM's qwen3_moe.py): Qwen3's attention (:mod:`.qwen3`), the Qwen MoE plan (:mod:`.qwen2_moe`) with a
shared expert only where ``shared_expert_intermediate_size`` > 0, at least one MoE layer; the router built with the
quantization config, the shared expert's gate dense; SiLU only."""

from __future__ import annotations

from collections.abc import Iterable

from ...errors import Problem
from .base import LAYER_NORMS, SILU_ONLY, Architecture, Layer
from .qwen2_moe import plan_problems as qwen_moe_plan_problems
from .qwen2_moe import sparse_mlp
from .qwen3 import attention as qwen3_attention

CLASS = "Qwen3MoeForCausalLM"


def layer(arch: str, config: dict, i: int) -> Layer:
    """The layer of qwen3_moe.py: Qwen3's attention, the planned MLP."""
    attn, bias = qwen3_attention(config)
    mlp, unstated = sparse_mlp(config, i, gated=False)
    return Layer((*attn, *mlp, *LAYER_NORMS), (), bias, unstated)


def plan_problems(arch: str, config: dict, layers: Iterable[int]) -> list[Problem]:
    """The Qwen MoE plan's problems, at least one MoE layer needed."""
    return qwen_moe_plan_problems(arch, config, layers, sparse_needed=True)


ARCHITECTURE = Architecture(
    (CLASS,), layer, {CLASS: SILU_ONLY}, dense_modules=("mlp.shared_expert_gate",), plan_problems=plan_problems
)
