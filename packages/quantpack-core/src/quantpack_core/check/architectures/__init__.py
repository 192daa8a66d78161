"""The decoder layers of the model classes the project states, one data module per architecture of vLLM's model
files (:mod:`.llama`, :mod:`.mistral`, :mod:`.qwen2`, :mod:`.qwen2_moe`, :mod:`.qwen3`, :mod:`.qwen3_moe`,
:mod:`.mixtral`, :mod:`.gemma2`, :mod:`.gemma3`, :mod:`.qwen3_next`; the same layers in vLLM 0.22.1, 0.26.0 and 0.29
to 0.32, given the same layer kinds for Qwen3-Next), with the shared machinery in :mod:`.base`. Here: the registry,
and what the pack check asks of it - which class vLLM builds (:func:`stated_class`), the layer it builds
(:func:`architecture_layer`), the sizes it gives each module (:func:`layer_sizes`), the modules it builds dense
(:func:`unquantized_layer_modules`) and the activation its MLP takes (:func:`activation_rule`). The layers are held
against them by :func:`quantpack_core.check.architectures.problems.architecture_problems`; each data module is
checked against the layers vLLM builds by quantpack-exl3's ``test_layer_rules_vllm.py``.
"""

from __future__ import annotations

from ..layers import is_norm
from . import gemma2, gemma3, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe, qwen3_next
from .base import ActivationRule, Architecture, Layer, Sizes, common_sizes, count

#: the stated architectures, in the order of :data:`KNOWN_LAYERS`
ARCHITECTURES: tuple[Architecture, ...] = tuple(
    m.ARCHITECTURE for m in (llama, mistral, qwen2, qwen2_moe, qwen3, qwen3_moe, mixtral, gemma2, gemma3, qwen3_next)
)
#: model class -> its architecture
BY_CLASS: dict[str, Architecture] = {cls: a for a in ARCHITECTURES for cls in a.classes}
#: the model classes whose decoder layer the project states
KNOWN_LAYERS: tuple[str, ...] = tuple(BY_CLASS)
#: the activation each class of :data:`KNOWN_LAYERS` builds its MLP with (:class:`~.base.ActivationRule`); another
#: value stops vLLM in the worker. Mixtral's experts take SiLU whatever the config says. Source: vLLM's llama.py,
#: mistral.py, qwen2.py, qwen2_moe.py, qwen3_moe.py, gemma2.py, gemma3.py (``get_act_and_mul_fn``'s registry in
#: layers/activation.py), alike in 0.22.1 and 0.32.
MLP_ACTIVATIONS: dict[str, ActivationRule] = {cls: rule for a in ARCHITECTURES for cls, rule in a.activations.items()}
#: module path -> tensors a module of a stated layer holds itself beside its modules, each loaded by vLLM into a
#: parameter of its own (the Gated DeltaNet's decay and time-step bias)
OWN_TENSORS: dict[str, tuple[str, ...]] = {path: names for a in ARCHITECTURES for path, names in a.own_tensors.items()}


def stated_class(config: dict) -> str | None:
    """The model class vLLM builds for ``config`` (config.json, or vLLM's built config as a dict) where it is one of
    :data:`KNOWN_LAYERS`, else None. vLLM builds the first class of ``architectures`` it has
    (``ModelRegistry.inspect_model_cls``); every class of :data:`KNOWN_LAYERS` is one of vLLM's own, so a known first
    class is the one it builds, and after another one it cannot be told here."""
    names = config.get("architectures") if isinstance(config, dict) else None
    return names[0] if isinstance(names, list) and names and names[0] in KNOWN_LAYERS else None


def stated_layer(arch: str, config: dict, i: int) -> Layer:
    """The :class:`~.base.Layer` vLLM's model class ``arch`` builds in decoder layer ``i`` (an empty one for a class
    not in :data:`KNOWN_LAYERS`)."""
    a = BY_CLASS.get(arch)
    return a.layer(arch, config, i) if a is not None else Layer()


def architecture_layer(arch: str, config: dict, i: int) -> tuple[tuple[str, ...], tuple[str, ...], dict[str, bool]]:
    """What vLLM's model class ``arch`` builds in decoder layer ``i``, for the architectures of :data:`KNOWN_LAYERS`
    (their layers do not vary with the layer's place, but for the Qwen MoE classes' dense layers).

    Args:
        arch: the model class config.json names.
        config: config.json (its attention_bias / bias / qkv_bias, mlp_bias, qk_norm, num_local_experts /
            num_experts, decoder_sparse_step, mlp_only_layers, shared_expert_intermediate_size, layer_types /
            full_attention_interval and layer_scale are read as vLLM's model file reads them).
        i: the layer's index.

    Returns:
        ``(required, absent, bias)``: module paths inside the layer that vLLM loads into and that a pack of that
        model therefore holds (a parent such as ``mlp.experts`` holds its experts); module paths of other families'
        layers that vLLM's class has no place for; and for each required module whether vLLM's layer has a bias
        there (none on norms, routers and experts in any of these classes). ``((), (), {})`` for an architecture
        not in :data:`KNOWN_LAYERS` (and Mistral's with ``ada_rms_norm_t_cond``); a Qwen MoE layer whose MLP the
        config cannot plan (:func:`.qwen2_moe.qwen_moe_plan`) requires its attention and norms only. Each
        architecture's data module says what its model file builds.
    """
    layer = stated_layer(arch, config, i)
    return layer.required, layer.absent, {path: layer.bias.get(path, False) for path in layer.required}


