"""The shared machinery of the stated architectures: what one architecture's data module gives
(:class:`Architecture`), the decoder layer vLLM builds (:class:`Layer`), the activation rule of its MLP
(:class:`ActivationRule`), config.json read as vLLM's model files read it (:func:`flag`, :func:`count`,
:class:`Sizes`), and the module paths several architectures share with the sizes vLLM gives them
(:func:`common_sizes`).

Each data module of this package (``llama.py``, ``qwen3_moe.py``, ...) states one architecture of vLLM's model files
with these; :mod:`quantpack_core.check.architectures` registers them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from ...errors import Problem
from ..layers import is_norm

#: the attention projections and norms of the stated decoder layers
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
GATED_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FEEDFORWARD_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


class ActivationRule(NamedTuple):
    """The activation a model class builds its MLP with: config.json's ``key`` (``hidden_act``, Gemma's
    ``hidden_activation``) and the names vLLM takes there, compared as vLLM compares them (``any_case``: lowercased
    first, as Gemma 3's ``get_act_and_mul_fn`` does; else exactly)."""

    key: str
    allowed: frozenset[str]
    any_case: bool = False

    def takes(self, value: object) -> bool:
        """Whether vLLM builds the MLP with config value ``value`` (a name; anything else is refused)."""
        return isinstance(value, str) and (value.lower() if self.any_case else value) in self.allowed


#: the rule of the classes whose MLP takes SiLU only (vLLM: "Unsupported activation: ... Only silu is supported for
#: now.")
SILU_ONLY = ActivationRule("hidden_act", frozenset({"silu"}))


class UnverifiedSetting(NamedTuple):
    """A config.json setting vLLM's model class reads and transformers' class of the same model has none of: the
    reference ``quantpack verify`` compares against (transformers) ignores it, so a value other than the neutral one
    passes every check while vLLM serves something else.

    Attributes:
        key: the setting's name in config.json (its text config, as vLLM reads it).
        neutral: ``value -> bool``: whether vLLM, given the value, serves what transformers computes.
        effect: what vLLM does with another value (for the message).
    """

    key: str
    neutral: Callable[[object], bool]
    effect: str


def _no_sliding_layer(v: object) -> bool:
    """Whether a ``layer_types`` value names no sliding-window attention."""
    return not (isinstance(v, list) and any(isinstance(t, str) and "sliding" in t for t in v))


#: vLLM's LlamaForCausalLM (and the classes built on it) multiplies the logits by ``logit_scale``
LOGIT_SCALE = UnverifiedSetting(
    "logit_scale",
    lambda v: v == 1 and not isinstance(v, bool),
    "vLLM multiplies every logit by it (its LlamaForCausalLM reads logit_scale) and serves other probabilities",
)
#: vLLM gives every layer's attention the window of ``ModelConfig.get_sliding_window`` (config.json's
#: ``sliding_window``), or the layers ``layer_types`` names sliding a windowed one
SLIDING_WINDOW = UnverifiedSetting(
    "sliding_window",
    lambda v: v is None,
    "vLLM limits every layer's attention to that many tokens (ModelConfig.get_sliding_window)",
)
SLIDING_LAYERS = UnverifiedSetting(
    "layer_types", _no_sliding_layer, "vLLM gives the layers it names sliding a windowed attention"
)


class Layer(NamedTuple):
    """What vLLM's model class builds in one decoder layer.

    Attributes:
        required: module paths inside the layer that vLLM loads into, which a pack of the model therefore holds (a
            parent such as ``mlp.experts`` holds its experts).
        absent: module paths of other families' layers that vLLM's class has no place for.
        bias: the projections that may carry a bias, each with whether vLLM's layer has one there (the other
            required modules have none).
        unstated: module paths the layer does not state (an MLP whose plan the config cannot give): nothing below
            them is named.
    """

    required: tuple[str, ...] = ()
    absent: tuple[str, ...] = ()
    bias: Mapping[str, bool] = {}
    unstated: tuple[str, ...] = ()


def flag(config: dict, *keys: str) -> bool:
    """Whether any of ``keys`` is set in config.json as vLLM's model files read them (``getattr(config, key,
    False)`` tested for truth: a string ``"false"`` or a ``1`` counts as set, as it does there)."""
    return any(bool(config.get(k)) for k in keys)


def count(config: dict, *keys: str) -> int | None:
    """The first of ``keys`` config.json gives as an integer (not a bool), None when none does."""
    for k in keys:
        v = config.get(k)
        if v is not None:
            return v if isinstance(v, int) and not isinstance(v, bool) else None
    return None


def times(a: int | None, b: int | None) -> int | None:
    """``a * b``, None where either is unknown."""
    return a * b if a is not None and b is not None else None


class Sizes(NamedTuple):
    """config.json's sizes as the stated classes' model files read them (None where the config does not give an
    integer): ``hidden_size``; ``num_attention_heads`` and ``num_key_value_heads`` (default the former) times
    ``head_dim`` (default ``hidden_size / num_attention_heads``); ``intermediate_size``; ``moe_intermediate_size``;
    ``shared_expert_intermediate_size``; the expert count (``num_local_experts``, else ``num_experts``)."""

    hidden: int | None
    heads: int | None
    kv: int | None
    head_dim: int | None
    intermediate: int | None
    expert: int | None
    shared: int | None
    experts: int | None

    @classmethod
    def of(cls, config: dict) -> Sizes:
        hidden = count(config, "hidden_size")
        heads = count(config, "num_attention_heads")
        kv = count(config, "num_key_value_heads") if config.get("num_key_value_heads") is not None else heads
        head_dim = count(config, "head_dim") if config.get("head_dim") is not None else None
        if head_dim is None and hidden and heads:
            head_dim = hidden // heads
        return cls(
            hidden,
            heads,
            kv,
            head_dim,
            count(config, "intermediate_size"),
            count(config, "moe_intermediate_size"),
            count(config, "shared_expert_intermediate_size"),
            count(config, "num_local_experts", "num_experts"),
        )


def bank_sizes(bank: str, names: tuple[str, str, str], s: Sizes, intermediate: int | None) -> dict:
    """The sizes of an expert bank's projections under ``<bank>.<projection>`` (every expert's): gate and up (the
    first two of ``names``) ``hidden x intermediate``, down its transpose."""
    gate, up, down = names
    return {
        f"{bank}.{gate}": (s.hidden, intermediate),
        f"{bank}.{up}": (s.hidden, intermediate),
        f"{bank}.{down}": (intermediate, s.hidden),
    }


def common_sizes(path: str, s: Sizes) -> dict[str, tuple[int | None, ...]]:
    """The sizes vLLM gives module ``path`` of a stated layer where the architecture does not size it itself
    (:attr:`Architecture.sizes`): ``(in, out)`` features of a linear module, ``(n,)`` of a norm; ``{}`` for a path
    no architecture shares."""
    last = path.rsplit(".", 1)[-1]
    attention = {
        "self_attn.q_proj": (s.hidden, times(s.heads, s.head_dim)),
        "self_attn.k_proj": (s.hidden, times(s.kv, s.head_dim)),
        "self_attn.v_proj": (s.hidden, times(s.kv, s.head_dim)),
        "self_attn.o_proj": (times(s.heads, s.head_dim), s.hidden),
    }
    mlp = {
        "mlp.gate_proj": (s.hidden, s.intermediate),
        "mlp.up_proj": (s.hidden, s.intermediate),
        "mlp.down_proj": (s.intermediate, s.hidden),
        "mlp.shared_expert.gate_proj": (s.hidden, s.shared),
        "mlp.shared_expert.up_proj": (s.hidden, s.shared),
        "mlp.shared_expert.down_proj": (s.shared, s.hidden),
        "mlp.gate": (s.hidden, s.experts),
        "mlp.shared_expert_gate": (s.hidden, 1),
    }
    if is_norm(path):
        return {path: (s.head_dim,) if last in ("q_norm", "k_norm") else (s.hidden,)}
    if path in attention or path in mlp:
        return {path: {**attention, **mlp}[path]}
    if path == "mlp.experts":
        return bank_sizes(path, ("gate_proj", "up_proj", "down_proj"), s, s.expert)
    return {}


@dataclass(frozen=True)
class Architecture:
    """One architecture's facts, as its data module states them from vLLM's model file.

    Attributes:
        classes: the model classes (config.json's ``architectures``) vLLM builds with this layer.
        layer: ``(class, config, i) -> Layer``: what vLLM builds in decoder layer ``i`` (an empty :class:`Layer` for
            one it cannot build, or one the project does not state).
        activations: class -> the activation rule of its MLP (none: it takes any, e.g. Mixtral's experts).
        dense_modules: module paths of the layer, besides its norms, that vLLM builds without the quantization
            config (routers, shared-expert gates, a convolution), so that they load a dense ``weight`` only.
        own_tensors: module path -> tensors the module holds itself beside its modules, each loaded by vLLM into a
            parameter of its own (the Gated DeltaNet's ``A_log`` and ``dt_bias``).
        sizes: ``(config, Sizes) -> {path: {name: size}}``: the sizes of the layer's modules this architecture gives
            otherwise than :func:`common_sizes` (a path's entries replace the common ones).
        plan_problems: ``(class, config, layer indices) -> problems``: settings vLLM cannot build the layers from.
        builds_mlp: ``config -> bool``: whether the config alone shows some layer builds a module that takes the
            activation (where the layers' own kinds may not tell); None to look at the layers.
        unverified: the settings vLLM's class reads that transformers' class has none of
            (:class:`UnverifiedSetting`).
    """

    classes: tuple[str, ...]
    layer: Callable[[str, dict, int], Layer]
    activations: Mapping[str, ActivationRule] = field(default_factory=dict)
    dense_modules: tuple[str, ...] = ()
    own_tensors: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    sizes: Callable[[dict, Sizes], dict[str, dict]] | None = None
    plan_problems: Callable[[str, dict, Iterable[int]], list[Problem]] | None = None
    builds_mlp: Callable[[dict], bool] | None = None
    unverified: tuple[UnverifiedSetting, ...] = ()
