"""config.json against itself and the tensors, before vLLM builds the model from it: the quantization config's
method (:func:`method_problems`) and bit counts (:func:`bits_problems`); ``architectures``, the sizes vLLM reads,
the settings vLLM takes without a check and then serves NaN with or stops on (norm epsilons, RoPE, experts per token,
the activation), the decoder layers the config counts against those the pack holds, and a norm most layers hold
(:func:`config_problems`); the heads against the key-value heads (:func:`head_count_problems`).
"""

from __future__ import annotations

import math
import re
import sys

from ..errors import Problem
from ..format import pack_formats
from ..inventory import DENSE, MANIFEST_FILE, PackView
from .architectures import BY_CLASS, activation_rule, stated_class
from .base import configured_experts, with_article
from .layers import OTHER_STACKS
from .settings import CheckSettings

#: the fix of a config.json that contradicts itself or the tensors
FIX_CONFIG = "use the config.json the pack was made with (re-download the pack)"
#: config.json sizes that must be positive integers where they are given (num_experts may be 0: a dense model)
CONFIG_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "head_dim",
    "moe_intermediate_size",
    "num_experts_per_tok",
)
#: sizes 0 is a legal value of (a dense model: Granite 4.0's dense variants say num_experts_per_tok 0)
ZERO_SIZES = frozenset({"num_experts", "num_experts_per_tok"})
#: sizes a config may give per layer or per modality as a list (Gemma 3n's intermediate_size, ERNIE-4.5-VL's
#: moe_intermediate_size)
LIST_SIZES = frozenset({"intermediate_size", "moe_intermediate_size"})
#: config.json's norm epsilons (Llama's rms_norm_eps, OPT's / Phi's layer_norm_eps, Falcon's
#: layer_norm_epsilon, Mistral-format norm_eps)
EPSILONS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")
#: RoPE types vLLM's ``get_rope`` builds (vllm/model_executor/layers/rotary_embedding/__init__.py: the union of
#: 0.22.1's to 0.32's; 0.22 has ``xdrope``, 0.29 ``telechat3-yarn``, 0.32 ``bailing_mrope``), and the legacy
#: names vLLM's config patch renames (``su``: longrope, ``mrope``: default, ``telechat3-yarn``: yarn from 0.31).
#: Another name, or null, stopped vLLM in the worker: "Unknown RoPE scaling type".
ROPE_TYPES = frozenset(
    {
        "default",
        "linear",
        "dynamic",
        "ntk",
        "yarn",
        "deepseek_yarn",
        "deepseek_llama_scaling",
        "longrope",
        "llama3",
        "mllama4",
        "proportional",
        "openpangu",
        "xdrope",
        "bailing_mrope",
        "telechat3-yarn",
        "su",
        "mrope",
    }
)
#: the largest RoPE base taken: vLLM computes its inverse frequencies as ``1 / base ** (2i / d)`` in floating point,
#: and a base past a float64 (an integer of 30 digits already: an OverflowError in its rotary embedding) stops it;
#: published models use up to about 1e8, and above 1e12 the slowest pairs of a 128-wide head turn less than a
#: float32 step per position (a damaged config, not a longer context)
ROPE_BASE_LIMIT = 1e12
#: the most positions taken: vLLM builds its RoPE cos / sin cache for max_position_embeddings positions, float32
#: on every GPU (2**27 positions of a 128-wide head: 64 GiB), and a larger one does not fit
MAX_POSITIONS = 2**27
#: the widest sliding window taken: vLLM's attention backends hold the window in a signed 32-bit integer
MAX_WINDOW = 2**31 - 1
#: config.json settings vLLM's config parser (transformers' typed config classes) refuses as null
NOT_NULL = ("hidden_size", "vocab_size", "num_hidden_layers", "hidden_act")
#: the fix of a setting vLLM reads and the reference of ``quantpack verify`` does not
FIX_UNVERIFIED = "use the config.json the pack was made with, or remove {key} from it"
#: config.json's names of the RoPE base and of the rotated fraction of a head (vLLM's ``patch_rope_parameters``
#: reads the alternatives of older model files)
ROPE_BASES = ("rope_theta", "rotary_emb_base")
ROTARY_FRACTIONS = ("partial_rotary_factor", "rotary_pct", "rotary_emb_fraction")


