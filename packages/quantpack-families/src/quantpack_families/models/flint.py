"""Flint (``FlintForCausalLM``) for vLLM, which has no model of it; written from the public description of its
architecture (docs/families.md, Flint; transformers 5.24's ``models/flint``, read), on vLLM's Qwen2-MoE blocks.

Per layer: RMSNorm, attention, RMSNorm, then a dense SwiGLU MLP (layers in ``mlp_only_layers``) or a MoE block
(a float32 router with sigmoid scores, top-k, renormalised when ``norm_topk_prob``, each expert's output scaled
after its down projection, plus an ungated shared SwiGLU expert). Attention: q / k / v / o projections, per-head
RMSNorm of q and k before any rotation; ``sliding_attention`` layers rotate q and k with NeoX RoPE and see the last
``sliding_window`` tokens (the current one included), ``full_attention`` layers have no positional encoding and see
everything; every head has a learned sink, a float32 logit added to the softmax's denominator only. Untied head.

Checkpoint names are Qwen2-MoE's (``model.layers.N.self_attn.{q,k,v,o}_proj``, ``q_norm``, ``k_norm``,
``sinks``; ``mlp.gate``, ``mlp.experts.E.{gate,up,down}_proj``, ``mlp.shared_expert.{gate,up,down}_proj``;
``mlp.{gate,up,down}_proj`` on dense layers): loading is vLLM's ``Qwen2MoeForCausalLM.load_weights`` (its mapper
fuses q / k / v and gate / up), so any quantization vLLM or a quantpack plugin loads for Qwen2-MoE loads here, and
a pack that stores the shared expert dense keeps it dense (the quant config gives each module the method of its
storage).

Follows vLLM 0.29-0.32 ``vllm/model_executor/models/qwen2_moe.py`` (``Qwen2MoeMLP``, ``Qwen2MoeSparseMoeBlock``,
``Qwen2MoeForCausalLM``) and ``gpt_oss.py`` (attention sinks through ``Attention(..., sinks=)``); the semantics
are checked against transformers' Flint where it exists (``tests/test_flint.py``).
"""

from typing import ClassVar

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models.qwen2_moe import Qwen2MoeForCausalLM, Qwen2MoeMLP, Qwen2MoeModel
from vllm.model_executor.utils import set_weight_attrs

from quantpack_core.vllm.compat import fused_moe_factory

from .flint_config import FULL, SLIDING, FlintConfig
from .prenorm import (
    PrenormDecoderLayer,
    PrenormForCausalLM,
    PrenormModel,
    QkvAttention,
    layer_index,
)


def sinks_dtype() -> torch.dtype:
    """float32, as Flint keeps its sinks; bfloat16 on vLLM's CPU attention before 0.31, whose kernel takes sinks in
    bfloat16 only (0.31 added float32: ``cpu_attn.py``)."""
    from packaging.version import Version
    from vllm import __version__
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and Version(Version(__version__).base_version) < Version("0.31"):
        return torch.bfloat16
    return torch.float32


class FlintAttention(QkvAttention):
    """Flint's attention of one layer (see the module); heads split over TP ranks, the sinks with them.

    Raises:
        ValueError: as :func:`~.prenorm.check_attention_config`.
    """

    def __init__(self, config: FlintConfig, cache_config=None, quant_config=None, prefix: str = ""):
        super().__init__(config, (SLIDING, FULL), "o_proj", quant_config, prefix)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        sliding = self.kind == SLIDING
        self.rotary_emb = (
            get_rope(
                self.head_dim,
                max_position=config.max_position_embeddings,
                is_neox_style=True,
                rope_parameters=dict(config.rope_parameters),
            )
            if sliding
            else None
        )
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=sinks_dtype()), requires_grad=False)
        set_weight_attrs(self.sinks, {"weight_loader": self.load_sinks})
        # both count the current token (transformers' mask: key visible while query - key < window)
        self.attn = self.attention(config, cache_config, quant_config, prefix, sliding, sinks=self.sinks)

    def load_sinks(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        """This rank's heads of the checkpoint's ``(heads,)`` sinks, in the parameter's dtype (:func:`sinks_dtype`).

        Raises:
            ValueError: a sinks tensor of another length than the configured heads.
        """
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        if loaded.shape != (param.shape[0] * tp,):
            raise ValueError(f"layer {self.layer}: sinks of shape {tuple(loaded.shape)}, want ({param.shape[0] * tp},)")
        with torch.no_grad():
            param.copy_(loaded.narrow(0, rank * param.shape[0], param.shape[0]).to(param.dtype))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split_qkv(hidden_states)
        q = self.q_norm(q.view(*q.shape[:-1], self.num_heads, self.head_dim)).view(q.shape)
        k = self.k_norm(k.view(*k.shape[:-1], self.num_kv_heads, self.head_dim)).view(k.shape)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn(q, k, v))
        return out


