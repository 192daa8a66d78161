"""The module layout of a pack's decoder layers: modules that cannot be absent given the modules present.

For a quantized model vLLM does not check that every parameter was loaded (``DefaultModelLoader.load_weights``
checks only unquantized models), so a module missing from a pack reaches the worker process: quantpack's linear
method refuses it there (``LayerLoadError``: "no tensor of this layer was loaded", "a shard missing"), behind vLLM's
"Engine core initialization failed". The pack check (:mod:`quantpack_core.check`) reports the same absence in the
user's process first, through the rules here. They only state what holds for every architecture the project knows
(docs/families.md, and vLLM's model files for the others), so a sound pack is never refused:

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

The layers of the model classes whose layer the project states are held against that layer by
:mod:`quantpack_core.check.architectures`; whole layers missing and per-layer norms by :mod:`.config`; experts of an
expert bank by :mod:`.moe` (docs/moe-bank.md).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Container, Iterable

from ..errors import Problem

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
#: layer keys that belong to another stack than the model's decoder layers (MTP heads, vision towers, drafts)
OTHER_STACKS = re.compile(r"(^|\.)(mtp|vision_tower|vision_model|visual|vision|audio_tower|draft)\.")


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


#: the fix where a module vLLM loads a dense weight into is stored quantized
FIX_DENSE = (
    "store this module as a dense float16 / bfloat16 weight, as exllamav3's converter does (it keeps norms, routers "
    "and gates dense): re-convert the pack, or re-download it if it was altered"
)


def is_norm(path: str) -> bool:
    """Whether module path ``path`` names a norm (its last name holds ``norm``: ``input_layernorm``, ``q_norm``,
    ``model.norm``, ``linear_attn.norm``). No vLLM model builds such a module with the quantization config: every
    norm is an RMSNorm / LayerNorm that loads a dense weight only (vLLM 0.32's model files name no linear layer so)."""
    return "norm" in path.rsplit(".", 1)[-1]


#: rotary tables vLLM's loaders skip (``AutoWeightsLoader.ROTARY_EMBEDS_UNUSED_WEIGHTS``, and a vision rotary's)
_ROTARY_TABLES = frozenset({"inv_freq", "cos_cached", "sin_cached"})


def skipped_by_vllm(path: str, own: set[str]) -> bool:
    """Whether vLLM's loaders pass over module ``path`` of a layer holding tensors ``own`` instead of failing on it:
    a rotary embedding's cached tables (``rotary_emb`` / ``rotary_pos_emb``), and a module holding only scales (KV
    cache and activation scales, which vLLM maps to its attention layer or ignores: ``self_attn.k_scale``,
    ``self_attn.attn.k_scale``, ``self_attn.k_cache.scale``)."""
    if path.rsplit(".", 1)[-1] in ("rotary_emb", "rotary_pos_emb"):
        return bool(own) and own <= _ROTARY_TABLES
    return bool(own) and all("scale" in t for t in own)
