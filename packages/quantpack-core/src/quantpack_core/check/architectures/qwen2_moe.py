"""Qwen2-MoE (vLLM's qwen2_moe.py), and the sparse-layer plan the Qwen MoE classes share (Qwen3-MoE, Qwen3-Next):
Qwen2's attention without q_norm / k_norm (:mod:`.qwen2`); a layer is sparse where ``num_experts`` > 0,
``(i + 1) % decoder_sparse_step == 0`` and ``i`` is not in ``mlp_only_layers`` (a router and an expert bank, a
shared expert where ``shared_expert_intermediate_size`` > 0, its gate in every sparse layer), else a gated MLP; the
router and the shared expert's gate built dense; SiLU only."""

from __future__ import annotations

from collections.abc import Iterable

from ...errors import Problem
from .base import GATED_MLP, LAYER_NORMS, SILU_ONLY, Architecture, Layer, count
from .qwen2 import attention as qwen2_attention

CLASS = "Qwen2MoeForCausalLM"
#: the fix of a plan vLLM cannot build
FIX = "use the config.json the pack was made with"


def qwen_moe_plan(config: dict) -> tuple[int, int, list] | None:
    """The Qwen MoE classes' expert count, sparse step and dense layers as vLLM reads them (``config.num_experts``,
    which transformers maps to ``num_local_experts``; ``decoder_sparse_step``, default 1; ``mlp_only_layers``,
    default none, null read as none as the config classes do), or None where they cannot build a model (a step below
    1: vLLM divides by it; a count that is no integer) or config.json gives no expert count (the config class's
    default then, which :func:`moe_plan_unknown` tells apart)."""
    experts = count(config, "num_local_experts", "num_experts")
    step = count(config, "decoder_sparse_step") if "decoder_sparse_step" in config else 1
    only = config.get("mlp_only_layers") if config.get("mlp_only_layers") is not None else []
    if experts is None or step is None or step < 1 or not isinstance(only, list):
        return None
    return experts, step, only


def moe_plan_unknown(config: dict) -> bool:
    """Whether config.json leaves a Qwen MoE class's expert count to its config class's default (no
    ``num_experts`` / ``num_local_experts``, or null): nothing to plan from here, and nothing wrong."""
    return config.get("num_local_experts") is None and config.get("num_experts") is None


def qwen_moe_sparse(plan: tuple[int, int, list], i: int) -> bool:
    """Whether vLLM's Qwen MoE classes make layer ``i`` an MoE layer under ``plan`` (:func:`qwen_moe_plan`)."""
    experts, step, only = plan
    return experts > 0 and (i + 1) % step == 0 and i not in only


def sparse_mlp(config: dict, i: int, gated: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(modules, unstated)`` of layer ``i``'s MLP under the config's plan: a router, the experts and the shared
    expert where the layer is sparse (its gate where ``gated``: Qwen2-MoE's and Qwen3-Next's classes build it whatever
    the shared expert's size, transformers' default size not being 0 there), the gated MLP where it is not, and
    nothing, the whole ``mlp`` unstated, where the config cannot give the plan."""
    plan = qwen_moe_plan(config)
    if plan is None:
        return (), ("mlp",)
    if not qwen_moe_sparse(plan, i):
        return GATED_MLP, ()
    mlp: tuple[str, ...] = ("mlp.gate", "mlp.experts")
    shared = count(config, "shared_expert_intermediate_size")
    shared = (1 if gated else 0) if shared is None else shared
    if shared > 0:
        mlp += tuple(f"mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
    if shared > 0 or gated:
        mlp += ("mlp.shared_expert_gate",)
    return mlp, ()


def plan_problems(arch: str, config: dict, layers: Iterable[int], sparse_needed: bool = False) -> list[Problem]:
    """The config's MoE settings where vLLM's class ``arch`` cannot plan its layers from them (integers, a step of
    at least 1, a list), and, where ``sparse_needed`` (Qwen3-MoE, Qwen3-Next), a plan with no MoE layer among
    ``layers``: vLLM stops in the worker without one."""
    plan = qwen_moe_plan(config)
    if plan is None and not moe_plan_unknown(config):
        what = (
            f"num_local_experts / num_experts {config.get('num_local_experts', config.get('num_experts'))!r}, "
            f"decoder_sparse_step {config.get('decoder_sparse_step')!r}, mlp_only_layers "
            f"{config.get('mlp_only_layers')!r}: vLLM's {arch} cannot plan its layers from them "
            "(integers, a step of at least 1, a list)"
        )
        return [Problem("", "config.json", what, FIX)]
    if plan is not None and sparse_needed and not any(qwen_moe_sparse(plan, i) for i in layers):
        what = (
            f"no layer is an MoE layer (num_local_experts / num_experts {plan[0]}, decoder_sparse_step {plan[1]}, "
            f"mlp_only_layers {plan[2]}): vLLM's {arch} stops in the worker without one"
        )
        return [Problem("", "config.json", what, FIX)]
    return []


def layer(arch: str, config: dict, i: int) -> Layer:
    """The layer of qwen2_moe.py: Qwen2's attention without q_norm / k_norm, the planned MLP."""
    attn, absent, bias = qwen2_attention(False)
    mlp, unstated = sparse_mlp(config, i, gated=True)
    return Layer((*attn, *mlp, *LAYER_NORMS), absent, bias, unstated)


ARCHITECTURE = Architecture(
    (CLASS,),
    layer,
    {CLASS: SILU_ONLY},
    dense_modules=("mlp.gate", "mlp.shared_expert_gate"),
    plan_problems=plan_problems,
)
