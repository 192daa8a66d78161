"""Nemotron-3.5-Super-VL (``NemotronH_Omni_Reasoning_V3``): vLLM's ``nano_nemotron_vl.py`` (class
``NemotronH_Nano_VL_V2``) serves Nemotron-H vision-language models, but for Super it

* does not know the checkpoint's architecture name before vLLM 0.29 (0.25 - 0.28 list the ``Nano`` / ``Super``
  spellings only): the family registers the name for vLLM's class there;
* has no ``vision_final_layernorm`` before vLLM 0.32: Super's language config declares MTP layers, and Megatron then
  builds a final LayerNorm on every block built from that config, the RADIO tower included, so the released
  checkpoint stores ``vision_projector.vision_final_layernorm.{weight,bias}`` (width ``vit_hidden_size``), applied
  per token to the tower's features before the pixel shuffle and ``mlp1``. vLLM 0.25 - 0.31's loader drops those
  tensors without a word (no module takes the name) and its features diverge. Where vLLM did not build the norm
  itself (0.32 does, on the same rule), the family builds it when the language config declares MTP layers
  (``num_nextn_predict_layers`` > 0), applies it to the tower's output (a forward hook on ``vision_model``) and
  loads it; a checkpoint holding it for a model without one is refused, naming the tensor;
* runs none of its per-architecture config hooks for the ``*_Omni_Reasoning_V3`` names it serves (vLLM 0.25 -
  0.32 key ``MODELS_CONFIG_MAP`` by the checkpoint's architecture name and list ``NemotronH_Nano_VL_V2`` only), so
  the Mamba2 state cache, which ``NemotronHNanoVLV2Config`` sets to the language config's
  ``mamba_ssm_cache_dtype`` (float32 by default, as for the text-only model), stays at the model's dtype, bfloat16:
  the family gives those names vLLM's own hook where it has none;
* loads the RADIO tower in timm's layout only (``vision_model.radio_model.model.blocks.N.attn.qkv`` ..., the
  released checkpoint's) and skips every other name silently, leaving those parameters at their initial values. A
  checkpoint saved through transformers' own classes (``vision_model.encoder.layer.N.attention.{q,k,v,o}_proj``,
  ``layer_scale{1,2}.lambda1``, ``vision_model.embeddings.*``, ``vision_projector.mlp1.{norm,linear1,linear2}``)
  is renamed here into that layout (q / k / v concatenated into ``qkv``), and after loading every parameter of
  the tower and of ``mlp1`` must have been written: any left at its initial value is named in an error instead of
  serving a tower of random weights. The per-block layer scales (``ls1`` / ``ls2``), which vLLM's loader skips
  (identity in the released checkpoint), are loaded when a checkpoint carries them.

Under EXL3 the language tower (``language_model.backbone.*``) is quantized and served by the pack's methods;
RADIO and ``mlp1`` are plain modules no quant method reaches, dense as a pack stores them.

Source: vLLM 0.25.1 and 0.29 - 0.32 ``vllm/model_executor/models/nano_nemotron_vl.py`` (``NemotronH_Nano_VL_V2``:
``__init__``, ``extract_feature*``, ``load_weights``), ``model_executor/models/config.py`` (``MODELS_CONFIG_MAP``,
``NemotronHNanoVLV2Config``), ``config/vllm.py`` (where the map is read) and ``radio.py``
(``RadioModel.load_weights``), read; transformers 5.24 ``models/radio`` (its module names); docs/families.md
(Nemotron-3.5-Super-VL).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

import torch

from ..registry import Architecture, Family, class_patch, wrap_attribute

logger = logging.getLogger("vllm.quantpack")

MODULE = "vllm.model_executor.models.nano_nemotron_vl"
ARCH = "NemotronH_Omni_Reasoning_V3"
#: the architecture names vLLM serves with ``NemotronH_Nano_VL_V2`` that may lack its config hook
OMNI_ARCHS = (ARCH, "NemotronH_Nano_Omni_Reasoning_V3", "NemotronH_Super_Omni_Reasoning_V3")
CONFIG_MODULE = "vllm.model_executor.models.config"
_MARK = "_quantpack_nemotron_vl"

#: the final LayerNorm's checkpoint prefix (Super only)
FINAL_NORM = "vision_projector.vision_final_layernorm."
#: where vLLM's loader takes the timm-layout RADIO tower
RADIO = "vision_model.radio_model.model."
#: transformers' projector names -> the ``mlp1`` Sequential's (RMSNorm, Linear, ReLU², Linear)
PROJECTOR = {
    "vision_projector.mlp1.norm.weight": "mlp1.0.weight",
    "vision_projector.mlp1.linear1.weight": "mlp1.1.weight",
    "vision_projector.mlp1.linear2.weight": "mlp1.3.weight",
}
#: transformers' RADIO embedding names -> timm's
EMBEDDINGS = {
    "vision_model.embeddings.patch_projection.weight": RADIO + "patch_generator.embedder.weight",
    "vision_model.embeddings.video_patch_projection.weight": RADIO + "patch_generator.video_embedder.weight",
    "vision_model.embeddings.position_embedding": RADIO + "patch_generator.pos_embed",
    "vision_model.embeddings.cls_register_token": RADIO + "patch_generator.cls_token.token",
}
#: transformers' per-block RADIO names (after ``vision_model.encoder.layer.N.``) -> timm's (after ``blocks.N.``)
BLOCK = {
    "norm1.weight": "norm1.weight",
    "norm1.bias": "norm1.bias",
    "norm2.weight": "norm2.weight",
    "norm2.bias": "norm2.bias",
    "mlp.fc1.weight": "mlp.fc1.weight",
    "mlp.fc1.bias": "mlp.fc1.bias",
    "mlp.fc2.weight": "mlp.fc2.weight",
    "mlp.fc2.bias": "mlp.fc2.bias",
    "attention.o_proj.weight": "attn.proj.weight",
    "attention.o_proj.bias": "attn.proj.bias",
    "layer_scale1.lambda1": "ls1",
    "layer_scale2.lambda1": "ls2",
}
_HF_BLOCK = re.compile(r"vision_model\.encoder\.layer\.(\d+)\.(.+)")
_HF_QKV = re.compile(r"attention\.([qkv])_proj\.(weight|bias)")
_LAYER_SCALE = re.compile(re.escape(RADIO) + r"blocks\.(\d+)\.(ls[12])")
#: buffers and config-derived tensors of a checkpoint that vLLM's tower does not take
_IGNORED = {"vision_model.summary_idxs", "vision_model.radio_model.summary_idxs"}
_IGNORED_PREFIXES = ("vision_model.input_conditioner.",)


class NemotronVlError(ValueError):
    """A Nemotron VL checkpoint whose vision half cannot be served as it is (named tensor, the fix)."""


def has_final_layernorm(config) -> bool:
    """Whether the model has the vision tower's final LayerNorm: its language config declares MTP layers
    (``num_nextn_predict_layers`` > 0), as Super's does and Nano's does not (vLLM 0.32's rule too).

    Args:
        config: the model's config (``text_config``, or the checkpoint's ``llm_config``).
    """
    text = getattr(config, "text_config", None) or getattr(config, "llm_config", None)
    layers = (
        text.get("num_nextn_predict_layers") if isinstance(text, dict) else getattr(text, "num_nextn_predict_layers", 0)
    )
    return int(layers or 0) > 0


def final_layernorm(config, dtype: torch.dtype) -> torch.nn.LayerNorm:
    """The tower's final LayerNorm: width ``vit_hidden_size`` (transformers: ``vision_hidden_size``), epsilon the
    vision config's ``layer_norm_eps`` (RADIO's default 1e-6), identity affine until loaded."""
    width = getattr(config, "vit_hidden_size", None) or config.vision_hidden_size
    vision = getattr(config, "vision_config", None)
    eps = getattr(vision, "layer_norm_eps", None) if vision is not None else None
    return torch.nn.LayerNorm(int(width), eps=float(eps or 1e-6)).to(dtype)


def normalize_features(norm: torch.nn.Module):
    """A forward hook for vLLM's ``RadioModel``, whose forward returns ``(summary, features)``: the features
    ``(images, tokens, vit_hidden_size)`` through ``norm`` (per token, so before the pixel shuffle as Megatron's
    block-internal norm)."""

    def hook(module, args, output):
        summary, features = output
        return summary, norm(features)

    return hook


def remap_checkpoint(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's names in the layout vLLM's Nemotron VL loader takes: transformers' projector and RADIO names
    renamed to the ``mlp1`` / timm ones (a block's q / k / v concatenated into ``attn.qkv`` once all three have
    arrived), buffers vLLM does not take dropped; every other name passes unchanged.

    Raises:
        NemotronVlError: a block left with only some of q / k / v at the end (every such block named), q / k / v of
            different shapes or dtypes, a tensor under ``vision_model.encoder.layer.N.`` that is no RADIO block
            tensor, or two tensors for one name of the result (a part given twice, or a tensor in both layouts).
    """
    parts: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    fused: dict[tuple[int, str], str] = {}  # blocks whose qkv is out: (index, kind) -> its target
    given: dict[str, str] = {}  # name in the result -> the checkpoint name it came from

    def once(target: str, source: str) -> str:
        if target in given:
            raise NemotronVlError(
                f"{source}: the checkpoint also holds {given[target]}, and both are {target} for vLLM (a tensor "
                "given twice, or one in both the timm and transformers layouts) - keep one layout"
            )
        given[target] = source
        return target

    for name, tensor in weights:
        if name in _IGNORED or name.startswith(_IGNORED_PREFIXES):
            continue
        if name in PROJECTOR:
            yield once(PROJECTOR[name], name), tensor
            continue
        if name in EMBEDDINGS:
            target = EMBEDDINGS[name]
            if target.endswith("pos_embed") and tensor.dim() == 2:
                tensor = tensor[None]  # timm's position embedding is (1, positions, width)
            yield once(target, name), tensor
            continue
        block = _HF_BLOCK.fullmatch(name)
        if block is None:
            yield once(name, name), tensor
            continue
        index, rest = int(block.group(1)), block.group(2)
        qkv = _HF_QKV.fullmatch(rest)
        if qkv is not None:
            which, kind = qkv.groups()
            if (index, kind) in fused:
                raise NemotronVlError(f"{name}: given twice (its block's {fused[(index, kind)]} is complete already)")
            got = parts.setdefault((index, kind), {})
            if which in got:
                raise NemotronVlError(f"{name}: given twice (also as {got[which][0]})")
            got[which] = (name, tensor)
            if len(got) == 3:
                q, k, v = (got[p][1] for p in "qkv")
                if not (q.shape == k.shape == v.shape and q.dtype == k.dtype == v.dtype):
                    listing = ", ".join(f"{p} {tuple(got[p][1].shape)} {got[p][1].dtype}" for p in "qkv")
                    raise NemotronVlError(
                        f"vision_model.encoder.layer.{index}.attention: q / k / v {kind} differ ({listing}); RADIO's "
                        "attention has equal heads for all three - the checkpoint is corrupt"
                    )
                target = once(f"{RADIO}blocks.{index}.attn.qkv.{kind}", name)
                fused[(index, kind)] = target
                del parts[(index, kind)]
                yield target, torch.cat([q, k, v])
            continue
        if rest not in BLOCK:
            raise NemotronVlError(
                f"{name}: not a RADIO block tensor of transformers' layout ({', '.join(sorted(BLOCK))}, "
                "attention.{q,k,v}_proj.{weight,bias}); vLLM's tower has no place for it - use the released layout"
            )
        yield once(f"{RADIO}blocks.{index}.{BLOCK[rest]}", name), tensor
    if parts:
        listing = "; ".join(f"layer.{i}.attention {kind}: only {sorted(got)}" for (i, kind), got in parts.items())
        raise NemotronVlError(
            f"vision_model.encoder: {listing} of the q / k / v tensors, which vLLM's tower takes fused as attn.qkv - "
            "the checkpoint is incomplete, re-download it"
        )


