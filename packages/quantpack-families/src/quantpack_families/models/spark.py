"""Spark-X2.5 (``Spark2_5ForCausalLM``) for vLLM, which has no model of it; written from the public description of
the architecture (docs/families.md, Spark). It loads both the published bf16 layout (``model.embedding``, a fused
``q_k_v_proj``, tied head) and the layout exllamav3 writes (``model.embed_tokens``, split ``q_proj`` / ``k_proj`` /
``v_proj``, ``g_proj`` kept fp16, ``lm_head`` stored although the config ties it: the stored head is served,
never re-tied - quantpack-core's config unties a pack that stores its head).

Per layer: RMSNorm, attention, RMSNorm, GELU-gated MLP (``gelu(gate) * up``, exact GELU). Attention: q / k / v,
RoPE by layer type (``rope_parameters[layer_type]``: NeoX rotation of the first ``head_dim * partial_rotary_factor``
dimensions; full layers θ 5e6 and a quarter of each head, sliding layers θ 1e4 and all of it), the last
``sliding_window`` tokens on sliding layers, then each head's output scaled by ``act(g_proj(x))`` with ``act`` the
config's ``gate_attn_act_mode`` (sigmoid or SiLU; one public engine hard-coded sigmoid), then ``out_proj``.

Follows vLLM 0.29-0.32's layer and loader conventions (``qwen2_moe.py``: ``AutoWeightsLoader`` with a
``WeightsMapper``).
"""

from collections.abc import Iterable
from itertools import islice
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import GeluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.interfaces import SupportsPP
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    WeightsMapper,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)
from vllm.sequence import IntermediateTensors

from .flint import check_attention_config, layer_index
from .spark_config import FULL, SLIDING, Spark2_5Config

GATE_ACTS = {"sigmoid": torch.sigmoid, "silu": F.silu}


class Spark2_5Attention(nn.Module):
    """Spark's attention of one layer (see the module).

    Raises:
        ValueError: a ``gate_attn_act_mode`` other than sigmoid / silu, a layer type without rope parameters, or
            as :func:`~.flint.check_attention_config`.
    """

    def __init__(self, config: Spark2_5Config, cache_config=None, quant_config=None, prefix: str = ""):
        super().__init__()
        check_attention_config(config, (SLIDING, FULL))
        tp = get_tensor_model_parallel_world_size()
        kind = config.layer_types[layer_index(prefix)]
        if kind not in config.rope_parameters:
            raise ValueError(f"{prefix}: rope_parameters has no entry for layer type {kind!r}")
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = max(1, config.num_key_value_heads // tp)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.gate_act = None
        if config.headwise_attn_output_gate:
            mode = getattr(config, "gate_attn_act_mode", "sigmoid")
            if mode not in GATE_ACTS:
                raise ValueError(f"{prefix}: gate_attn_act_mode {mode!r}; this model knows {sorted(GATE_ACTS)}")
            self.gate_act = GATE_ACTS[mode]
            # one output per head: too narrow for a quantized layer (packs keep it fp16)
            self.g_proj = ColumnParallelLinear(
                config.hidden_size, config.num_attention_heads, bias=False, quant_config=None, prefix=f"{prefix}.g_proj"
            )
        self.out_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.out_proj",
        )
        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=config.max_position_embeddings,
            is_neox_style=True,
            rope_parameters=dict(config.rope_parameters[kind]),
        )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            cache_config=cache_config,
            quant_config=quant_config,
            per_layer_sliding_window=config.sliding_window if kind == SLIDING else None,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v)
        if self.gate_act is not None:
            g, _ = self.g_proj(hidden_states)
            g = self.gate_act(g.float()).to(out.dtype)
            out = (out.view(*out.shape[:-1], self.num_heads, self.head_dim) * g.unsqueeze(-1)).view(out.shape)
        out, _ = self.out_proj(out)
        return out


class Spark2_5MLP(nn.Module):
    """``down(gelu(gate(x)) * up(x))``, exact GELU."""

    def __init__(self, config: Spark2_5Config, quant_config=None, prefix: str = ""):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [config.intermediate_size] * 2,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.act = GeluAndMul()
        self.down_proj = RowParallelLinear(
            config.intermediate_size,
            config.hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.down_proj",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(self.act(h))
        return out


class Spark2_5DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, residuals fused into vLLM's RMSNorm."""

    def __init__(self, config: Spark2_5Config, cache_config=None, quant_config=None, prefix: str = ""):
        super().__init__()
        self.self_attn = Spark2_5Attention(config, cache_config, quant_config, prefix=f"{prefix}.self_attn")
        self.mlp = Spark2_5MLP(config, quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


@support_torch_compile
class Spark2_5Model(nn.Module):
    """Embedding, layers, final norm."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        cache_config, quant_config = vllm_config.cache_config, vllm_config.quant_config
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, quant_config=quant_config, prefix=f"{prefix}.embed_tokens"
        )
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: Spark2_5DecoderLayer(config, cache_config, quant_config, prefix=prefix),
            prefix=f"{prefix}.layers",
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if get_pp_group().is_first_rank:
            hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
        else:
            hidden_states, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Spark2_5ForCausalLM(nn.Module, SupportsPP):
    """Spark-X2.5 for both checkpoint layouts (see the module)."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_prefix={"model.embedding.": "model.embed_tokens."},
        orig_to_new_substr={".q_k_v_proj.": ".qkv_proj."},
        orig_to_new_stacked={
            ".q_proj": (".qkv_proj", "q"),
            ".k_proj": (".qkv_proj", "k"),
            ".v_proj": (".qkv_proj", "v"),
            ".gate_proj": (".gate_up_proj", 0),
            ".up_proj": (".gate_up_proj", 1),
        },
    )

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        """Raises:
        RuntimeError: the vendor's Spark plugin is installed and enabled too (it registers this architecture).
        """
        super().__init__()
        from ..families.spark import vendor_conflict

        conflict = vendor_conflict()
        if conflict:
            raise RuntimeError(f"Spark2_5ForCausalLM: {conflict}")
        config = vllm_config.model_config.hf_config
        self.config = config
        self.quant_config = vllm_config.quant_config
        self.model = Spark2_5Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            quant_config=self.quant_config,
            prefix=maybe_prefix(prefix, "lm_head"),
        )
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Both layouts through one mapper; a tied model skips a stored ``lm_head`` (a tied model has none to load)."""
        tied = self.config.tie_word_embeddings
        weights = ((n, w) for n, w in weights if not (tied and n.startswith("lm_head.")))
        return AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)
