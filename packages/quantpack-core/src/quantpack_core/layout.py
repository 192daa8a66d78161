"""The module layout of a pack's decoder layers: modules that cannot be absent given the modules present.

For a quantized model vLLM does not check that every parameter was loaded (``DefaultModelLoader.load_weights``
checks only unquantized models), so a module missing from a pack reaches the worker process: quantpack's linear
method refuses it there (``LayerLoadError``: "no tensor of this layer was loaded", "a shard missing"), behind vLLM's
"Engine core initialization failed". The pack check (:meth:`quantpack_core.pack.Pack.problems`) reports the same
absence in the user's process first, through the rules here. They only state what holds for every architecture
the project knows (docs/families.md, and vLLM's model files for the others), so a sound pack is never refused:

- :func:`sibling_problems`: modules that come together under one parent (a gated MLP's gate / up / down, the q / k
  / v projections and the attention output); modules that the other instances of the same parent hold beside the
  same modules (a gate projection beside up / down, Mamba's out projection beside in_proj, a router beside the
  experts); a module every other instance of a parent holds (a dense shared-expert gate lost from one layer).
- :func:`tensor_problems`: a plain module's own tensor that every other layer's instance has (a norm's bias, the
  Gated DeltaNet's ``A_log``).
- :func:`stack_problems`: the token embedding, the final norm and an untied output head beside the layers.
- :func:`sublayer_problems`: a decoder layer holding fewer sublayers (``self_attn``, ``mlp``, ``mixer``, ...) than
  at least three quarters of its stack's layers hold. Hybrid stacks (Qwen3-Next's ``linear_attn`` / ``self_attn``,
  Jamba's ``mamba`` / ``self_attn``, Nemotron-H's one ``mixer``) hold as many sublayers in every layer, only
  differently named, so only a layer that lost one has fewer.
- :func:`architecture_problems`: for the model classes whose layer is stated here (:data:`KNOWN_LAYERS`: Llama,
  Mistral, Ministral 3, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, Qwen3-Next, Mixtral, Gemma 2 and 3; checked against the
  layers vLLM builds by quantpack-exl3's ``test_layer_rules_vllm.py``), every layer against that layer, at any layer
  count (the rules above need four instances to see a module lost from one): a module lost, another family's
  module, a module holding no weight or lacking a tensor of its own, a bias the config does not give, a norm,
  router or gate stored quantized where vLLM builds it dense (:func:`unquantized_layer_modules`); and the sizes
  vLLM builds each module with (:func:`layer_sizes`, held against the stored shapes by the pack check).

Whole layers missing and per-layer norms are checked by :class:`~quantpack_core.pack.Pack` itself; experts of an
expert bank by its MoE rules (docs/moe-bank.md).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Container, Iterable
from typing import NamedTuple

from .errors import Problem

#: the names an attention block's output projection has across vLLM's decoder models (Llama's o_proj, OPT's and
#: Spark's out_proj, Phi-2's and Falcon's dense, GPT-2's c_proj, InternLM2's wo, ...)
ATTENTION_OUT = ("o_proj", "out_proj", "dense", "c_proj", "wo", "o", "proj")

#: ``(leaves, needed)``: a parent holding every leaf of ``leaves`` must hold one leaf of each tuple in ``needed`` -
#: the layout itself shows the module was lost (a gated MLP with gate and up has a down projection; attention with
#: q and k has an output projection). Left out on purpose: a lone q_proj (DeepSeek-V2-Lite's MLA without q LoRA
#: keeps q_proj beside kv_a_proj_with_mqa) and q_proj with k_proj but no v_proj (attention whose value is its key).
SIBLINGS: tuple[tuple[tuple[str, ...], tuple[tuple[str, ...], ...]], ...] = (
    (("gate_proj", "up_proj"), (("down_proj",),)),
    (("gate_proj", "down_proj"), (("up_proj",),)),
    (("w1", "w3"), (("w2",),)),
    (("q_proj", "v_proj"), (("k_proj",),)),
    (("k_proj", "v_proj"), (("q_proj", "q_a_proj", "q_b_proj"),)),
    (("q_proj", "k_proj"), (ATTENTION_OUT,)),
)
#: the same form, for layouts that do not show the loss on their own (up and down without gate is a GELU or relu^2
#: MLP; a lone down_proj is a test pack's; not every shared expert is gated, the router's name varies): reported
#: only where another instance of the same parent (``layers.#.mlp``, ``layers.#.mlp.experts.#``) holds both. The
#: names below a parent are its modules and the parents of its modules (``experts`` of ``layers.3.mlp``).
EVIDENCED: tuple[tuple[tuple[str, ...], tuple[tuple[str, ...], ...]], ...] = (
    (("up_proj", "down_proj"), (("gate_proj",),)),
    (("up_proj",), (("down_proj",),)),
    (("down_proj",), (("up_proj", "gate_up_proj"),)),
    (("gate_up_proj",), (("down_proj",),)),
    (("w2",), (("w1",),)),
    (("qkv_proj",), (ATTENTION_OUT,)),
    (("in_proj",), (("out_proj",),)),
    (("shared_expert",), (("shared_expert_gate",),)),
    (("experts",), (("gate", "router"),)),
)
#: a module held by every instance of a parent but one (at least this many holding it) is missing from that one,
#: where it holds nothing most instances lack (Qwen3-Next's shared_expert_gate or a router lost from one layer's
#: mlp; not DeepSeek's dense first layer, whose mlp holds gate_proj / up_proj / down_proj instead of a router). Two
#: or more instances lacking it are a design (value-equals-key attention's full layers hold no v_proj).
LONE_HOLDERS = 3

#: ``<stack>layers.<i>.<rest>`` of a decoder layer's module key
LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d{1,9})\.")
FIX = "the pack is incomplete (a file or tensor lost): re-download it"


def decoder_layers(keys: Iterable[str], other_stacks: re.Pattern, layers: int | None) -> dict[str, dict[int, list]]:
    """Module keys of decoder layers, grouped: ``{stack: {layer index: [module path inside the layer, ...]}}``.

    Args:
        keys: module keys (``model.layers.3.self_attn.q_proj``).
        other_stacks: a pattern that matches the part of a key before ``layers.`` when the layers belong to another
            stack than the decoder's (a vision tower, an MTP head, a draft); such keys are left out.
        layers: config.json's ``num_hidden_layers``; layers at or past it (DeepSeek's MTP layers) are left out.
            None keeps every layer.
    """
    out: dict[str, dict[int, list]] = {}
    for key in keys:
        found = LAYER_KEY.search(key)
        if not found or other_stacks.search(key[: found.start() + 1]):
            continue
        i = int(found.group(1))
        if layers is not None and i >= layers:
            continue
        stack = key[: found.start(1)]
        out.setdefault(stack, {}).setdefault(i, []).append(key[found.end() :])
    return out


def shape(key: str) -> str:
    """``key`` with every index as ``#`` (``model.layers.#.mlp.experts.#``): the instances of one module or parent."""
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1#", key)