def unloaded(module: torch.nn.Module, loaded: Iterable[str], optional: tuple[str, ...] = ()) -> list[str]:
    """The parameters of ``module`` that no checkpoint tensor wrote: names not in ``loaded`` (relative to
    ``module``), less those ending in one of ``optional``."""
    have = set(loaded)
    return [n for n, _ in module.named_parameters() if n not in have and not n.endswith(optional)]


def wrap_model(cls) -> bool:
    """Wrap ``cls`` (vLLM's ``NemotronH_Nano_VL_V2``): ``__init__`` builds and hooks the final LayerNorm where
    :func:`has_final_layernorm`; ``load_weights`` renames (:func:`remap_checkpoint`), loads the final LayerNorm and
    any layer scales itself, and refuses a tower or projector left partly unloaded. Idempotent.

    Returns:
        True when this call wrapped ``__init__``.
    """

    def make_init(init):
        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self._quantpack_owns_final_norm = False
            if getattr(self, "vision_final_layernorm", None) is None and has_final_layernorm(self.config):
                like = next(self.mlp1.parameters())
                self.vision_final_layernorm = final_layernorm(self.config, like.dtype).to(like.device)
                self.vision_model.register_forward_hook(normalize_features(self.vision_final_layernorm))
                self._quantpack_owns_final_norm = True

        return __init__

    def make_load(load):
        def load_weights(self, weights):
            norm: dict[str, torch.Tensor] = {}
            scales: dict[tuple[int, str], torch.Tensor] = {}
            projector: set[str] = set()
            unused: list[str] = []

            vllms_norm = (
                getattr(self, "vision_final_layernorm", None) is not None and not self._quantpack_owns_final_norm
            )

            def stream():
                for name, tensor in remap_checkpoint(weights):
                    if name.startswith(FINAL_NORM) and not vllms_norm:  # vLLM 0.32 loads the norm it built itself
                        norm[name.removeprefix(FINAL_NORM)] = tensor
                        continue
                    scale = _LAYER_SCALE.fullmatch(name)
                    if scale is not None:
                        scales[(int(scale.group(1)), scale.group(2))] = tensor
                        continue
                    if name.startswith("mlp1."):
                        projector.add(name.removeprefix("mlp1."))
                    elif name.startswith(("vision_projector.", "vision_model.")) and not name.startswith(
                        ("vision_model.radio_model.", FINAL_NORM)  # the tower's loader; vLLM 0.32's own norm
                    ):
                        unused.append(name)  # vLLM's loader routes no such name anywhere
                        continue
                    yield name, tensor

            loaded: set[str] | None = None  # the tower's loaded parameters; None: vLLM did not load the tower
            tower = self.vision_model
            original = tower.load_weights

            def recording(vision_weights):
                nonlocal loaded
                got = original(vision_weights)
                loaded = set(got or ())
                return got

            tower.load_weights = recording
            try:
                result = load(self, stream())
            finally:
                del tower.load_weights  # the instance attribute: the class's method shows again
            if unused:
                raise NemotronVlError(
                    f"{', '.join(unused[:4])}{' and more' if len(unused) > 4 else ''}: vision tensors no module of "
                    "vLLM's model takes (neither the timm layout vLLM loads nor transformers' that quantpack renames) "
                    "- the checkpoint's vision half is of another layout; use the released checkpoint's"
                )
            _finish(self, norm, scales, loaded, projector)
            return result

        return load_weights

    changed = wrap_attribute(cls, "__init__", _MARK, make_init)
    wrap_attribute(cls, "load_weights", _MARK, make_load)
    return changed


