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
``WeightsMapper``), whose stacked-name mapping (``WeightsMapper.orig_to_new_stacked``) arrived in vLLM 0.25: on an
older vLLM the module imports and the model refuses to build, naming the release it needs.
"""

import dataclasses
from collections.abc import Iterable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.activation import GeluAndMul
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper

from .prenorm import PrenormDecoderLayer, PrenormForCausalLM, PrenormModel, QkvAttention
from .spark_config import FULL, SLIDING, Spark2_5Config

GATE_ACTS = {"sigmoid": torch.sigmoid, "silu": F.silu}


class Spark2_5Attention(QkvAttention):
    """Spark's attention of one layer (see the module).

    Raises:
        ValueError: a ``gate_attn_act_mode`` other than sigmoid / silu, a layer type without rope parameters, or
            as :func:`~.prenorm.check_attention_config`.
    """

    def __init__(self, config: Spark2_5Config, cache_config=None, quant_config=None, prefix: str = ""):
        super().__init__(config, (SLIDING, FULL), "out_proj", quant_config, prefix)
        if self.kind not in config.rope_parameters:
            raise ValueError(f"{prefix}: rope_parameters has no entry for layer type {self.kind!r}")
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
        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=config.max_position_embeddings,
            is_neox_style=True,
            rope_parameters=dict(config.rope_parameters[self.kind]),
        )
        self.attn = self.attention(config, cache_config, quant_config, prefix, self.kind == SLIDING)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split_qkv(hidden_states)
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


class Spark2_5DecoderLayer(PrenormDecoderLayer):
    """Attention, then the MLP (:class:`~.prenorm.PrenormDecoderLayer`)."""

    def __init__(self, config: Spark2_5Config, cache_config=None, quant_config=None, prefix: str = ""):
        super().__init__(config)
        self.self_attn = Spark2_5Attention(config, cache_config, quant_config, prefix=f"{prefix}.self_attn")
        self.mlp = Spark2_5MLP(config, quant_config, prefix=f"{prefix}.mlp")


@support_torch_compile
class Spark2_5Model(PrenormModel):
    """Embedding, Spark's layers, final norm."""

    layer_cls = Spark2_5DecoderLayer


#: checkpoint name -> (vLLM's stacked layer, shard) for the split layout exllamav3 writes
STACKED = {
    ".q_proj": (".qkv_proj", "q"),
    ".k_proj": (".qkv_proj", "k"),
    ".v_proj": (".qkv_proj", "v"),
    ".gate_proj": (".gate_up_proj", 0),
    ".up_proj": (".gate_up_proj", 1),
}


def stacked_names_supported() -> bool:
    """Whether this vLLM's ``WeightsMapper`` maps split checkpoint names onto stacked layers (vLLM 0.25+)."""
    return "orig_to_new_stacked" in {f.name for f in dataclasses.fields(WeightsMapper)}


class Spark2_5ForCausalLM(PrenormForCausalLM):
    """Spark-X2.5 for both checkpoint layouts (see the module)."""

    model_cls = Spark2_5Model
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_prefix={"model.embedding.": "model.embed_tokens."},
        orig_to_new_substr={".q_k_v_proj.": ".qkv_proj."},
        **({"orig_to_new_stacked": STACKED} if stacked_names_supported() else {}),
    )

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        """Raises:
        RuntimeError: the vendor's Spark plugin is installed and enabled too (it registers this architecture), or
            this vLLM's loader cannot map the split checkpoint names onto the stacked layers (before vLLM 0.25).
        """
        from ..families.spark import vendor_conflict

        conflict = vendor_conflict()
        if conflict:
            raise RuntimeError(f"Spark2_5ForCausalLM: {conflict}")
        if not stacked_names_supported():
            import vllm

            raise RuntimeError(
                f"Spark2_5ForCausalLM needs vLLM 0.25 or newer (its loader maps the checkpoint's q / k / v and gate / "
                f"up tensors onto vLLM's stacked layers through WeightsMapper.orig_to_new_stacked); this is vLLM "
                f"{vllm.__version__}: upgrade vLLM"
            )
        super().__init__(vllm_config=vllm_config, prefix=prefix)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Both layouts through one mapper; a tied model skips a stored ``lm_head`` (a tied model has none to load)."""
        tied = self.config.tie_word_embeddings
        weights = ((n, w) for n, w in weights if not (tied and n.startswith("lm_head.")))
        return AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)