def layer_tree(stacks: dict[str, dict[int, list]]) -> dict[str, set[str]]:
    """Every node of the decoder layers, from each layer down to its modules, with the names directly below it:
    ``{"model.layers.3": {"self_attn", "mlp", ...}, "model.layers.3.mlp": {"gate", "experts"}, ...,
    "model.layers.3.mlp.gate": set()}``.

    Args:
        stacks: :func:`decoder_layers`'s grouping.
    """
    tree: dict[str, set[str]] = {}
    for stack, layers in stacks.items():
        for i, paths in layers.items():
            for path in paths:
                node = f"{stack}{i}"
                for name in path.split("."):
                    tree.setdefault(node, set()).add(name)
                    node = f"{node}.{name}"
                tree.setdefault(node, set())
    return tree


def lone_gaps(group: dict[str, set[str]]) -> list[tuple[str, str, int]]:
    """``(instance, name, holders)`` for each name every instance of ``group`` but one holds, at least
    :data:`LONE_HOLDERS` of them, where that instance holds nothing most instances lack (:data:`LONE_HOLDERS`).

    Args:
        group: the instances of one module or parent, each with its names (children or tensors).
    """
    if len(group) <= LONE_HOLDERS:
        return []
    held = Counter(name for names in group.values() for name in names)
    usual = {name for name, n in held.items() if 2 * n > len(group)}
    return [
        (key, name, held[name])
        for key, names in sorted(group.items())
        if names <= usual
        for name in sorted(usual - names)
        if held[name] == len(group) - 1
    ]


def sibling_problems(stacks: dict[str, dict[int, list]], lone: bool = True) -> list[Problem]:
    """Modules missing beside the modules present under the same parent (:data:`SIBLINGS`, :data:`EVIDENCED`), and
    modules every other instance of the parent holds (:data:`LONE_HOLDERS`).

    Args:
        stacks: :func:`decoder_layers`'s grouping.
        lone: also report modules every other instance holds (off for DeciLM's ``block_configs``, whose blocks
            differ by design).

    Returns:
        One :class:`Problem` per missing module, naming the module, the tensor vLLM would look for and the modules
        present that imply it.
    """
    parents = {node: names for node, names in layer_tree(stacks).items() if names}
    shape_of = {node: shape(node) for node in parents}
    members: dict[str, dict[str, set[str]]] = {}  # shape -> its instances, each with the names below it
    for parent, names in parents.items():
        members.setdefault(shape_of[parent], {})[parent] = names
    out: list[Problem] = []
    reported: set[str] = set()
    counts: dict[tuple, tuple[int, int]] = {}
    for parent, leaves in sorted(parents.items()):
        for rules, evidence in ((SIBLINGS, 0), (EVIDENCED, 1)):
            for when, needed in rules:
                if not leaves.issuperset(when):
                    continue
                for names in needed:
                    missing = f"{parent}.{names[0]}"
                    if leaves & set(names) or missing in reported:
                        continue
                    if evidence:  # instances of the parent holding ``when``, and those of them holding ``names``
                        key = (shape_of[parent], when, names)
                        if key not in counts:  # once per parent shape and rule: a bank has thousands of experts
                            same = [o for o in members[shape_of[parent]].values() if o.issuperset(when)]
                            counts[key] = (len(same), sum(1 for o in same if o & set(names)))
                        holders = counts[key][1]
                        if holders < evidence:
                            continue
                    reported.add(missing)
                    what = f"holds {' and '.join(when)} but no {' / '.join(names)}"
                    what += f", which the other {shape_of[parent]} hold" if evidence else ": vLLM's layer needs it"
                    out.append(Problem(missing, f"{missing}.*", what, FIX))
    for group_shape, group in sorted(members.items()) if lone else ():
        for parent, leaf, holders in lone_gaps(group):
            missing = f"{parent}.{leaf}"
            # an index is an expert of a bank: the MoE rules name it with its projections
            if not leaf.isdigit() and missing not in reported:
                reported.add(missing)
                what = f"holds no {leaf}, which the other {holders} {group_shape} hold"
                out.append(Problem(missing, f"{missing}.*", what, FIX))
    return out


def sublayer_problems(stacks: dict[str, dict[int, list]]) -> list[Problem]:
    """Decoder layers holding fewer sublayers than at least three quarters of their stack's layers, and only
    sublayers that more than half of them hold.

    A sublayer is the first name inside a layer that has modules below it (``self_attn`` of
    ``layers.3.self_attn.q_proj``); modules directly in the layer (norms) are not sublayers.

    Args:
        stacks: :func:`decoder_layers`'s grouping.

    Returns:
        One :class:`Problem` per short layer, naming the sublayers that more than half of the stack's layers hold
        and this one lacks.
    """
    out: list[Problem] = []
    for stack, layers in sorted(stacks.items()):
        subs = {i: {p.split(".", 1)[0] for p in paths if "." in p} for i, paths in layers.items()}
        counts = Counter(len(s) for s in subs.values())
        usual = next((c for c, n in counts.items() if 4 * n >= 3 * len(subs)), None)
        if usual is None:
            continue
        held = Counter(name for s in subs.values() for name in s)
        common = sorted(name for name, n in held.items() if 2 * n > len(subs))
        for i, s in sorted(subs.items()):
            lost = [name for name in common if name not in s]
            # a layer holding a sublayer most layers lack is another kind of layer (Step3's dense layers hold mlp
            # where its MoE layers hold moe and share_expert), not one that lost a sublayer
            if len(s) < usual and lost and s <= set(common):
                what = (
                    f"layer {i} holds no {' / '.join(lost)} (its sublayers: {', '.join(sorted(s)) or 'none'}), "
                    f"while {held[lost[0]]} of the stack's {len(subs)} layers do"
                )
                out.append(Problem(f"{stack}{i}.{lost[0]}", f"{stack}{i}.{lost[0]}.*", what, FIX))
    return out


#: architectures whose packs hold layers only, taking the embedding, final norm and head from their target model
#: (EAGLE, EAGLE-3, MTP, Medusa, DSpark drafts); not Eagle 2.5 VL, a whole vision-language model
DRAFTS = re.compile(r"eagle(?!2_5_vl)|medusa|mtp|draft|speculator|dspark", re.IGNORECASE)
#: EAGLE's fusion layer, outside the layers: a pack holding it is a draft whatever its config names (EAGLE-1 drafts
#: published with ``architectures: ["LlamaForCausalLM"]``, renamed by vLLM only when loaded as a draft)
DRAFT_FUSION = "fc"
#: the token embedding (embed_tokens, embeddings, tok_embeddings, embed_in, word_embeddings, Spark's bf16 embedding,
#: GPT-2's wte; not a norm of it: BART's layernorm_embedding) and the final norm (norm, norm_f, final_layernorm,
#: final_layer_norm, ln_f)
EMBEDDING = re.compile(r"^(?!.*norm).*emb|^wte$")
FINAL_NORM = re.compile(r"norm|^ln_")
#: names of an untied output head (lm_head; InternLM2's and Mistral's consolidated output; GPT-NeoX's embed_out;
#: ChatGLM's output_layer), and the architectures that have one (pooling and reward models have none)
HEADS = ("lm_head", "output", "embed_out", "output_layer")
GENERATIVE = re.compile(r"ForCausalLM|ForConditionalGeneration|LMHeadModel")
#: architectures of encoders, pooling and reward models, and base models saved without their head (Qwen3Model for
#: Qwen3-Embedding, ChatGLMModel): their layouts vary beyond what the stack rules know, so those rules leave them
NOT_DECODERS = re.compile(r"Model$|Bert|ForSequenceClassification|ForTokenClassification|ForMaskedLM|Reward|Embed")
#: stack names of towers beside a language model (vision, audio, speech encoders) that share its layer count
TOWERS = re.compile(r"encoder|vision|visual|vit|vpm|img|image|audio|sound|speech|whisper", re.IGNORECASE)