def layer_sizes(arch: str, config: dict, i: int) -> dict[str, tuple[int | None, ...]]:
    """The logical sizes vLLM's model class ``arch`` gives the modules of decoder layer ``i``, from config.json as its
    model file reads them, for the architectures of :data:`KNOWN_LAYERS`: ``(in, out)`` features of a linear module;
    the weight's own shape for the others (a tuple of another length: ``(n,)`` for a norm, ``(channels, 1, kernel)``
    for the Gated DeltaNet's conv1d); an expert bank's projections under ``<bank>.<projection>``
    (``mlp.experts.gate_proj``: every expert's). None where the config does not give the size (an integer).

    The sizes of :class:`~.base.Sizes` (:func:`~.base.common_sizes`), and those each architecture gives its own
    modules (:attr:`~.base.Architecture.sizes`: Mixtral's experts ``intermediate_size`` wide, Qwen3-Next's q_proj with
    its output gate and its Gated DeltaNet). ``{}`` for an architecture :func:`architecture_layer` does not state.
    """
    a = BY_CLASS.get(arch)
    if a is None:
        return {}
    s = Sizes.of(config)
    own = a.sizes(config, s) if a.sizes is not None else {}
    sizes: dict[str, tuple[int | None, ...]] = {}
    for path in a.layer(arch, config, i).required:
        sizes.update(own[path] if path in own else common_sizes(path, s))
    return sizes


def unquantized(arch: str, required: tuple[str, ...]) -> tuple[str, ...]:
    """:func:`unquantized_layer_modules` of the layer whose required modules are ``required``."""
    dense = BY_CLASS[arch].dense_modules if arch in BY_CLASS else ()
    return tuple(path for path in required if is_norm(path) or path in dense)


def unquantized_layer_modules(arch: str, config: dict, i: int) -> tuple[str, ...]:
    """The modules of decoder layer ``i`` of vLLM's model class ``arch`` (:func:`architecture_layer`'s required
    ones) that vLLM builds without the quantization config, so that they load a dense ``weight`` only: the norms,
    and each architecture's :attr:`~.base.Architecture.dense_modules` (the routers of Mixtral, Qwen2-MoE and
    Qwen3-Next - Qwen3-MoE's router is built with it -, every shared expert's gate, the Gated DeltaNet's convolution
    and the block itself, whose own parameters are plain). A pack storing one of them quantized stops vLLM's loader in
    the worker ("There is no module or parameter named ...mlp.gate.mul1"); exllamav3's converter stores all of them
    dense. ``()`` for an architecture :func:`architecture_layer` does not state.

    Source: vLLM's model files, alike in 0.22.1, 0.26.0 and 0.29 to 0.32 (``quant_config=None``, or none passed, for
    ``self.gate`` in mixtral.py, qwen2_moe.py and qwen3_next.py, for ``self.shared_expert_gate`` in qwen2_moe.py,
    qwen3_moe.py and qwen3_next.py, for ``self.conv1d`` in layers/mamba/gdn/qwen_gdn_linear_attn.py).
    """
    return unquantized(arch, architecture_layer(arch, config, i)[0])


def activation_rule(arch: str, config: dict) -> ActivationRule | None:
    """:data:`MLP_ACTIVATIONS`' rule for model class ``arch`` where vLLM builds a module that takes the activation: a
    dense MLP or a shared expert in some decoder layer (:func:`architecture_layer`, over the first 4,096 layers;
    Qwen3-Next's shared expert also where the config does not tell its layers' attention kinds:
    :attr:`~.base.Architecture.builds_mlp`); None for another class, or a MoE model whose every layer is routed
    experts only (Qwen2-MoE without a shared expert: vLLM never reads ``hidden_act`` there)."""
    rule = MLP_ACTIVATIONS.get(arch)
    layers = count(config, "num_hidden_layers")
    if rule is None or layers is None:
        return rule
    builds_mlp = BY_CLASS[arch].builds_mlp
    if builds_mlp is not None and builds_mlp(config):
        return rule
    built = ("mlp.gate_proj", "mlp.shared_expert.gate_proj")
    return (
        rule
        if any(set(built) & set(architecture_layer(arch, config, i)[0]) for i in range(min(layers, 4096)))
        else None
    )