def _number(v) -> bool:
    """Whether ``v`` is a finite number (a JSON integer of hundreds of digits too: no float of it is taken)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and (isinstance(v, int) or math.isfinite(v))


def _integer(v) -> bool:
    """Whether ``v`` is an integer (not a bool)."""
    return isinstance(v, int) and not isinstance(v, bool)


def bits_problems(pack: PackView, settings: CheckSettings) -> list[Problem]:
    """The quantization config's ``bits`` / ``head_bits`` where config.json gives them as other than a bit count in
    (0, 16] (exllamav3 writes numbers; vLLM's config would stop at another value)."""
    out: list[Problem] = []
    for key in ("bits", "head_bits"):
        v = pack.stated_quant_config.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 16):
            what = f"{key} is {repr(v)[:40]}, not a bit count in (0, 16]"
            out.append(
                Problem("", "config.json: quantization_config", what, "use the config.json the pack was made with")
            )
    return out


def method_problems(pack: PackView, settings: CheckSettings) -> list[Problem]:
    """config.json's ``quant_method`` where it is not the method asked for (:attr:`CheckSettings.method`): vLLM
    reads the method from config.json only, so one given by quantization_config.json alone does not count."""
    if settings.method is None or not pack.config or pack.config_method == settings.method:
        return []
    said = (
        f"says quantization_config.quant_method {pack.config_method!r}"
        if pack.config_method
        else "has no quantization_config.quant_method"
    )
    fmt = pack_formats().get(settings.method)
    if not pack.config_method and str(pack.quant_config.get("quant_method", "")).lower() == settings.method:
        fix = (
            f"copy the quantization_config of {MANIFEST_FILE} (without tensor_storage) into config.json: "
            "vLLM reads the method from config.json only"
        )
    elif fmt is not None:
        fix = f"point at {with_article(fmt.label)} pack (made by {fmt.writer})"
    else:
        fix = f"point at a {settings.method} pack"
    return [Problem("", "config.json", f"{said}, not {settings.method!r}", fix)]


def text_config(pack: PackView) -> dict:
    """The config the language model's sizes are read from: config.json's ``text_config`` where it is a non-empty
    object, else config.json."""
    text = pack.config.get("text_config")
    return text if isinstance(text, dict) and text else pack.config


def config_sizes(pack: PackView) -> tuple[dict[str, int], list[Problem]]:
    """The sizes of :data:`CONFIG_SIZES` (and ``num_experts``) the language model's config (:func:`text_config`) gives
    as vLLM reads them, and a problem for each size of config.json or its text config that is not an integer above
    its least value (0 for :data:`ZERO_SIZES`; a list of them for :data:`LIST_SIZES`, which ``sizes`` leaves out)."""
    cfg, text = text_config(pack), pack.config.get("text_config")
    sizes: dict[str, int] = {}
    out: list[Problem] = []
    for where, c in (("config.json", pack.config), ("config.json: text_config", text)):
        if not isinstance(c, dict):
            continue
        for key in NOT_NULL:
            if key in c and c[key] is None:
                what = f"{key} is null: vLLM's config parser refuses the model"
                out.append(Problem("", where, what, FIX_CONFIG))
        for key in (*CONFIG_SIZES, "num_experts"):
            v = c.get(key)
            if v is None:
                continue
            low = 0 if key in ZERO_SIZES else 1
            per_layer = key in LIST_SIZES and isinstance(v, list) and v
            values = v if per_layer else [v]
            if any(isinstance(x, bool) or not isinstance(x, int) or x < low for x in values):
                kind = "an integer" + (" or a list of them" if key in LIST_SIZES else "")
                what = f"{key} is {repr(v)[:60]} ({type(v).__name__}), not {kind} >= {low}"
                out.append(Problem("", where, what, FIX_CONFIG))
            elif c is cfg and not per_layer:
                sizes[key] = v
    return sizes, out