def language_stacks(stacks: dict[str, dict[int, list]], config: dict) -> list[str]:
    """The decoder stacks of the language model among ``stacks``: those whose last layer index is config.json's
    ``num_hidden_layers`` - 1 (``text_config``'s first; towers of another depth drop out), and of several such, those
    not named like a tower (:data:`TOWERS`) where any is. Without a layer count, the same choice among all stacks.

    Args:
        stacks: :func:`decoder_layers`'s grouping.
        config: config.json.
    """
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    count = text.get("num_hidden_layers", config.get("num_hidden_layers"))
    known = isinstance(count, int) and not isinstance(count, bool)
    found = [s for s, layers in stacks.items() if not known or max(layers) + 1 == count]
    plain = [s for s in found if not TOWERS.search(s)]
    return sorted(plain if plain and len(found) > 1 else found)


def stack_problems(
    stacks: dict[str, dict[int, list]], keys: Iterable[str], other_stacks: re.Pattern, config: dict
) -> list[Problem]:
    """What the language model's decoder stack (:func:`language_stacks`) needs besides its layers: the token
    embedding and, where its layers hold norms, the final norm (dense modules vLLM does not check for a quantized
    model: it would serve an uninitialized table or the norm's initial ones, without a word), and an output head
    where config.json unties it (``tie_word_embeddings: false``, for a generative architecture whose layers are not
    at the top of the pack; the head method refuses a missing head only at the first forward). Not for drafts
    (:data:`DRAFTS`, :data:`DRAFT_FUSION`: their target lends them all three) nor :data:`NOT_DECODERS`, nor a final
    norm where OPT's ``do_layer_norm_before: false`` leaves it out.

    Both are looked for outside the layers and the other stacks, below the stack's first name (``model.norm`` of
    ``model.layers``, PLaMo's ``model.norm`` of ``model.layers.layers``, ChatGLM's
    ``transformer.embedding.word_embeddings`` of ``transformer.encoder.layers``; a vision tower's patch embedding
    elsewhere does not stand in for the language model's).

    Args:
        stacks: :func:`decoder_layers`'s grouping.
        keys: every module key of the pack.
        other_stacks: the pattern :func:`decoder_layers` takes; modules of those stacks are not looked at.
        config: config.json (its ``text_config`` first, where it has one).

    Returns:
        One :class:`Problem` per missing module.
    """
    arch = config.get("architectures")
    names = [a for a in arch if isinstance(a, str)] if isinstance(arch, list) else []
    outside = [k for k in keys if not LAYER_KEY.search(k) and not other_stacks.search(k + ".")]
    if any(DRAFTS.search(a) or NOT_DECODERS.search(a) for a in names):
        return []
    if any(k.rsplit(".", 1)[-1] == DRAFT_FUSION for k in outside):
        return []
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}

    def said(key: str) -> object:
        return text.get(key, config.get(key))

    out: list[Problem] = []
    lm = language_stacks(stacks, config)
    for stack in lm:
        parent = stack[: -len("layers.")]
        top = stack.split(".", 1)[0] + "." if stack.count(".") > 1 else ""
        near = [k for k in outside if k.startswith(top)]
        # the embedding below the stack's first name, or anywhere outside a tower (an encoder's root embeddings)
        embeddings = [*near, *(k for k in outside if not TOWERS.search(k.rpartition(".")[0]))]
        if not any(EMBEDDING.search(k.rsplit(".", 1)[-1]) for k in embeddings):
            what = f"no token embedding for the decoder stack {stack}* (embed_tokens, embeddings, ...): vLLM would "
            what += "serve an uninitialized table"
            out.append(Problem(f"{parent}embed_tokens", f"{parent}embed_tokens.weight", what, FIX))
        norms = any(FINAL_NORM.search(p.rsplit(".", 1)[-1]) for paths in stacks[stack].values() for p in paths)
        if norms and said("do_layer_norm_before") is not False:
            if not any(FINAL_NORM.search(k.rsplit(".", 1)[-1]) for k in near):
                what = (
                    f"no final norm after the decoder stack {stack}* (norm, norm_f, final_layernorm, ...) while its "
                    "layers hold norms: vLLM would serve with the norm's initial ones"
                )
                out.append(Problem(f"{parent}norm", f"{parent}norm.weight", what, FIX))
    # a stack at the top of the pack (layers.N) is a base model saved without its head (Qwen3-Embedding's weights)
    generative = any(GENERATIVE.search(a) for a in names) and "layers." not in lm
    if generative and said("tie_word_embeddings") is False and not any(k.rsplit(".", 1)[-1] in HEADS for k in outside):
        what = "missing: config.json says tie_word_embeddings false, so the model needs its own output head"
        out.append(Problem("lm_head", "lm_head.*", what, FIX))
    return out


def tensor_problems(
    stacks: dict[str, dict[int, list]], own: dict[str, set[str]], keys: Container[str]
) -> list[Problem]:
    """Tensors of a plain (dense) module of the decoder layers that every other instance of it has: a norm's bias, or
    the Gated DeltaNet's / Mamba's own ``A_log`` and ``dt_bias`` beside its child projections, lost from one layer
    (vLLM would serve their initial values, without a word). A module whose own tensors are all gone still shows as
    the parent of its child modules, holding none. Reported as :func:`lone_gaps` finds them.

    Args:
        stacks: :func:`decoder_layers`'s grouping.
        own: plain modules' own tensor names (``{"model.layers.0.linear_attn": {"A_log", "dt_bias"}}``); coded
            modules are left out (their own checks know their tensors).
        keys: every module key of the pack; a group with a coded module among its instances is left alone.

    Returns:
        One :class:`Problem` per missing tensor.
    """
    layers = {f"{stack}{i}" for stack, by_layer in stacks.items() for i in by_layer}
    groups: dict[str, dict[str, set[str]]] = {}
    for node in layer_tree(stacks).keys() - layers:  # the modules and parents inside the layers
        groups.setdefault(shape(node), {})[node] = set(own.get(node, ()))
    out: list[Problem] = []
    for group_shape, group in sorted(groups.items()):
        if any(k in keys and k not in own for k in group):
            continue  # coded modules among them
        for key, tensor, holders in lone_gaps(group):
            what = f"has no .{tensor}, which the other {holders} {group_shape} have"
            out.append(Problem(key, f"{key}.{tensor}", what, FIX))
    return out


