"""Stored shapes against config.json's sizes (stored sizes: a coded module's padded to whole blocks): the attention
projections against the heads, a dense MLP against ``intermediate_size``, the head and the hidden-state norms
against the vocabulary and ``hidden_size``, every module of a stated class's layers against the sizes vLLM builds it
with (:func:`~quantpack_core.check.architectures.layer_sizes`), the modules outside the layers a stated class loads,
and the token embedding table's width and rows. vLLM's loaders, or the plugins' geometry check, would stop on each
in the worker.
"""

from __future__ import annotations

import re

from ..codec.hadamard import HAD_BLOCK
from ..errors import Problem
from ..format import pack_formats
from ..inventory import DENSE, INT8_ROWS, OTHER, PackView
from .architectures import layer_sizes, stated_class
from .base import not_a_matrix, stored_size_problem
from .config import FIX_CONFIG, config_sizes, text_config
from .layers import DRAFT_FUSION, LAYER_KEY, OTHER_STACKS, skipped_by_vllm
from .settings import CheckSettings

#: the norms of a decoder layer over its hidden state (not q_norm / k_norm, which some models size per head and
#: others per head group), and the language model's final norm
HIDDEN_NORMS = re.compile(
    r"(?:^|\.)(?:layers\.\d+\.(?:input_layernorm|post_attention_layernorm|pre_feedforward_layernorm|"
    r"post_feedforward_layernorm)|model\.norm|model\.language_model\.norm)$"
)
#: the modules outside the decoder layers that vLLM's stated classes load (Qwen3-Next also drops ``mtp.*``: its
#: multi-token-prediction layers, which vLLM's model maps to nothing)
OUTSIDE_LAYERS = frozenset({"model.embed_tokens", "model.norm", "lm_head"})
#: (module path in a layer, side) the generic checks already hold against the config: k / v outputs, o inputs, a
#: dense MLP's intermediate side
GENERIC_SIDES = frozenset(
    {("self_attn.k_proj", 1), ("self_attn.v_proj", 1), ("self_attn.o_proj", 0), ("mlp.gate_proj", 1),
     ("mlp.up_proj", 1), ("mlp.down_proj", 0)}
)  # fmt: skip
#: a decoder layer's dense MLP projections (not an expert's, not a shared expert's)
DENSE_MLP = re.compile(r"\.mlp\.(gate_proj|up_proj|down_proj)$")
#: architecture name prefix -> rows its model adds to the embedding past vocab_size (Mllama's 8 image tokens:
#: transformers' and vLLM's mllama.py build ``vocab_size + 8`` rows)
ADDED_EMBEDDING_ROWS: dict[str, int] = {"Mllama": 8}


def shape_problems(pack: PackView, settings: CheckSettings) -> list[Problem]:
    """Every rule of this module, in order (nothing without a config.json)."""
    if not pack.config:
        return []
    cfg, (sizes, _) = text_config(pack), config_sizes(pack)
    out = _attention_problems(pack, sizes)
    out += _mlp_problems(pack, cfg, sizes)
    out += _head_and_norm_problems(pack, cfg, sizes)
    out += _stated_size_problems(pack, settings.built(pack.config))
    out += _outside_layer_problems(pack, settings.built(pack.config))
    return out + _embedding_problems(pack, cfg, sizes)