def _finish(model, norm: dict, scales: dict, loaded: set[str] | None, projector: set[str]) -> None:
    """Load the final LayerNorm and the layer scales; refuse what the tower or projector did not receive (where
    vLLM loaded the tower at all: it skips the vision half when no image, video or audio may be sent)."""
    built = getattr(model, "vision_final_layernorm", None) if model._quantpack_owns_final_norm else None
    if norm and built is None:
        raise NemotronVlError(
            f"{FINAL_NORM}{{{', '.join(sorted(norm))}}}: the checkpoint has the vision tower's final LayerNorm, but "
            "its language config declares no MTP layers (num_nextn_predict_layers), which is what makes Super's tower "
            "have one - use the checkpoint's own config.json"
        )
    if built is not None:
        if set(norm) == {"weight", "bias"}:
            with torch.no_grad():
                built.weight.copy_(norm["weight"])
                built.bias.copy_(norm["bias"])
        elif norm:
            raise NemotronVlError(f"{FINAL_NORM}: the checkpoint holds only {sorted(norm)} of weight and bias")
        elif loaded is not None:
            logger.warning(
                "quantpack: %s has MTP layers, so its vision tower ends in a LayerNorm, but the checkpoint holds no "
                "%s{weight,bias}: the norm is applied with unit scale and zero shift",
                type(model).__name__,
                FINAL_NORM,
            )
    if loaded is None:  # a text-only load
        return
    layers = model.vision_model.model.encoder.layers
    for (index, which), tensor in scales.items():
        if index >= len(layers):
            raise NemotronVlError(f"{RADIO}blocks.{index}.{which}: the tower has {len(layers)} blocks")
        with torch.no_grad():
            getattr(layers[index], which).copy_(tensor)
    no_projector = unloaded(model.mlp1, projector)
    if no_projector:
        raise NemotronVlError(
            f"mlp1: the projector's {', '.join(no_projector)} received no checkpoint tensor (mlp1.N.weight, or "
            "transformers' vision_projector.mlp1.{norm,linear1,linear2}.weight) - the checkpoint is incomplete"
        )
    missing = unloaded(model.vision_model, loaded, optional=(".ls1", ".ls2"))
    if missing:
        raise NemotronVlError(
            f"vision_model: {len(missing)} parameters of the RADIO tower received no checkpoint tensor (e.g. "
            f"{', '.join(missing[:4])}): vLLM's loader takes the timm layout (vision_model.radio_model.model.blocks.N."
            "...) and quantpack renames transformers' (vision_model.encoder.layer.N....); this checkpoint's vision "
            "names are neither, or tensors are missing - use the released checkpoint's layout"
        )