def config_problems(pack: PackView, settings: CheckSettings) -> list[Problem]:
    """config.json against itself and the tensors: ``architectures`` a non-empty list of names; the sizes vLLM
    reads positive integers (:func:`config_sizes`); the settings vLLM takes without a check (:func:`_value_problems`,
    :func:`_built_problems`); every decoder layer the config counts present in the pack (a layer missing from both
    the files and the manifest would otherwise fail in vLLM's worker; DeciLM's blocks whose attention and FFN are
    both no-ops store none), no layer past the count, and the norms most layers hold in every layer."""
    if not pack.config:
        return []
    out: list[Problem] = []
    arch = pack.config.get("architectures")
    if not (isinstance(arch, list) and arch and all(isinstance(a, str) and a for a in arch)):
        out.append(
            Problem("", "config.json", f"architectures is {arch!r}, not a list of model class names", FIX_CONFIG)
        )
    sizes, found = config_sizes(pack)
    out += found + _value_problems(pack, text_config(pack), sizes) + _built_problems(settings.built(pack.config))
    return out + _layer_count_problems(pack, text_config(pack), sizes.get("num_hidden_layers"))


def _value_problems(pack: PackView, cfg: dict, sizes: dict[str, int]) -> list[Problem]:
    """config.json's settings whose value vLLM takes without a check and then serves NaN with, or stops on at the
    first request: a norm epsilon that is not a number strictly between 0 and 1 (negative, NaN or 1e30 gave NaN or
    garbage logits), a RoPE base (``rope_theta``, top level or in ``rope_parameters``, per layer type too) that is
    not a positive finite number (NaN logits), and, for a model with experts, ``num_experts_per_tok`` outside 1 ..
    the expert count (vLLM's router stopped on the first request: "selected index k out of range"; 0 with 8 experts
    killed the process with SIGFPE)."""
    out: list[Problem] = []

    def number(v) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    for key in EPSILONS:
        v = cfg.get(key)
        if v is not None and not (number(v) and 0 < v < 1):  # "x", true, []: vLLM's config parser refuses them
            what = f"{key} is {repr(v)[:40]}, not a number between 0 and 1"
            out.append(Problem("", "config.json", what, FIX_CONFIG))
    for where, d in rope_settings(cfg):
        v = d.get("rope_theta")
        if number(v) and not (v > 0 and (isinstance(v, int) or math.isfinite(v))):
            out.append(Problem("", "config.json", f"{where}rope_theta is {v!r}, not a positive number", FIX_CONFIG))
        for key in ROPE_BASES:
            v = d.get(key)
            if number(v) and v > ROPE_BASE_LIMIT:
                what = (
                    f"{where}{key} is {repr(v)[:40]}, above {ROPE_BASE_LIMIT:g}: vLLM's rotary embedding cannot "
                    "build its frequencies from it (an OverflowError past a float64)"
                )
                out.append(Problem("", "config.json", what, FIX_CONFIG))
    experts = configured_experts(pack)
    topk = sizes.get("num_experts_per_tok")
    if experts and topk is not None and not 1 <= topk <= experts:
        what = f"num_experts_per_tok is {topk}, but a token can pick 1 to {experts} experts (the expert count)"
        out.append(Problem("", "config.json", what, FIX_CONFIG))
    return out


def rope_settings(cfg: dict) -> list[tuple[str, dict]]:
    """The dicts of config ``cfg`` that hold RoPE settings, each with the prefix its keys are named by in a message:
    the config itself (``""``), ``rope_parameters`` / ``rope_scaling`` (``"rope_scaling."``), or each layer type's
    dict of a nested one (``"rope_parameters.full_attention."``: vLLM's ``is_rope_parameters_nested``, dicts under
    layer-type keys, null ones skipped)."""
    out: list[tuple[str, dict]] = [("", cfg)]
    for key in ("rope_parameters", "rope_scaling"):
        v = cfg.get(key)
        if isinstance(v, dict):
            nested = [(f"{key}.{k}.", d) for k, d in v.items() if isinstance(d, dict)]
            per_type = nested and all(isinstance(d, dict) or d is None for d in v.values())
            out += nested if per_type else [(f"{key}.", v)]
    return out


