"""Qwen3-Next (vLLM's qwen3_next.py): ``layer_types`` gives each layer the Gated DeltaNet (its modules, and the
block's own ``A_log`` / ``dt_bias``) or attention with q_norm / k_norm and q / k / v bias by ``qkv_bias``, the
q_proj twice as wide with ``attn_output_gate`` (default on); the MLP planned as Qwen2-MoE's (:mod:`.qwen2_moe`), at
least one MoE layer; a layer scale where ``layer_scale`` is set, which is not stated. The router, the shared
expert's gate, the DeltaNet's convolution and its block built dense; SiLU only."""

from __future__ import annotations

from collections.abc import Iterable

from ...errors import Problem
from .base import ATTENTION, LAYER_NORMS, QK_NORMS, SILU_ONLY, Architecture, Layer, Sizes, count, flag, times
from .qwen2_moe import plan_problems as qwen_moe_plan_problems
from .qwen2_moe import sparse_mlp

CLASS = "Qwen3NextForCausalLM"
#: the modules of the Gated DeltaNet block (its linear-attention layers; vLLM's QwenGatedDeltaNetAttention loads the
#: checkpoint's names)
GATED_DELTANET = tuple(f"linear_attn.{m}" for m in ("in_proj_qkvz", "in_proj_ba", "conv1d", "norm", "out_proj"))
#: the block's own tensors, each loaded by vLLM into a parameter of its own (decay and time-step bias)
OWN_TENSORS = {"linear_attn": ("A_log", "dt_bias")}
#: the layer kinds (config.json's ``layer_types``)
KINDS = ("linear_attention", "full_attention")


def qwen3_next_layer_type(config: dict, i: int) -> str | None:
    """The kind of layer ``i`` as vLLM reads it (``config.layer_types[i]``), or None where config.json gives no kind
    vLLM can build, or none every release agrees on: without ``layer_types``, vLLM 0.22 to 0.31 build their own
    config class, which makes every fourth layer full attention, and 0.32 transformers', which takes the interval
    from ``full_attention_interval`` (default 4), so only an interval of 4 (or none) is read alike. At load the plugin
    hands over vLLM's own config, which holds the list."""
    types = config.get("layer_types")
    if types is not None:
        ok = isinstance(types, list) and i < len(types) and types[i] in KINDS
        return types[i] if ok else None
    interval = config.get("full_attention_interval", 4)
    if interval != 4 or isinstance(interval, bool):
        return None
    return KINDS[0] if (i + 1) % 4 else KINDS[1]


def layer(arch: str, config: dict, i: int) -> Layer:
    """The layer of qwen3_next.py of layer ``i``'s kind; none for a kind vLLM cannot build, or with a layer scale."""
    kind = qwen3_next_layer_type(config, i)
    if kind is None or flag(config, "layer_scale"):
        return Layer()  # a layer vLLM cannot build, or one with scales held by the layer itself: not stated
    full = kind == "full_attention"
    attn = (*ATTENTION, *QK_NORMS) if full else ("linear_attn", *GATED_DELTANET)
    bias = dict.fromkeys(ATTENTION[:3], flag(config, "qkv_bias")) if full else {}
    mlp, unstated = sparse_mlp(config, i, gated=True)
    return Layer((*attn, *mlp, *LAYER_NORMS), (), bias, unstated)


def sizes(config: dict, s: Sizes) -> dict[str, dict]:
    """The q_proj with its output gate; the Gated DeltaNet's ``linear_num_key_heads`` x ``linear_key_head_dim`` keys
    and ``linear_num_value_heads`` x ``linear_value_head_dim`` values (in_proj_qkvz: two of each; in_proj_ba: two per
    value head; the norm: one value head; conv1d, ``(channels, 1, kernel)``: ``linear_conv_kernel_dim`` taps over both
    keys and the values; ``A_log`` and ``dt_bias``: one value per value head)."""
    q_parts = 1 + bool(config.get("attn_output_gate", True))
    key_dim = times(count(config, "linear_num_key_heads"), count(config, "linear_key_head_dim"))
    v_heads, v_dim = count(config, "linear_num_value_heads"), count(config, "linear_value_head_dim")
    value_dim = times(v_heads, v_dim)
    both = key_dim + value_dim if key_dim is not None and value_dim is not None else None
    channels = key_dim * 2 + value_dim if key_dim is not None and value_dim is not None else None
    own = {f"linear_attn.{name}": (v_heads,) for name in OWN_TENSORS["linear_attn"]}
    return {
        "self_attn.q_proj": {"self_attn.q_proj": (s.hidden, times(times(s.heads, s.head_dim), q_parts))},
        "linear_attn.norm": {"linear_attn.norm": (v_dim,)},
        "linear_attn.in_proj_qkvz": {"linear_attn.in_proj_qkvz": (s.hidden, times(both, 2))},
        "linear_attn.in_proj_ba": {"linear_attn.in_proj_ba": (s.hidden, times(v_heads, 2))},
        "linear_attn.out_proj": {"linear_attn.out_proj": (value_dim, s.hidden)},
        "linear_attn.conv1d": {"linear_attn.conv1d": (channels, 1, count(config, "linear_conv_kernel_dim"))},
        "linear_attn": own,
    }


def plan_problems(arch: str, config: dict, layers: Iterable[int]) -> list[Problem]:
    """The Qwen MoE plan's problems, at least one MoE layer needed."""
    return qwen_moe_plan_problems(arch, config, layers, sparse_needed=True)


def builds_mlp(config: dict) -> bool:
    """Every sparse layer builds its shared expert, whatever kind of attention the layer has."""
    return (count(config, "shared_expert_intermediate_size") or 0) > 0


ARCHITECTURE = Architecture(
    (CLASS,),
    layer,
    {CLASS: SILU_ONLY},
    dense_modules=("mlp.gate", "mlp.shared_expert_gate", "linear_attn.conv1d", "linear_attn"),
    own_tensors=OWN_TENSORS,
    sizes=sizes,
    plan_problems=plan_problems,
    builds_mlp=builds_mlp,
)