#: the attention projections and norms of the decoder layers :func:`architecture_layer` knows
_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
_GATED_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_FEEDFORWARD_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
#: the architectures whose decoder layer :func:`architecture_layer` states (vLLM's llama.py, mistral.py, which also
#: builds Ministral3ForCausalLM, qwen2.py, qwen2_moe.py, qwen3.py, qwen3_moe.py, qwen3_next.py, mixtral.py, gemma2.py,
#: gemma3.py; the same layers in vLLM 0.22.1, 0.26.0 and 0.29 to 0.32, given the same layer kinds for Qwen3-Next)
KNOWN_LAYERS = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Ministral3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Qwen3NextForCausalLM",
)


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


#: the Gemma classes' rules; every other class of :data:`KNOWN_LAYERS` but Mixtral takes SiLU only
_GEMMA_ACTIVATIONS = {
    "Gemma2ForCausalLM": ActivationRule("hidden_activation", frozenset({"gelu_pytorch_tanh"})),
    "Gemma3ForCausalLM": ActivationRule(
        "hidden_activation", frozenset({"gelu", "gelu_pytorch_tanh", "silu", "swish", "geglu", "swigluoai"}), True
    ),
}
#: the activation each class of :data:`KNOWN_LAYERS` builds its MLP with (:class:`ActivationRule`); another value
#: stops vLLM in the worker (Llama, Mistral, Qwen2 / 3 and their MoE classes: "Unsupported activation: ... Only silu
#: is supported for now."; Gemma 2: "... set `hidden_activation` to `gelu_pytorch_tanh`"; Gemma 3: "Activation
#: function ... is not supported"). Mixtral's experts take SiLU whatever the config says. Source: vLLM's llama.py,
#: mistral.py, qwen2.py, qwen2_moe.py, qwen3_moe.py, gemma2.py, gemma3.py (``get_act_and_mul_fn``'s registry in
#: layers/activation.py), alike in 0.22.1 and 0.32; checked against the classes vLLM builds by quantpack-exl3's
#: ``test_layer_rules_vllm.py``.
MLP_ACTIVATIONS: dict[str, ActivationRule] = {
    arch: _GEMMA_ACTIVATIONS.get(arch, ActivationRule("hidden_act", frozenset({"silu"})))
    for arch in KNOWN_LAYERS
    if arch != "MixtralForCausalLM"
}


def activation_rule(arch: str, config: dict) -> ActivationRule | None:
    """:data:`MLP_ACTIVATIONS`' rule for model class ``arch`` where vLLM builds a module that takes the activation: a
    dense MLP or a shared expert in some decoder layer (:func:`architecture_layer`, over the first 4,096 layers;
    Qwen3-Next's shared expert also where the config does not tell its layers' attention kinds); None
    for another class, or a MoE model whose every layer is routed experts only (Qwen2-MoE without a shared expert:
    vLLM never reads ``hidden_act`` there)."""
    rule = MLP_ACTIVATIONS.get(arch)
    layers = _count(config, "num_hidden_layers")
    if rule is None or layers is None:
        return rule
    if arch == "Qwen3NextForCausalLM" and (_count(config, "shared_expert_intermediate_size") or 0) > 0:
        return rule  # every sparse layer builds its shared expert, whatever kind of attention the layer has
    built = ("mlp.gate_proj", "mlp.shared_expert.gate_proj")
    return (
        rule
        if any(set(built) & set(architecture_layer(arch, config, i)[0]) for i in range(min(layers, 4096)))
        else None
    )


#: the Qwen MoE classes, whose sparse layers the config plans (:func:`qwen_moe_plan`)
QWEN_MOE = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM")
#: the modules of Qwen3-Next's Gated DeltaNet block (its linear-attention layers; vLLM's QwenGatedDeltaNetAttention
#: loads the checkpoint's names)
_GATED_DELTANET = tuple(f"linear_attn.{m}" for m in ("in_proj_qkvz", "in_proj_ba", "conv1d", "norm", "out_proj"))
#: tensors a module of a stated layer holds itself beside its modules, each loaded by vLLM into a parameter of its
#: own (the Gated DeltaNet's decay and time-step bias)
OWN_TENSORS = {"linear_attn": ("A_log", "dt_bias")}
#: Qwen3-Next's layer kinds (config.json's ``layer_types``)
_QWEN3_NEXT_KINDS = ("linear_attention", "full_attention")


def _flag(config: dict, *keys: str) -> bool:
    """Whether any of ``keys`` is set in config.json as vLLM's model files read them (``getattr(config, key,
    False)`` tested for truth: a string ``"false"`` or a ``1`` counts as set, as it does there)."""
    return any(bool(config.get(k)) for k in keys)


def _count(config: dict, *keys: str) -> int | None:
    """The first of ``keys`` config.json gives as an integer (not a bool), None when none does."""
    for k in keys:
        v = config.get(k)
        if v is not None:
            return v if isinstance(v, int) and not isinstance(v, bool) else None
    return None


def qwen_moe_plan(config: dict) -> tuple[int, int, list] | None:
    """The Qwen MoE classes' (:data:`QWEN_MOE`) expert count, sparse step and dense layers as vLLM reads them
    (``config.num_experts``, which transformers maps to ``num_local_experts``; ``decoder_sparse_step``, default 1;
    ``mlp_only_layers``, default none, null read as none as the config classes do), or None where they cannot build a
    model (a step below 1: vLLM divides by it; a count that is no integer) or config.json gives no expert count
    (the config class's default then, which :func:`moe_plan_unknown` tells apart)."""
    experts = _count(config, "num_local_experts", "num_experts")
    step = _count(config, "decoder_sparse_step") if "decoder_sparse_step" in config else 1
    only = config.get("mlp_only_layers") if config.get("mlp_only_layers") is not None else []
    if experts is None or step is None or step < 1 or not isinstance(only, list):
        return None
    return experts, step, only


def moe_plan_unknown(config: dict) -> bool:
    """Whether config.json leaves a Qwen MoE class's expert count to its config class's default (no
    ``num_experts`` / ``num_local_experts``, or null): nothing to plan from here, and nothing wrong."""
    return config.get("num_local_experts") is None and config.get("num_experts") is None


def qwen3_next_layer_type(config: dict, i: int) -> str | None:
    """The kind of Qwen3-Next's layer ``i`` as vLLM reads it (``config.layer_types[i]``), or None where config.json
    gives no kind vLLM can build, or none every release agrees on: without ``layer_types``, vLLM 0.22 to 0.31 build
    their own config class, which makes every fourth layer full attention, and 0.32 transformers', which takes the
    interval from ``full_attention_interval`` (default 4), so only an interval of 4 (or none) is read alike.
    At load the plugin hands over vLLM's own config, which holds the list."""
    types = config.get("layer_types")
    if types is not None:
        ok = isinstance(types, list) and i < len(types) and types[i] in _QWEN3_NEXT_KINDS
        return types[i] if ok else None
    interval = config.get("full_attention_interval", 4)
    if interval != 4 or isinstance(interval, bool):
        return None
    return _QWEN3_NEXT_KINDS[0] if (i + 1) % 4 else _QWEN3_NEXT_KINDS[1]