def _built_problems(built: dict) -> list[Problem]:
    """Settings of the config vLLM builds (its text part: after ``--hf-overrides``) that vLLM takes without a check
    in the user's process and then stops on in the worker: a RoPE type ``get_rope`` does not build, a RoPE base or
    rotated fraction that is no number or no fraction (:func:`_rope_problems`); for the stated classes
    (:data:`~quantpack_core.check.architectures.KNOWN_LAYERS`), a fraction that rotates an odd number of a head's
    features (:func:`_fraction_problems`) and an activation their MLP is not built with
    (:func:`~quantpack_core.check.architectures.activation_rule`)."""
    text = built.get("text_config") if isinstance(built, dict) else None
    cfg = text if isinstance(text, dict) and text else built if isinstance(built, dict) else {}
    rope_sets = rope_settings(cfg)
    out, fractions = _rope_problems(rope_sets)
    bounds = _bound_problems(cfg)
    out += bounds
    arch = stated_class(built)
    if arch is None:
        return out
    out += _fraction_problems(arch, cfg, rope_sets, fractions)
    out += _unverified_problems(arch, cfg, {p.what.split(" ", 1)[0] for p in bounds})
    rule = activation_rule(arch, cfg)
    act = cfg.get(rule.key) if rule else None
    if act is not None and not rule.takes(act):
        what = f"{rule.key} is {act!r}, but vLLM's {arch} builds its MLP with {' / '.join(sorted(rule.allowed))} only"
        out.append(Problem("", "config.json", what, FIX_CONFIG))
    return out


#: integer settings vLLM takes in the user's process and then stops on: key, upper end, the message's words before
#: "an integer", and what vLLM does with the value (null means "none" for each of them)
INTEGER_BOUNDS = (
    ("max_position_embeddings", MAX_POSITIONS, "not ", "vLLM builds its RoPE cache for that many positions"),
    ("sliding_window", MAX_WINDOW, "neither null nor ", "vLLM's attention holds the window in a 32-bit integer"),
)


def _bound_problems(cfg: dict) -> list[Problem]:
    """Settings of the config vLLM builds that it takes in the user's process and then stops on (or serves garbage
    with): ``logit_scale`` that is no finite float64 above 0 (every logit is multiplied by it), and each setting of
    :data:`INTEGER_BOUNDS` (``max_position_embeddings`` up to :data:`MAX_POSITIONS`, ``sliding_window`` up to
    :data:`MAX_WINDOW`) that is neither null nor an integer in 1 .. its upper end."""
    out: list[Problem] = []
    scale = cfg.get("logit_scale")
    if "logit_scale" in cfg and not (_number(scale) and 0 < scale <= sys.float_info.max):
        what = f"logit_scale is {repr(scale)[:40]}, not a finite number > 0: vLLM multiplies every logit by it"
        out.append(Problem("", "config.json", what, FIX_CONFIG))
    for key, most, accepted, effect in INTEGER_BOUNDS:
        v = cfg.get(key)
        if v is not None and not (_integer(v) and 1 <= v <= most):
            what = f"{key} is {repr(v)[:40]}, {accepted}an integer in 1 .. {most:,}: {effect}"
            out.append(Problem("", "config.json", what, FIX_CONFIG))
    return out


def _unverified_problems(arch: str, cfg: dict, refused: set[str]) -> list[Problem]:
    """The settings vLLM's model class ``arch`` reads that transformers' class has none of
    (:attr:`~quantpack_core.check.architectures.base.Architecture.unverified`), given another than their neutral value
    (``logit_scale`` other than 1, a ``sliding_window`` for Llama): ``quantpack verify``'s reference ignores them, so
    vLLM would serve other logits than every check saw. Not the keys of ``refused`` (named as malformed already)."""
    out: list[Problem] = []
    for setting in BY_CLASS[arch].unverified:
        v = cfg.get(setting.key)
        if setting.key in cfg and setting.key not in refused and not setting.neutral(v):
            what = (
                f"{setting.key} is {repr(v)[:60]}: {setting.effect}, while transformers' {arch} (the reference "
                "quantpack verify compares with) has no such setting"
            )
            out.append(Problem("", "config.json", what, FIX_UNVERIFIED.format(key=setting.key)))
    return out


