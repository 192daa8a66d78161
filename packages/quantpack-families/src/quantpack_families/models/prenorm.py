"""What the project's decoder-only model files share (Flint, Spark-X2.5): the config checks they index by, the
common part of their attention (heads per rank, fused q / k / v, output projection, vLLM's attention), a pre-norm
layer's forward, the model body (embedding, layers, final norm, pipeline parallel) around a layer class,
and the causal-LM wrapper (head, tying, logits). Each model file brings its attention and MLP.

No ``from __future__ import annotations`` here: vLLM's ``@support_torch_compile`` reads the forward's annotations
to find its dynamic dimensions. Follows vLLM 0.29-0.32 ``vllm/model_executor/models/qwen2_moe.py``
(``Qwen2MoeDecoderLayer``, ``Qwen2MoeModel``, ``Qwen2MoeForCausalLM``).
"""

from itertools import islice

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.interfaces import SupportsPP
from vllm.model_executor.models.utils import make_empty_intermediate_tensors_factory, make_layers, maybe_prefix
from vllm.sequence import IntermediateTensors


def check_attention_config(config, kinds: tuple[str, ...]) -> None:
    """The attention fields a model file of this package indexes, checked once: one ``layer_types`` entry per layer,
    each one of ``kinds``, and heads and kv heads that split over the TP ranks (kv heads may be replicated when
    fewer than the ranks, as vLLM's ``QKVParallelLinear`` does).

    Raises:
        ValueError: naming the config field and the fix.
    """
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) != config.num_hidden_layers:
        raise ValueError(
            f"{type(config).__name__}: layer_types has {len(types)} entries for {config.num_hidden_layers} layers - "
            "use the config.json that came with the checkpoint"
        )
    odd = sorted({t for t in types if t not in kinds})
    if odd:
        raise ValueError(f"{type(config).__name__}: layer_types holds {odd}; this model knows {list(kinds)}")
    tp = get_tensor_model_parallel_world_size()
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % tp or (kv % tp if kv >= tp else tp % kv):
        raise ValueError(
            f"{type(config).__name__}: {heads} attention heads / {kv} kv heads do not split over {tp} TP ranks - "
            "choose a tensor-parallel size that divides the heads"
        )


def layer_index(prefix: str) -> int:
    """The layer number in a module name such as ``model.layers.3.self_attn``."""
    parts = prefix.split(".")
    return int(parts[parts.index("layers") + 1])


class QkvAttention(nn.Module):
    """What Flint's and Spark's attention share: the config check (:func:`check_attention_config`), this layer's
    index and kind, the heads on this TP rank (kv heads replicated when fewer than the ranks), the fused
    ``qkv_proj``, the output projection under the checkpoint's name, and :meth:`attention` / :meth:`split_qkv`. A
    subclass adds its norms, rotary embedding and gates.

    Args:
        config: the model config (``layer_types``, heads, ``head_dim``, ``hidden_size``).
        kinds: the layer kinds the model knows.
        out_name: the output projection's module name (``o_proj``, ``out_proj``).
        quant_config, prefix: as vLLM passes them.

    Raises:
        ValueError: as :func:`check_attention_config`.
    """

    def __init__(self, config, kinds: tuple[str, ...], out_name: str, quant_config=None, prefix: str = ""):
        super().__init__()
        check_attention_config(config, kinds)
        tp = get_tensor_model_parallel_world_size()
        self.layer = layer_index(prefix)
        self.kind = config.layer_types[self.layer]
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
        out = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.{out_name}",
        )
        self.add_module(out_name, out)

    def attention(self, config, cache_config, quant_config, prefix: str, sliding: bool, **extra) -> Attention:
        """vLLM's attention over this rank's heads, scaled by ``head_dim ** -0.5``, with the config's sliding window
        when ``sliding`` (``extra``: e.g. ``sinks``)."""
        return Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            cache_config=cache_config,
            quant_config=quant_config,
            per_layer_sliding_window=config.sliding_window if sliding else None,
            prefix=f"{prefix}.attn",
            **extra,
        )

    def split_qkv(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q, k, v`` of ``hidden_states``, ``(tokens, heads x head_dim)`` each on this rank."""
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v


class PrenormDecoderLayer(nn.Module):
    """RMSNorm, attention, RMSNorm, MLP, the residuals fused into vLLM's RMSNorm. A subclass calls this
    constructor (the two norms) and sets ``self_attn`` (``(positions, hidden_states) -> hidden_states``) and
    ``mlp``."""

    def __init__(self, config):
        super().__init__()
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


class PrenormModel(nn.Module):
    """Embedding, ``num_hidden_layers`` layers of :attr:`layer_cls` (built as ``layer_cls(config, cache_config,
    quant_config, prefix=...)``), final norm; pipeline-parallel. A subclass sets ``layer_cls`` and applies vLLM's
    ``@support_torch_compile``."""

    layer_cls: type[nn.Module]

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        cache_config, quant_config = vllm_config.cache_config, vllm_config.quant_config
        self.config = config
        self.vocab_size = config.vocab_size
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, quant_config=quant_config, prefix=f"{prefix}.embed_tokens"
        )
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: self.layer_cls(config, cache_config, quant_config, prefix=prefix),
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


class PrenormForCausalLM(nn.Module, SupportsPP):
    """:attr:`model_cls` under ``model``, ``lm_head`` (tied to the embedding when the config says so), the logits.
    A subclass sets ``model_cls`` and brings its ``load_weights``."""

    model_cls: type[nn.Module]

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)  # not super(): a subclass may also derive from a vLLM model for its loader
        config = vllm_config.model_config.hf_config
        self.config = config
        self.quant_config = vllm_config.quant_config
        self.model = self.model_cls(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
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