def _attention_problems(pack: PackView, sizes: dict[str, int]) -> list[Problem]:
    """Attention projections against the config's heads: k / v give ``num_key_value_heads x head_dim`` outputs,
    o takes ``num_attention_heads x head_dim`` inputs. q is left alone: gated attention (Qwen3-Next, Qwen3.5) stores
    twice its heads' width there."""
    heads = sizes.get("num_attention_heads")
    if heads is None:
        return []
    kv = sizes.get("num_key_value_heads", heads)
    head_dim = sizes.get("head_dim") or (sizes["hidden_size"] // heads if "hidden_size" in sizes else None)
    if not head_dim:
        return []
    out: list[Problem] = []
    for key, m in pack.modules.items():
        name = key.rsplit(".", 1)[-1]
        if m.padded_shape is None or ".self_attn." not in key or OTHER_STACKS.search(key):
            continue
        if name in ("k_proj", "v_proj"):
            side, want, what = 1, kv * head_dim, f"num_key_value_heads {kv} x head_dim {head_dim}"
        elif name == "o_proj":
            side, want, what = 0, heads * head_dim, f"num_attention_heads {heads} x head_dim {head_dim}"
        else:
            continue
        out.extend(stored_size_problem(m, side, want, f"{what} = {want}", FIX_CONFIG))
    return out


def _mlp_problems(pack: PackView, cfg: dict, sizes: dict[str, int]) -> list[Problem]:
    """A decoder layer's dense MLP against ``intermediate_size``: gate / up give that many outputs, down takes
    that many inputs. Skipped where the config sizes blocks one by one (DeciLM's ``block_configs``) or gives
    ``intermediate_size`` per layer (a list: not in ``sizes``)."""
    want = sizes.get("intermediate_size")
    if want is None or cfg.get("block_configs"):
        return []
    out: list[Problem] = []
    for key, m in pack.modules.items():
        found = DENSE_MLP.search(key)
        if not found or m.padded_shape is None or OTHER_STACKS.search(key):
            continue
        side = 0 if found.group(1) == "down_proj" else 1
        out.extend(stored_size_problem(m, side, want, f"intermediate_size {want}", FIX_CONFIG))
    return out


def _head_and_norm_problems(pack: PackView, cfg: dict, sizes: dict[str, int]) -> list[Problem]:
    """The output head against the config (``vocab_size`` outputs of ``hidden_size`` inputs - OPT's
    ``word_embed_proj_dim``) and the decoder layers' and the final norm's weight against ``hidden_size`` (one value
    per feature): vLLM's head loader and its norms' ``weight_loader`` assert the sizes in the worker ("Attempted to
    load weight (torch.Size([255])) into parameter (torch.Size([256]))"). Not for a tower's or a draft's modules."""
    hidden = cfg.get("word_embed_proj_dim") or sizes.get("hidden_size")
    vocab = sizes.get("vocab_size")
    out: list[Problem] = []
    for key, m in pack.modules.items():
        if OTHER_STACKS.search(key):
            continue
        last = key.rsplit(".", 1)[-1]
        if last in ("lm_head", "embed_tokens") and m.format == DENSE and len(m.tensors["weight"].shape) != 2:
            out.append(not_a_matrix(m, FIX_CONFIG))
        elif last == "lm_head" and m.padded_shape is not None:
            if isinstance(hidden, int):
                out.extend(stored_size_problem(m, 0, hidden, f"hidden_size {hidden}", FIX_CONFIG))
            if vocab is not None:  # Mllama's head too: its image-token rows are the embedding's only
                out.extend(stored_size_problem(m, 1, vocab, f"vocab_size {vocab}", FIX_CONFIG))
        elif HIDDEN_NORMS.search(key) and m.format == DENSE and sizes.get("hidden_size") is not None:
            shape = m.tensors["weight"].shape
            if tuple(shape) != (sizes["hidden_size"],):
                what = f"weight is {list(shape)}, but config.json gives hidden_size {sizes['hidden_size']}"
                out.append(Problem(key, f"{key}.weight", what, FIX_CONFIG))
    return out


def _stated_size_problems(pack: PackView, built: dict) -> list[Problem]:
    """For the model classes whose layer the project states, every module of the decoder layers against the sizes
    vLLM's class gives it (:func:`~quantpack_core.check.architectures.layer_sizes`: the hidden side of every
    projection, router and expert, the experts' and shared expert's intermediate side, q_norm / k_norm per head, the
    Gated DeltaNet's own A_log / dt_bias), where the checks above do not already."""
    arch = stated_class(built)
    if arch is None:
        return []
    out: list[Problem] = []
    plans: dict[int, dict] = {}
    for key, m in pack.modules.items():
        found = re.fullmatch(r"model\.layers\.(\d{1,9})\.(.+)", key)
        if not found or m.format == INT8_ROWS:
            continue
        i, path = int(found.group(1)), found.group(2)
        if i not in plans:
            plans[i] = layer_sizes(arch, built, i)
        if m.format == OTHER:  # a block's own parameters (the Gated DeltaNet's A_log, dt_bias)
            for name, info in sorted(m.tensors.items()):
                size = plans[i].get(f"{path}.{name}")
                if size is not None:
                    out += _built_shape_problem(key, name, info.shape, size, f"vLLM's {arch}")
            continue
        expert = re.fullmatch(r"(.+\.experts)\.\d+\.([^.]+)", path)
        size = plans[i].get(f"{expert.group(1)}.{expert.group(2)}" if expert else path)
        if size is not None:
            out += _module_size_problems(m, path, size, arch)
    return out


def _module_size_problems(m, path: str, size: tuple, arch: str) -> list[Problem]:
    """Module ``m`` at ``path`` of a stated layer against the ``size`` vLLM's ``arch`` builds it with: a norm's or a
    convolution's whole weight, else a linear module's sides (the first side that differs)."""
    if len(size) != 2:  # a norm's or a convolution's weight, as vLLM builds it
        if m.format == DENSE:
            return _built_shape_problem(m.key, "weight", m.tensors["weight"].shape, size, f"vLLM's {arch}")
        return []
    if m.format == DENSE and len(m.tensors["weight"].shape) != 2:
        return [not_a_matrix(m, FIX_CONFIG)]
    if m.padded_shape is None:
        return []
    for side, want in enumerate(size):
        if want is not None and (path, side) not in GENERIC_SIDES:
            found = stored_size_problem(m, side, want, f"{want} for vLLM's {arch}", FIX_CONFIG)
            if found:
                return found[:1]
    return []


def _built_shape_problem(key: str, name: str, shape, size: tuple, builder: str) -> list[Problem]:
    """A problem when tensor ``name`` of module ``key`` (shape ``shape``) is not the shape ``size`` that
    ``builder`` (``"vLLM's Qwen3NextForCausalLM"``) builds it with (None: any size there); named after the
    module's own path in the layer (a norm's weight) or the tensor's (``linear_attn.A_log``)."""
    shape = tuple(shape)
    if len(shape) == len(size) and all(w in (None, h) for w, h in zip(size, shape, strict=True)):
        return []
    want = "x".join("?" if w is None else str(w) for w in size)
    path = re.sub(r"^model\.layers\.\d+\.", "", key)
    lead, built = ("weight ", path) if name == "weight" else ("", f"{path}.{name}")
    what = f"{lead}is {list(shape)}, but {builder} builds {built} as {want}"
    return [Problem(key, f"{key}.{name}", what, FIX_CONFIG)]


def _outside_layer_problems(pack: PackView, built: dict) -> list[Problem]:
    """For the stated classes, a module outside the decoder layers other than the token embedding, the final norm
    and the head (``model.foo``, or the head stored as ``model.lm_head``): vLLM's loader has no module for it and
    stopped in the worker ("There is no module or parameter named 'foo' in LlamaModel"). Rotary tables and modules
    holding only scales are left alone (vLLM skips or maps them)."""
    arch = stated_class(built)
    outside = [k for k in pack.modules if not LAYER_KEY.search(k)]
    if arch is None or any(k.rsplit(".", 1)[-1] == DRAFT_FUSION for k in outside):
        return []  # an EAGLE draft published under its target's class: vLLM builds it as a draft, with its fc
    out: list[Problem] = []
    for key in outside:
        names = set(pack.modules[key].tensors)
        if key in OUTSIDE_LAYERS or (arch == "Qwen3NextForCausalLM" and key.startswith("mtp.")):
            continue
        if skipped_by_vllm(key, names):
            continue
        what = (
            f"vLLM's {arch} has no module {key} (outside the layers it loads model.embed_tokens, model.norm and "
            "lm_head only): its loader would stop in the worker"
        )
        fix = "remove these tensors from a copy of the pack, or use the config.json the pack was made with"
        out.append(Problem(key, f"{key}.{sorted(names)[0]}", what, fix))
    return out


def _embedding_problems(pack: PackView, cfg: dict, sizes: dict[str, int]) -> list[Problem]:
    """The token embedding (dense, or int8 rows) as wide as ``hidden_size`` (OPT's ``word_embed_proj_dim``: it
    embeds at that width and projects up) and at least ``vocab_size`` rows long, and no more rows than a vocabulary's
    padding (under a block) past it, but those its architecture adds (:data:`ADDED_EMBEDDING_ROWS`)."""
    out: list[Problem] = []
    for key, m in pack.modules.items():
        if not key.endswith("embed_tokens") or m.format not in (DENSE, INT8_ROWS) or m.padded_shape is None:
            continue
        width, rows = m.padded_shape
        name = f"{key}.{'weight' if m.format == DENSE else next(iter(m.tensors))}"
        want_width = cfg.get("word_embed_proj_dim") or sizes.get("hidden_size")
        if isinstance(want_width, int) and width != want_width:
            what = f"is {rows} x {width}, but config.json gives hidden_size {want_width}"
            out.append(Problem(key, name, what, FIX_CONFIG))
        vocab = sizes.get("vocab_size")
        if vocab is not None and rows < vocab:
            what = f"has {rows} rows, fewer than config.json's vocab_size {vocab}"
            out.append(Problem(key, name, what, FIX_CONFIG))
        elif vocab is not None and rows - vocab >= HAD_BLOCK and rows - vocab != _added_rows(pack):
            # a model may pad its vocabulary (1,024 rows for 1,000 tokens): the plugins' embedding then keeps the
            # vocabulary's rows (quantpack_core.vllm.embedding), as a coded head's padding stays within a block
            what = (
                f"has {rows} rows, {rows - vocab} more than config.json's vocab_size {vocab}: more than the "
                f"padding of a vocabulary (under {HAD_BLOCK} rows)"
            )
            out.append(Problem(key, name, what, FIX_CONFIG))
    return out


def _added_rows(pack: PackView) -> int:
    """Rows the pack's architecture adds to its embedding table past ``vocab_size`` (0 for most models)."""
    names = pack.config.get("architectures")
    for arch in names if isinstance(names, list) else []:
        for prefix, rows in ADDED_EMBEDDING_ROWS.items():
            if isinstance(arch, str) and arch.startswith(prefix):
                return rows
    return 0


def unproven_sizes(pack: PackView) -> list[str]:
    """config.json's sizes that no tensor of the pack proves, for ``quantpack inspect``'s note: how the attention's
    width splits into heads (``num_attention_heads`` x ``head_dim``: the projections hold only the products, and 8
    heads of 32 store exactly as 4 of 64) unless per-head norms (``q_norm`` / ``k_norm``, one weight per head
    feature) give ``head_dim``; and each format's own (:meth:`~quantpack_core.format.PackFormat.unproven_sizes`: a
    coded module's outputs ending inside its padding where no padded scale proves them). ``quantpack verify`` runs
    the pack to catch what these hide."""
    cfg = pack.config.get("text_config") if isinstance(pack.config.get("text_config"), dict) else pack.config

    def size(key: str) -> int | None:
        v = cfg.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    out: list[str] = []
    heads, kv, hidden = size("num_attention_heads"), size("num_key_value_heads"), size("hidden_size")
    head_dim = size("head_dim") or (hidden // heads if heads and hidden else None)
    per_head = any(k.rsplit(".", 1)[-1] in ("q_norm", "k_norm") and m.format == DENSE for k, m in pack.modules.items())
    attention = any(k.endswith("self_attn.k_proj") for k in pack.modules)
    if heads and head_dim and attention and not per_head:
        kv_part = f" and num_key_value_heads {kv}" if kv else ""
        out.append(
            f"the split of the attention into num_attention_heads {heads} x head_dim {head_dim}{kv_part} (the "
            f"projections hold only the products, {heads * head_dim} and {(kv or heads) * head_dim} features)"
        )
    return out + [note for fmt in pack_formats().values() for note in fmt.unproven_sizes(pack)]