def _rope_problems(rope_sets: list[tuple[str, dict]]) -> tuple[list[Problem], list[tuple[str, float]]]:
    """A RoPE type ``get_rope`` does not build (top level, in ``rope_parameters`` / ``rope_scaling``, per layer type
    too); a RoPE base or rotated fraction that is no number (``"10000"``: a TypeError in ``get_rope``); a rotated
    fraction outside (0, 1] (``get_rope`` raises). Returns the problems and the fractions in (0, 1], each with where
    the config gives it (one problem per value)."""
    out: list[Problem] = []
    fractions: list[tuple[str, float]] = []
    seen_fractions: list = []
    absent = object()
    for where, d in rope_sets:
        kind_key = "rope_type" if "rope_type" in d else "type"
        kind = d.get(kind_key, absent) if where else absent
        if kind is not absent and not (isinstance(kind, str) and kind in ROPE_TYPES):
            known = ", ".join(sorted(ROPE_TYPES))
            what = f"{where}{kind_key} is {repr(kind)[:60]}: vLLM builds no such RoPE (it knows {known})"
            out.append(Problem("", "config.json", what, FIX_CONFIG))
        for key in ROPE_BASES:  # (a number that is no positive finite one: _value_problems)
            v = d.get(key)
            # Step-3.5 gives one base per layer (its model file picks rope_theta[layer_idx])
            per_layer = isinstance(v, list) and v and all(_number(x) for x in v)
            if v is not None and not (_number(v) or per_layer):
                out.append(Problem("", "config.json", f"{where}{key} is {repr(v)[:60]}, not a number", FIX_CONFIG))
        for key in ROTARY_FRACTIONS:
            v = d.get(key)
            if v is None or any(v == seen for seen in seen_fractions):  # one problem per value
                continue
            seen_fractions.append(v)
            if not _number(v) or not 0 < v <= 1:
                out.append(
                    Problem("", "config.json", f"{where}{key} is {repr(v)[:60]}, not a number in (0, 1]", FIX_CONFIG)
                )
            else:
                fractions.append((f"{where}{key}", v))
    return out, fractions


def _fraction_problems(
    arch: str, cfg: dict, rope_sets: list[tuple[str, dict]], fractions: list[tuple[str, float]]
) -> list[Problem]:
    """A rotated fraction that rotates an odd number of a head's features, or fewer than 2 (vLLM's rotary tables
    then disagree with the rotated width: a shape error, and on CPU a crash of the process); not where a
    ``rope_dim`` says the width."""
    head_dim = cfg.get("head_dim")
    hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    if head_dim is None and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (hidden, heads)):
        head_dim = hidden // heads
    if not (isinstance(head_dim, int) and not isinstance(head_dim, bool) and 0 < head_dim < 1 << 31):
        return []
    out: list[Problem] = []
    for where, v in fractions:
        if any(d.get("rope_dim") for w, d in rope_sets if w):  # vLLM then rotates rope_dim features
            continue
        rotated = int(head_dim * v)
        if rotated < 2 or rotated % 2:
            what = (
                f"{where} is {v!r}: it rotates {rotated} of a head's {head_dim} features, and vLLM's {arch} "
                "rotates features in pairs"
            )
            out.append(Problem("", "config.json", what, FIX_CONFIG))
    return out


def _layer_count_problems(pack: PackView, cfg: dict, layers: int | None) -> list[Problem]:
    """A layer index of more than 9 digits; the layers ``num_hidden_layers`` counts that the pack holds no tensor of;
    a norm most layers hold missing from some (:func:`_layer_norm_problems`); layers past the count (DeepSeek's
    multi-token-prediction layers follow the decoder's as ``model.layers.<num_hidden_layers + i>``; vLLM's loader
    finds no module for any other and stops in the worker)."""
    out, present = _held_layers(pack)
    # DeciLM (Nemotron Ultra / Super): a block whose attention and FFN are both no-ops stores no tensor
    blocks = cfg.get("block_configs")
    empty = set()
    for i, b in enumerate(blocks if isinstance(blocks, list) else ()):
        if isinstance(b, dict) and all(
            isinstance(b.get(part), dict) and b[part].get("no_op") is True for part in ("attention", "ffn")
        ):
            empty.add(i)
    present |= empty
    if layers is None:
        return out
    if present:
        out += _missing_layer_problems(layers, present)
    if not isinstance(blocks, list):
        out += _layer_norm_problems(pack, layers)
    nextn = cfg.get("num_nextn_predict_layers")
    nextn = nextn if isinstance(nextn, int) and not isinstance(nextn, bool) and nextn > 0 else 0
    extra = sorted(i for i in present - empty if i >= layers + nextn)
    if extra:
        shown = ", ".join(map(str, extra[:8])) + (f" ... ({len(extra)} in all)" if len(extra) > 8 else "")
        first = next(k for k in sorted(pack.modules) if re.search(rf"(?:^|\.)layers\.{extra[0]}\.", k))
        what = (
            f"holds tensors of layer(s) {shown} ({first}, ...), past config.json's num_hidden_layers {layers}"
            + (f" + num_nextn_predict_layers {nextn}" if nextn else "")
            + ": vLLM's loader has no module for them"
        )
        out.append(Problem("", "config.json", what, "remove those tensors from a copy of the pack, or " + FIX_CONFIG))
    return out


