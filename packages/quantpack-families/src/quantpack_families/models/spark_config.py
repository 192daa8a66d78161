"""``Spark2_5Config``: the configuration of Spark-X2.5 (``Spark2_5ForCausalLM``, ``model_type: "spark2_5"``), which
neither transformers nor vLLM knows; registered with transformers' ``AutoConfig`` by the family. Imports transformers
only. Field names as in the published config.json (docs/families.md, Spark).
"""

from __future__ import annotations

from transformers import PretrainedConfig

SLIDING, FULL = "sliding_attention", "full_attention"


class Spark2_5Config(PretrainedConfig):
    """Spark-X2.5's configuration (defaults: the 1.7B model).

    Attributes (beyond transformers' own):
        hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim.
        layer_types: per layer ``"sliding_attention"`` (the last ``sliding_window`` tokens, the current one
            included) or ``"full_attention"``; default three sliding to one full.
        rope_parameters: per layer type, the RoPE of that type (``rope_theta``, ``partial_rotary_factor``; NeoX
            rotation of the first ``head_dim * factor`` dimensions).
        headwise_attn_output_gate: each head's attention output is scaled by ``act(g_proj(x))`` (one value per
            head), ``act`` = ``gate_attn_act_mode`` (``"sigmoid"`` or ``"silu"``).
        hidden_act: the MLP's gate activation (GELU: ``gelu(gate) * up``).
    """

    model_type = "spark2_5"

    def __init__(
        self,
        vocab_size: int = 133120,
        hidden_size: int = 2048,
        intermediate_size: int = 6656,
        num_hidden_layers: int = 28,
        num_attention_heads: int = 8,
        num_key_value_heads: int = 2,
        head_dim: int = 256,
        layer_types: list[str] | None = None,
        sliding_window: int = 512,
        rope_parameters: dict | None = None,
        headwise_attn_output_gate: bool = True,
        gate_attn_act_mode: str = "sigmoid",
        hidden_act: str = "gelu",
        rms_norm_eps: float = 1e-6,
        max_position_embeddings: int = 1048576,
        tie_word_embeddings: bool = True,
        **kwargs,
    ):
        # first: some transformers releases validate rope_parameters at the end of the base constructor, before
        # layer_types is set, and would read the per-layer-type table as one flat dict
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        if layer_types is None:
            layer_types = [FULL if i % 4 == 3 else SLIDING for i in range(num_hidden_layers)]
        self.layer_types = list(layer_types)
        self.sliding_window = sliding_window
        self.rope_parameters = dict(
            rope_parameters
            or {
                FULL: {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.25},
                SLIDING: {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0},
            }
        )
        self.headwise_attn_output_gate = headwise_attn_output_gate
        self.gate_attn_act_mode = gate_attn_act_mode
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