def sigmoid_topk(
    hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flint's routing: the ``topk`` largest sigmoid scores of the router logits ``(tokens, experts)``, divided by
    their sum when ``renormalize``; float32 weights and int32 expert ids, ``(tokens, topk)`` each (vLLM's
    ``custom_routing_function`` contract, e.g. ``llama4.py``)."""
    weights, ids = torch.topk(gating_output.float().sigmoid(), topk, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(torch.float32).contiguous(), ids.to(torch.int32).contiguous()


class FlintSparseMoeBlock(nn.Module):
    """Routed experts with a float32 sigmoid router (top-k, renormalised when ``norm_topk_prob``) and an ungated
    shared expert, whose output vLLM's MoE layer adds to the routed ones (Qwen2-MoE's block gates it; Flint does
    not)."""

    def __init__(self, config: FlintConfig, quant_config=None, prefix: str = ""):
        super().__init__()
        if get_tensor_model_parallel_world_size() > config.num_experts:
            raise ValueError(f"{prefix}: more TP ranks than the {config.num_experts} experts")
        self.gate = ReplicatedLinear(
            config.hidden_size,
            config.num_experts,
            bias=False,
            quant_config=None,
            params_dtype=torch.float32,
            prefix=f"{prefix}.gate",
        )
        self.shared_expert = None
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = Qwen2MoeMLP(
                config.hidden_size,
                config.shared_expert_intermediate_size,
                config.hidden_act,
                quant_config=quant_config,
                reduce_results=False,
                prefix=f"{prefix}.shared_expert",
            )
        self.experts = fused_moe_factory()(
            shared_experts=self.shared_expert,
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            renormalize=config.norm_topk_prob,
            # vLLM's CPU router has no plain sigmoid top-k; a routing function runs the same on every platform
            custom_routing_function=sigmoid_topk,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, shape[-1])
        router_logits, _ = self.gate(hidden_states.float())
        return self.experts(hidden_states=hidden_states, router_logits=router_logits).view(shape)


class FlintDecoderLayer(PrenormDecoderLayer):
    """One layer: attention, then the dense MLP or the MoE block (:class:`~.prenorm.PrenormDecoderLayer`)."""

    def __init__(self, config: FlintConfig, cache_config=None, quant_config=None, prefix: str = ""):
        super().__init__(config)
        index = layer_index(prefix)
        self.self_attn = FlintAttention(config, cache_config, quant_config, prefix=f"{prefix}.self_attn")
        sparse = index not in config.mlp_only_layers and config.num_experts > 0
        sparse = sparse and (index + 1) % config.decoder_sparse_step == 0
        if sparse:
            self.mlp = FlintSparseMoeBlock(config, quant_config, prefix=f"{prefix}.mlp")
        else:
            self.mlp = Qwen2MoeMLP(
                config.hidden_size,
                config.intermediate_size,
                config.hidden_act,
                quant_config=quant_config,
                prefix=f"{prefix}.mlp",
            )


@support_torch_compile
class FlintModel(PrenormModel):
    """Embedding, Flint's layers, final norm."""

    layer_cls = FlintDecoderLayer

    # vLLM 0.22 (and older): Qwen2-MoE's model, not its layers, maps the checkpoint's q / k / v, gate / up and expert
    # names onto the fused parameters (its ``Qwen2MoeModel.load_weights``); Flint's names are Qwen2-MoE's, so it
    # takes that loader where vLLM has one. From 0.25 vLLM's ``AutoWeightsLoader`` and the layers do it
    if "load_weights" in vars(Qwen2MoeModel):
        load_weights = Qwen2MoeModel.load_weights
        get_expert_mapping = Qwen2MoeModel.get_expert_mapping


class FlintForCausalLM(PrenormForCausalLM, Qwen2MoeForCausalLM):
    """Flint with an untied head (:class:`~.prenorm.PrenormForCausalLM`); loading is vLLM's Qwen2-MoE one (its
    ``load_weights`` and mapper, see the module)."""

    model_cls = FlintModel
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