def _held_layers(pack: PackView) -> tuple[list[Problem], set[int]]:
    """The decoder layers (of the model's own stack) the pack holds tensors of, and a problem for each module whose
    layer index has more than 9 digits (one of thousands of digits would not even convert to an integer)."""
    out: list[Problem] = []
    present: set[int] = set()
    for key in pack.modules:
        m = re.search(r"(?:^|\.)layers\.(\d+)\.", key)
        if m and len(m.group(1)) > 9:
            what = f"a layer index of {len(m.group(1))} digits: no model has that many layers"
            short = f"{key[:60]}..."
            out.append(Problem(short, short, what, "the pack is damaged: re-download it"))
        elif m and not OTHER_STACKS.search(key[: m.start() + 1]):
            present.add(int(m.group(1)))
    return out, present


def _missing_layer_problems(layers: int, present: set[int]) -> list[Problem]:
    """The layers below ``layers`` the pack holds no tensor of (the first eight named, and the count)."""
    count = layers - len({i for i in present if i < layers})  # never materializes range(layers)
    missing, i = [], 0
    while len(missing) < min(count, 8):
        if i not in present:
            missing.append(i)
        i += 1
    if not count:
        return []
    shown = ", ".join(map(str, missing)) + (f" ... ({count} in all)" if count > len(missing) else "")
    what = f"num_hidden_layers is {layers}, but the pack holds no tensor of layer(s) {shown}"
    return [Problem("", "config.json", what, "the pack is incomplete (re-download it), or " + FIX_CONFIG)]


def _layer_norm_problems(pack: PackView, layers: int) -> list[Problem]:
    """A decoder layer without a norm (``layers.N.<...norm...>``, a dense module directly under the layer) that
    more than half of the stack's first ``layers`` layers hold: vLLM checks that every weight was loaded only for
    unquantized models (``DefaultModelLoader.load_weights``), so such a layer would serve with the norm's initial
    ones, silently wrong. DeciLM (``block_configs``, whose no-op blocks lack norms) is not checked here."""
    held: dict[tuple[str, str], set[int]] = {}
    stack_layers: dict[str, set[int]] = {}
    for key, m in pack.modules.items():
        found = re.search(r"(?:^|\.)layers\.(\d{1,9})\.(?:([^.]*norm[^.]*)$)?", key)
        if not found or OTHER_STACKS.search(key[: found.start() + 1]) or int(found.group(1)) >= layers:
            continue
        stack = key[: found.start(1)]
        stack_layers.setdefault(stack, set()).add(int(found.group(1)))
        if found.group(2) and m.format == DENSE:
            held.setdefault((stack, found.group(2)), set()).add(int(found.group(1)))
    out = []
    for (stack, norm), have in sorted(held.items()):
        lack = sorted(stack_layers[stack] - have)
        if lack and 2 * len(have) > len(stack_layers[stack]):
            shown = ", ".join(map(str, lack[:8])) + (f" ... ({len(lack)} in all)" if len(lack) > 8 else "")
            tensor = f"{stack}{lack[0]}.{norm}.weight"
            what = (
                f"layer(s) {shown} hold no {norm} while {len(have)} of the stack's {len(stack_layers[stack])} "
                "layers do: vLLM would serve them with the norm's initial ones, without a word"
            )
            out.append(Problem(f"{stack}{lack[0]}.{norm}", tensor, what, "the pack is incomplete: re-download it"))
    return out


def head_count_problems(pack: PackView, settings: CheckSettings) -> list[Problem]:
    """``num_attention_heads`` that is not a multiple of ``num_key_value_heads``: vLLM's attention shares each
    key-value head among a whole group of query heads and refuses the model in the worker (3 heads over 2: the shapes
    pad alike to 128, so the projection checks pass it)."""
    cfg = pack.config.get("text_config") if isinstance(pack.config.get("text_config"), dict) else pack.config
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (heads, kv)) or heads % kv == 0:
        return []
    what = (
        f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}: vLLM's attention gives each "
        "key-value head a whole group of query heads and refuses the model in the worker"
    )
    return [Problem("", "config.json", what, "use the config.json the pack was made with")]