#: :func:`wrap_model` applied to the ``NemotronH_Nano_VL_V2`` vLLM's module defines
patch = class_patch({"NemotronH_Nano_VL_V2": wrap_model})


def add_config_hooks(module) -> bool:
    """Give each of :data:`OMNI_ARCHS` missing from ``module.MODELS_CONFIG_MAP`` (vLLM's
    ``model_executor/models/config.py``) the hook vLLM runs for ``NemotronH_Nano_VL_V2`` (its Mamba2 state dtype).
    Idempotent.

    Returns:
        True when an entry was added.
    """
    table = getattr(module, "MODELS_CONFIG_MAP", None)
    hook = None if table is None else table.get("NemotronH_Nano_VL_V2")
    if hook is None:
        return False
    added = [arch for arch in OMNI_ARCHS if arch not in table]
    for arch in added:
        table[arch] = hook
    return bool(added)


FAMILY = Family(
    name="nemotron_vl",
    why=(
        "vLLM's Nemotron VL model lacks Super's vision final LayerNorm and its architecture name before 0.29, runs "
        "the Omni names without its config hook (a bfloat16 Mamba state), and skips vision tensors of other layouts "
        "without a word"
    ),
    registers={ARCH: Architecture(f"{MODULE}:NemotronH_Nano_VL_V2")},
    patches={MODULE: patch, CONFIG_MODULE: add_config_hooks},
)