def qwen_moe_sparse(plan: tuple[int, int, list], i: int) -> bool:
    """Whether vLLM's Qwen2-MoE or Qwen3-MoE makes layer ``i`` an MoE layer under ``plan`` (:func:`qwen_moe_plan`)."""
    experts, step, only = plan
    return experts > 0 and (i + 1) % step == 0 and i not in only


def _within(path: str, module: str) -> bool:
    """Whether module path ``path`` is ``module`` or lies below it."""
    return path == module or path.startswith(module + ".")


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
        config cannot plan (:func:`qwen_moe_plan`) requires its attention and norms only.

    Source: vLLM's model files (llama.py, whose layer mistral.py's extends: ``attention_bias or bias`` for q/k/v/o,
    ``qkv_bias`` over it for q/k/v, ``mlp_bias``; qwen2.py: q/k/v biased, ``qk_norm``; qwen3.py and qwen3_moe.py:
    q_norm / k_norm always, q/k/v bias by ``attention_bias``; qwen2_moe.py and qwen3_moe.py: a layer sparse where
    ``num_experts`` > 0, ``(i + 1) % decoder_sparse_step == 0`` and ``i`` not in ``mlp_only_layers``, a shared
    expert where ``shared_expert_intermediate_size`` > 0, its gate in every Qwen2-MoE sparse layer; mixtral.py: no
    bias; gemma2.py and gemma3.py: pre- and post-feedforward norms, q/k/v/o bias by ``attention_bias``, Gemma 3's
    q_norm / k_norm; qwen3_next.py: ``layer_types`` (:func:`qwen3_next_layer_type`) gives each layer the Gated
    DeltaNet (:data:`OWN_TENSORS` beside its modules) or attention with q_norm / k_norm and q/k/v bias by
    ``qkv_bias``, the MLP planned as Qwen2-MoE's, a layer scale where ``layer_scale`` is set, which this does not
    state).
    """
    required, absent, bias = _layer_modules(arch, config, i)
    return required, absent, {path: bias.get(path, False) for path in required}


def _layer_modules(arch: str, config: dict, i: int) -> tuple[tuple[str, ...], tuple[str, ...], dict[str, bool]]:
    """:func:`architecture_layer` with the biases of the projections that may carry one only."""
    if arch in ("LlamaForCausalLM", "MistralForCausalLM", "Ministral3ForCausalLM"):
        if arch != "LlamaForCausalLM" and _flag(config, "ada_rms_norm_t_cond"):
            return (), (), {}  # a time-conditioned norm's modules in the layer (Voxtral's): not stated
        attn = _flag(config, "attention_bias", "bias")
        qkv = _flag(config, "qkv_bias") if "qkv_bias" in config else attn
        bias = {**dict.fromkeys(_ATTENTION[:3], qkv), _ATTENTION[3]: attn}
        bias.update(dict.fromkeys(_GATED_MLP, _flag(config, "mlp_bias")))
        return (*_ATTENTION, *_GATED_MLP, *_LAYER_NORMS), _QK_NORMS, bias
    if arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        norms = _QK_NORMS if arch == "Gemma3ForCausalLM" else ()
        bias = dict.fromkeys(_ATTENTION, _flag(config, "attention_bias"))
        required = (*_ATTENTION, *norms, *_GATED_MLP, *_LAYER_NORMS, *_FEEDFORWARD_NORMS)
        return required, () if norms else _QK_NORMS, bias
    if arch == "MixtralForCausalLM":
        return (*_ATTENTION, "block_sparse_moe.gate", "block_sparse_moe.experts", *_LAYER_NORMS), _QK_NORMS, {}
    if arch not in (*QWEN_MOE, "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return (), (), {}
    absent: tuple[str, ...] = ()
    if arch == "Qwen3NextForCausalLM":
        kind = qwen3_next_layer_type(config, i)
        if kind is None or _flag(config, "layer_scale"):
            return (), (), {}  # a layer vLLM cannot build, or one with scales held by the layer itself: not stated
        full = kind == "full_attention"
        attn = (*_ATTENTION, *_QK_NORMS) if full else ("linear_attn", *_GATED_DELTANET)
        bias = dict.fromkeys(_ATTENTION[:3], _flag(config, "qkv_bias")) if full else {}
    elif arch.startswith("Qwen2"):
        bias = dict.fromkeys(_ATTENTION[:3], True)
        norms = _QK_NORMS if arch == "Qwen2ForCausalLM" and _flag(config, "qk_norm") else ()
        attn, absent = (*_ATTENTION, *norms), () if norms else _QK_NORMS
    else:
        bias = dict.fromkeys(_ATTENTION[:3], _flag(config, "attention_bias"))
        attn = (*_ATTENTION, *_QK_NORMS)
    mlp: tuple[str, ...] = _GATED_MLP
    if arch in QWEN_MOE:
        plan = qwen_moe_plan(config)
        if plan is None:
            mlp = ()
        elif qwen_moe_sparse(plan, i):
            mlp = ("mlp.gate", "mlp.experts")
            # Qwen2-MoE's and Qwen3-Next's classes build the shared expert's gate whatever its size (transformers'
            # default size is not 0 there)
            gated = arch != "Qwen3MoeForCausalLM"
            shared = _count(config, "shared_expert_intermediate_size")
            shared = (1 if gated else 0) if shared is None else shared
            if shared > 0:
                mlp += tuple(f"mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
            if shared > 0 or gated:
                mlp += ("mlp.shared_expert_gate",)
    return (*attn, *mlp, *_LAYER_NORMS), absent, bias


def layer_sizes(arch: str, config: dict, i: int) -> dict[str, tuple[int | None, ...]]:
    """The logical sizes vLLM's model class ``arch`` gives the modules of decoder layer ``i``, from config.json as its
    model file reads them, for the architectures of :data:`KNOWN_LAYERS`: ``(in, out)`` features of a linear module;
    the weight's own shape for the others (a tuple of another length: ``(n,)`` for a norm, ``(channels, 1, kernel)``
    for the Gated DeltaNet's conv1d); an expert bank's projections under ``<bank>.<projection>``
    (``mlp.experts.gate_proj``: every expert's). None where the config does not give the size (an integer).

    Sizes: ``hidden_size``; ``num_attention_heads`` and ``num_key_value_heads`` (default the former) times
    ``head_dim`` (default ``hidden_size / num_attention_heads``); ``intermediate_size`` (Mixtral's experts too);
    ``moe_intermediate_size``; ``shared_expert_intermediate_size``; the expert count of :func:`qwen_moe_plan`
    (Mixtral's ``num_local_experts``); Qwen3-Next's q_proj twice as wide with ``attn_output_gate`` (default on), its
    Gated DeltaNet's ``linear_num_key_heads`` x ``linear_key_head_dim`` keys and ``linear_num_value_heads`` x
    ``linear_value_head_dim`` values (in_proj_qkvz: two of each; in_proj_ba: two per value head; the norm: one value
    head; conv1d: ``linear_conv_kernel_dim`` taps over both keys and the values; the block's own ``A_log`` and
    ``dt_bias``, under ``linear_attn.A_log`` / ``linear_attn.dt_bias``: one value per value head). ``{}`` for an
    architecture :func:`architecture_layer` does not state.

    Source: vLLM's llama.py, qwen2.py, qwen3.py, qwen2_moe.py, qwen3_moe.py, qwen3_next.py, mixtral.py, gemma2.py,
    gemma3.py (checked against the parameters vLLM builds by quantpack-exl3's ``test_layer_rules_vllm.py``).
    """
    required = architecture_layer(arch, config, i)[0]
    hidden = _count(config, "hidden_size")
    heads = _count(config, "num_attention_heads")
    kv = _count(config, "num_key_value_heads") if config.get("num_key_value_heads") is not None else heads
    head_dim = _count(config, "head_dim") if config.get("head_dim") is not None else None
    if head_dim is None and hidden and heads:
        head_dim = hidden // heads

    def times(a: int | None, b: int | None) -> int | None:
        return a * b if a is not None and b is not None else None

    mixtral = arch == "MixtralForCausalLM"
    inter = _count(config, "intermediate_size")
    expert = inter if mixtral else _count(config, "moe_intermediate_size")
    shared = _count(config, "shared_expert_intermediate_size")
    experts = _count(config, "num_local_experts", "num_experts")
    # Qwen3-Next: attention whose q_proj also gives the output gate (``attn_output_gate``, default on), and the
    # Gated DeltaNet's key / value widths
    q_parts = 1 + bool(config.get("attn_output_gate", True)) if arch == "Qwen3NextForCausalLM" else 1
    key_dim = times(_count(config, "linear_num_key_heads"), _count(config, "linear_key_head_dim"))
    v_heads, v_dim = _count(config, "linear_num_value_heads"), _count(config, "linear_value_head_dim")
    value_dim = times(v_heads, v_dim)
    sizes: dict[str, tuple[int | None, ...]] = {}
    for path in required:
        last = path.rsplit(".", 1)[-1]
        if is_norm(path):
            own = path.startswith("linear_attn.")  # the Gated DeltaNet's norm: over one value head
            sizes[path] = (head_dim,) if last in ("q_norm", "k_norm") else (v_dim,) if own else (hidden,)
        elif path == "self_attn.q_proj":
            sizes[path] = (hidden, times(times(heads, head_dim), q_parts))
        elif path in ("self_attn.k_proj", "self_attn.v_proj"):
            sizes[path] = (hidden, times(kv, head_dim))
        elif path == "self_attn.o_proj":
            sizes[path] = (times(heads, head_dim), hidden)
        elif path in ("mlp.gate_proj", "mlp.up_proj"):
            sizes[path] = (hidden, inter)
        elif path == "mlp.down_proj":
            sizes[path] = (inter, hidden)
        elif path in ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"):
            sizes[path] = (hidden, shared)
        elif path == "mlp.shared_expert.down_proj":
            sizes[path] = (shared, hidden)
        elif path in ("mlp.gate", "block_sparse_moe.gate"):
            sizes[path] = (hidden, experts)
        elif path == "mlp.shared_expert_gate":
            sizes[path] = (hidden, 1)
        elif path in ("mlp.experts", "block_sparse_moe.experts"):
            gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
            sizes[f"{path}.{gate}"] = sizes[f"{path}.{up}"] = (hidden, expert)
            sizes[f"{path}.{down}"] = (expert, hidden)
        elif path == "linear_attn.in_proj_qkvz":
            both = key_dim + value_dim if key_dim is not None and value_dim is not None else None
            sizes[path] = (hidden, times(both, 2))
        elif path == "linear_attn.in_proj_ba":
            sizes[path] = (hidden, times(v_heads, 2))
        elif path == "linear_attn.out_proj":
            sizes[path] = (value_dim, hidden)
        elif path == "linear_attn.conv1d":  # a depthwise convolution over the keys and values: (channels, 1, kernel)
            channels = key_dim * 2 + value_dim if key_dim is not None and value_dim is not None else None
            sizes[path] = (channels, 1, _count(config, "linear_conv_kernel_dim"))
        elif path in OWN_TENSORS:  # the block's own parameters (A_log, dt_bias): one value per value head
            for name in OWN_TENSORS[path]:
                sizes[f"{path}.{name}"] = (v_heads,)
    return sizes


#: the tensors of a module that vLLM loads its weight from: a dense weight, an EXL3 or escha trellis, int8 rows
WEIGHT_TENSORS = frozenset({"weight", "trellis", "escha_code", "qweight", "weight_int8"})
#: the fix where a module vLLM loads a dense weight into is stored quantized
FIX_DENSE = (
    "store this module as a dense float16 / bfloat16 weight, as exllamav3's converter does (it keeps norms, routers "
    "and gates dense): re-convert the pack, or re-download it if it was altered"
)
#: the weight tensors of a module stored quantized (all of :data:`WEIGHT_TENSORS` but a dense ``weight``)
QUANTIZED_TENSORS = WEIGHT_TENSORS - {"weight"}


def is_norm(path: str) -> bool:
    """Whether module path ``path`` names a norm (its last name holds ``norm``: ``input_layernorm``, ``q_norm``,
    ``model.norm``, ``linear_attn.norm``). No vLLM model builds such a module with the quantization config: every
    norm is an RMSNorm / LayerNorm that loads a dense weight only (vLLM 0.32's model files name no linear layer so)."""
    return "norm" in path.rsplit(".", 1)[-1]


def unquantized_layer_modules(arch: str, config: dict, i: int) -> tuple[str, ...]:
    """The modules of decoder layer ``i`` of vLLM's model class ``arch`` (:func:`architecture_layer`'s required
    ones) that vLLM builds without the quantization config, so that they load a dense ``weight`` only: the norms,
    the routers of Mixtral, Qwen2-MoE and Qwen3-Next (Qwen3-MoE's router is built with it), every shared expert's
    gate, the Gated DeltaNet's convolution (``linear_attn.conv1d``) and the block itself (``linear_attn``, whose own
    parameters :data:`OWN_TENSORS` are plain). A pack storing one of them quantized stops vLLM's loader in the
    worker ("There is no module or parameter named ...mlp.gate.mul1"); exllamav3's converter stores all of them
    dense. ``()`` for an architecture :func:`architecture_layer` does not state.

    Source: vLLM's model files, alike in 0.22.1, 0.26.0 and 0.29 to 0.32 (``quant_config=None``, or none passed, for
    ``self.gate`` in mixtral.py, qwen2_moe.py and qwen3_next.py, for ``self.shared_expert_gate`` in qwen2_moe.py,
    qwen3_moe.py and qwen3_next.py, for ``self.conv1d`` in layers/mamba/gdn/qwen_gdn_linear_attn.py); checked
    against the layers vLLM builds by quantpack-exl3's ``test_layer_rules_vllm.py``.
    """
    return _unquantized(arch, architecture_layer(arch, config, i)[0])


def _unquantized(arch: str, required: tuple[str, ...]) -> tuple[str, ...]:
    """:func:`unquantized_layer_modules` of the layer whose required modules are ``required``."""
    dense_router = arch != "Qwen3MoeForCausalLM"
    return tuple(
        path
        for path in required
        if is_norm(path)
        or path in ("mlp.shared_expert_gate", "linear_attn.conv1d", *OWN_TENSORS)
        or (dense_router and path in ("mlp.gate", "block_sparse_moe.gate"))
    )


#: the fix where config.json's model class and the tensors disagree in every layer
WRONG_CLASS = (
    "config.json's architectures names another model than the tensors are of: use the config.json the pack was made "
    "with (or, where every other layer holds it, the pack is incomplete: re-download it)"
)
#: config.json's settings that give vLLM's layers a bias or take it away (:func:`architecture_layer`), all set
_ALL_BIAS = {"attention_bias": True, "bias": True, "qkv_bias": True, "mlp_bias": True}


#: rotary tables vLLM's loaders skip (``AutoWeightsLoader.ROTARY_EMBEDS_UNUSED_WEIGHTS``, and a vision rotary's)
_ROTARY_TABLES = frozenset({"inv_freq", "cos_cached", "sin_cached"})


def stated_class(config: dict) -> str | None:
    """The model class vLLM builds for ``config`` (config.json, or vLLM's built config as a dict) where it is one of
    :data:`KNOWN_LAYERS`, else None. vLLM builds the first class of ``architectures`` it has
    (``ModelRegistry.inspect_model_cls``); every class of :data:`KNOWN_LAYERS` is one of vLLM's own, so a known first
    class is the one it builds, and after another one it cannot be told here."""
    names = config.get("architectures") if isinstance(config, dict) else None
    return names[0] if isinstance(names, list) and names and names[0] in KNOWN_LAYERS else None


def skipped_by_vllm(path: str, own: set[str]) -> bool:
    """Whether vLLM's loaders pass over module ``path`` of a layer holding tensors ``own`` instead of failing on it:
    a rotary embedding's cached tables (``rotary_emb`` / ``rotary_pos_emb``), and a module holding only scales (KV
    cache and activation scales, which vLLM maps to its attention layer or ignores: ``self_attn.k_scale``,
    ``self_attn.attn.k_scale``, ``self_attn.k_cache.scale``)."""
    if path.rsplit(".", 1)[-1] in ("rotary_emb", "rotary_pos_emb"):
        return bool(own) and own <= _ROTARY_TABLES
    return bool(own) and all("scale" in t for t in own)


def _uncovered_root(path: str, covered: tuple[str, ...]) -> str:
    """The shortest leading part of module path ``path`` that is neither one of ``covered`` nor a parent of one
    (``mlp.experts`` of ``mlp.experts.3.gate_proj`` where only ``mlp.gate_proj`` ... are covered): one problem for a
    stray bank, not one per expert."""
    parts = path.split(".")
    for n in range(1, len(parts) + 1):
        head = ".".join(parts[:n])
        if not any(_within(c, head) for c in covered):
            return head
    return path


def architecture_problems(
    stacks: dict[str, dict[int, list]], tensors: dict[str, set[str]], config: dict
) -> list[Problem]:
    """The decoder layers against the layer vLLM builds for config.json's model class (:func:`architecture_layer`,
    :data:`KNOWN_LAYERS` only), whatever the layer count: a module it loads into missing from a layer (a Qwen3
    layer's q_norm, vLLM would serve its initial ones without a word; the layout rules above need more layers to see
    it), a module of another family's layer (a Qwen3 q_norm in a Llama pack) or any other module vLLM's layer does
    not have (its loader stops in the worker; rotary tables and scales excepted, which vLLM skips or maps), a module
    of the layer holding no weight (a q_norm with a bias only: vLLM loads nothing into it), a bias where vLLM's
    layer has none (on a projection, a norm, a router or an expert: vLLM's loaders drop unexpected biases without a
    word) or none where it has one (served uninitialized), a module vLLM builds without the quantization config
    stored quantized (:func:`unquantized_layer_modules`: a trellis router of Mixtral, whose loader stops in the
    worker). A module missing from every layer, and a stray module or bias in any, mean the class does not match the
    tensors; each is one problem naming the first layer and the count. Also Qwen MoE settings vLLM cannot build a
    model from (a sparse step below 1; for Qwen3-MoE and Qwen3-Next, no MoE layer at all), and a module's own tensor
    vLLM loads into (:data:`OWN_TENSORS`: the Gated DeltaNet's A_log and dt_bias) that it lacks. Only the first
    class of ``architectures`` is read: vLLM builds the first it has, and every class of :data:`KNOWN_LAYERS` is
    vLLM's own.

    Args:
        stacks: :func:`decoder_layers`'s grouping (its ``model.layers.`` stack is checked).
        tensors: every module key of the pack with the names of its tensors (``{"...q_proj": {"trellis", "bias"}}``);
            with EAGLE's ``fc`` outside the layers (:data:`DRAFT_FUSION`: a draft, whose first layer vLLM builds
            without ``input_layernorm``), that norm is not required of the first layer.
        config: config.json.

    Returns:
        The problems, one per module (or per module path, where it is the class).
    """
    arch = stated_class(config)
    layers = stacks.get("model.layers.")
    if arch is None or not layers:
        return []
    out: list[Problem] = []
    plan = qwen_moe_plan(config) if arch in QWEN_MOE else None
    unplanned = arch in QWEN_MOE and plan is None
    if arch in QWEN_MOE:
        fix = "use the config.json the pack was made with"
        if plan is None and not moe_plan_unknown(config):
            what = (
                f"num_local_experts / num_experts {config.get('num_local_experts', config.get('num_experts'))!r}, "
                f"decoder_sparse_step {config.get('decoder_sparse_step')!r}, mlp_only_layers "
                f"{config.get('mlp_only_layers')!r}: vLLM's {arch} cannot plan its layers from them "
                "(integers, a step of at least 1, a list)"
            )
            out.append(Problem("", "config.json", what, fix))
        elif plan is not None and arch != "Qwen2MoeForCausalLM" and not any(qwen_moe_sparse(plan, i) for i in layers):
            what = (
                f"no layer is an MoE layer (num_local_experts / num_experts {plan[0]}, decoder_sparse_step {plan[1]}, "
                f"mlp_only_layers {plan[2]}): vLLM's {arch} stops in the worker without one"
            )
            out.append(Problem("", "config.json", what, fix))
    # an EAGLE-1 draft published as LlamaForCausalLM (its fc outside the layers): vLLM builds it as a draft, whose
    # first layer has no input_layernorm
    draft = any(not LAYER_KEY.search(k) and k.rsplit(".", 1)[-1] == DRAFT_FUSION for k in tensors)
    unknown: dict[str, list[int]] = {}
    lacking: dict[str, list[int]] = {}
    stray: dict[str, list[int]] = {}
    biased: dict[tuple[str, bool], list[int]] = {}
    first_wrong: dict[tuple[str, bool], str] = {}  # the first module of each biased entry: an expert of a bank
    weightless: dict[str, list[int]] = {}
    unheld: dict[tuple[str, str], list[int]] = {}  # a module's own tensor (OWN_TENSORS) it lacks
    coded: dict[str, list[int]] = {}  # a module vLLM builds without the quantization config, stored quantized
    for i, paths in sorted(layers.items()):
        required, absent, bias = architecture_layer(arch, config, i)
        if not required:  # a layer the project does not state (Mistral's with a time-conditioned norm)
            continue
        for path in _unquantized(arch, required):
            if tensors.get(f"model.layers.{i}.{path}", set()) & QUANTIZED_TENSORS:
                coded.setdefault(path, []).append(i)
        parents = {path.rsplit(".", n)[0] for path in paths for n in range(1, path.count(".") + 1)}
        for need in required:
            if draft and i == min(layers) and need == "input_layernorm":
                continue
            held_here = [p for p in paths if _within(p, need)]
            if not held_here:
                lacking.setdefault(need, []).append(i)
            for path in held_here:
                own = tensors.get(f"model.layers.{i}.{path}")
                if path not in parents and own is not None and not own & WEIGHT_TENSORS:
                    weightless.setdefault(path, []).append(i)
            if held_here and need in OWN_TENSORS:
                own = tensors.get(f"model.layers.{i}.{need}", set())
                for name in OWN_TENSORS[need]:
                    if name not in own:
                        unheld.setdefault((need, name), []).append(i)
        for other in absent:
            if any(_within(p, other) for p in paths):
                stray.setdefault(other, []).append(i)
        # each module of the layer under the required module it lies closest below (an expert under mlp.experts, a
        # Gated DeltaNet's conv1d under linear_attn.conv1d, not linear_attn); anything under none and outside the
        # other families' modules is a module vLLM's layer does not have (its loader raises "There is no module or
        # parameter named ..."), but rotary tables, which vLLM's loaders skip, and an MLP whose plan the config
        # cannot give
        covered = (*required, *absent, *(("mlp",) if unplanned else ()))
        owned: dict[str, list[str]] = {}
        for path in paths:
            owner = max((r for r in required if _within(path, r)), key=len, default=None)
            if owner is not None:
                owned.setdefault(owner, []).append(path)
            elif not any(_within(path, c) for c in covered) and not skipped_by_vllm(
                path, tensors.get(f"model.layers.{i}.{path}", set())
            ):
                held = unknown.setdefault(_uncovered_root(path, covered), [])
                if not held or held[-1] != i:  # layers come in order
                    held.append(i)
        for path, has in bias.items():
            # the modules it owns each: all biased where vLLM's has one, none where it has none
            held = {p: tensors.get(f"model.layers.{i}.{p}", set()) for p in owned.get(path, ())}
            wrong = [p for p, t in held.items() if ("bias" in t) != has]
            if wrong:
                biased.setdefault((path, has), []).append(i)
                first_wrong.setdefault((path, has), f"model.layers.{i}.{wrong[0]}")

    def shown(idx: list[int]) -> str:
        return ", ".join(map(str, idx[:8])) + (f" ... ({len(idx)} in all)" if len(idx) > 8 else "")

    for need, idx in lacking.items():
        if len(idx) == len(layers) and len(layers) > 1:
            what = f"no decoder layer holds {need}, which every layer of vLLM's {arch} has"
            out.append(Problem(f"model.layers.{idx[0]}.{need}", f"model.layers.{idx[0]}.{need}.*", what, WRONG_CLASS))
            continue
        for i in idx:
            what = f"layer {i} holds no {need}, which every layer of vLLM's {arch} has"
            out.append(Problem(f"model.layers.{i}.{need}", f"model.layers.{i}.{need}.*", what, FIX))
    for (path, name), idx in unheld.items():
        key = f"model.layers.{idx[0]}.{path}"
        what = (
            f"layer(s) {shown(idx)}: {path} holds no {name}, which vLLM's {arch} loads into a parameter of its own: "
            "it would serve that parameter's initial values without a word"
        )
        out.append(Problem(key, f"{key}.{name}", what, FIX))
    for path, idx in weightless.items():
        key = f"model.layers.{idx[0]}.{path}"
        what = (
            f"layer(s) {shown(idx)}: {path} holds {', '.join(sorted(tensors[key]))} but no weight (nor a trellis): "
            "vLLM loads nothing into it and would serve its initial values without a word"
        )
        out.append(Problem(key, f"{key}.weight", what, FIX))
    for path, idx in coded.items():
        key = f"model.layers.{idx[0]}.{path}"
        held = sorted(tensors[key] & QUANTIZED_TENSORS)
        what = (
            f"layer(s) {shown(idx)}: {path} is stored quantized ({', '.join(held)}), but vLLM's {arch} builds it "
            "without the quantization config, so it loads a dense weight only: vLLM's loader stops in the worker "
            '("There is no module or parameter named ...")'
        )
        out.append(Problem(key, f"{key}.{held[0]}", what, FIX_DENSE))
    for other, idx in stray.items():
        what = (
            f"layer(s) {shown(idx)} hold {other}, which vLLM's {arch} has no place for (another family's layer holds "
            "one): vLLM's loader stops in the worker"
        )
        out.append(Problem(f"model.layers.{idx[0]}.{other}", f"model.layers.{idx[0]}.{other}.*", what, WRONG_CLASS))
    for path, idx in unknown.items():
        what = (
            f"layer(s) {shown(idx)} hold {path}, which vLLM's {arch} layer has no module for: its loader stops in the "
            'worker ("There is no module or parameter named ...") or, in some releases, passes over it'
        )
        out.append(Problem(f"model.layers.{idx[0]}.{path}", f"model.layers.{idx[0]}.{path}.*", what, WRONG_CLASS))
    for (path, has), idx in biased.items():
        key = first_wrong[path, has]
        if has and architecture_layer(arch, {**config, **dict.fromkeys(_ALL_BIAS, False)}, idx[0])[2].get(path):
            what = (
                f"layer(s) {shown(idx)}: {path} holds no bias, but vLLM's {arch} always gives it one: it would serve "
                "an uninitialized bias"
            )
            fix = "vLLM cannot serve this pack as it is (a model of another class, or one without the bias vLLM's has)"
        elif has:
            what = (
                f"layer(s) {shown(idx)}: {path} holds no bias, but vLLM's {arch} gives it one (config.json's "
                "attention / qkv bias settings): it would serve an uninitialized bias"
            )
            fix = "use the config.json the pack was made with (its bias settings and architectures)"
        elif architecture_layer(arch, {**config, **_ALL_BIAS}, idx[0])[2].get(path):
            what = (
                f"layer(s) {shown(idx)}: {path} holds a bias, but vLLM's {arch} gives it none (config.json's attention "
                "/ qkv / mlp bias settings): vLLM would drop it without a word"
            )
            fix = "use the config.json the pack was made with (its bias settings and architectures)"
        else:
            what = (
                f"layer(s) {shown(idx)}: {path} holds a bias, and vLLM's {arch} has none there whatever config.json "
                "says: vLLM would drop it without a word"
            )
            fix = (
                "vLLM cannot serve this pack as it is (a model of another class, or one whose bias vLLM's class lacks)"
            )
        out.append(Problem(key, f"{key}.bias", what, fix))
    return out
