"""Qwen3-VL / Qwen3.5 / Qwen3.8 vision towers under EXL3 (vLLM's ``Qwen3_VisionTransformer``, which
``Qwen3_5ForConditionalGeneration`` builds as ``visual`` with the language model's quant config).

What vLLM's tower cannot load from an EXL3 pack, and what the family does about it (docs/families.md, "Qwen vision"):

* exllamav3 quantizes the tower's fused ``attn.qkv`` as three separate tensors, ``attn.{q,k,v}_proj.{trellis,suh,
  svh,bias}``, each with its own K and scales. vLLM's tower stacks split ``attn.q.`` / ``attn.k.`` / ``attn.v.``
  names into the ``attn.qkv`` shards ``q`` / ``k`` / ``v`` but knows no ``q_proj`` (stock vLLM fails with "no module
  or parameter named 'blocks.0.attn.k_proj'"): the family renames them to the spelling vLLM stacks, so each part
  reaches the layer's quantpack method as its own shard.
* Packs of exllamav3's converter (its 1.6.5 pack of the tiny model, docs/families.md) hold both the dense fused
  ``attn.qkv.{weight,bias}`` and the split EXL3 parts of the same block. Loading both would give the layer two kinds
  of the same outputs (a load error), so where all three EXL3 parts are present the dense fused weight is dropped (and
  the fused bias, where the three parts carry their own), and one log line says which layout was served. The quant
  config takes such a layer's storage from its split parts (``quantpack_core.names.FUSED_LAYERS``: the first whole
  layout in the manifest decides).
* A quantized linear's stored ``bias`` is padded like its output (the tower's MLP width 4304 is stored as 4352;
  a loader that compares shapes fails with "(4304,) != (4352,)"). quantpack's linear method trims the padded
  outputs and zero-extends the padded inputs (``linear_fc2``) itself, and vLLM's column-parallel loader takes the
  first outputs of a longer bias; the family trims any quantized layer's longer bias to the layer's outputs before
  vLLM sees it, so replicated and row-parallel layers, whose loaders compare shapes, load it too, and refuses a
  shorter one naming the layer.
* Dense modules of the tower (patch embedding, position embedding, norms) never meet the quant config's linear
  method: vLLM builds them as convolutions, embeddings and norms.

The family wraps ``Qwen3_VisionTransformer.load_weights`` (the tower's own loader, which vLLM's model loader calls
with the tower's tensors, their ``visual.`` stripped) to pass the stream through :func:`vision_weights` first. It
applies to every vLLM version (0.25 - 0.32 stack ``attn.q.`` the same way).

Source: vLLM ``vllm/model_executor/models/qwen3_vl.py`` (``Qwen3_VisionTransformer.hf_to_vllm_mapper``,
``load_weights``) and ``qwen2_5_vl.py`` (``Qwen2_5_VisionAttention``), 0.25 and 0.32, read; exllamav3's
``architecture/qwen3_vl.py`` (the split ``q_proj`` / ``k_proj`` / ``v_proj``, ``pad_to`` of the MLP).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

import torch

from ..registry import Family, class_patch, wrap_attribute

logger = logging.getLogger("vllm.quantpack.families")

_MARK = "_quantpack_qwen_vision"

MODULE = "vllm.model_executor.models.qwen3_vl"

#: ``<block>.attn.<q|k|v>_proj.<suffix>``: one part of a split attention projection
_SPLIT = re.compile(r"^(?P<attn>(?:.+\.)?attn)\.(?P<part>[qkv])_proj\.(?P<suffix>[^.]+)$")
#: ``<block>.attn.qkv.<suffix>``: the fused projection
_FUSED = re.compile(r"^(?P<attn>(?:.+\.)?attn)\.qkv\.(?P<suffix>[^.]+)$")
#: the tensor that marks a module as quantized (the EXL3 trellis codes)
QUANTIZED_SUFFIX = "trellis"


def vision_weights(
    tower: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], prefix: str = "visual"
) -> Iterator[tuple[str, torch.Tensor]]:
    """The vision tower's checkpoint tensors as vLLM's tower loads them: split EXL3 ``attn.{q,k,v}_proj`` renamed to
    ``attn.{q,k,v}`` (vLLM stacks those into ``attn.qkv``), a block's dense fused ``attn.qkv`` dropped where the
    block holds all three EXL3 parts, and quantized layers' padded biases trimmed to the layer's outputs.

    Args:
        tower: the vLLM module the names are relative to (``Qwen3_VisionTransformer``); its linear layers give the
            output sizes (``output_size``: the whole layer's, before any tensor-parallel split).
        weights: ``(name, tensor)`` pairs relative to ``tower`` (``blocks.0.attn.q_proj.trellis``); read whole
            first (the tower's tensors, a small share of a model).
        prefix: the tower's name in the model, for messages.

    Returns:
        an iterator of ``(name, tensor)`` pairs in the input's order, less the dropped ones.

    Raises:
        LayerLoadError: naming the tensor and the fix, before vLLM's loader sees it: a quantized layer's stored bias
            that is not one value per output (shorter than the layer's outputs, longer than the stored, padded ones,
            or not 1-D); a split part whose trellis stores fewer outputs than its shard of ``attn.qkv`` has, whose
            bias does not fit its shard, or a block where some split parts carry a bias and others do not (the
            missing shard's bias would stay uninitialised); a dense fused ``attn.qkv.bias`` kept beside the parts
            whose length is not the layer's outputs.
    """
    from quantpack_core.errors import LayerLoadError

    items = list(weights)
    _check_split_parts(tower, items, prefix, LayerLoadError)
    #: quantized module -> its trellis (whose shape gives the stored, padded outputs)
    quantized = {n.rsplit(".", 1)[0]: t for n, t in items if n.endswith("." + QUANTIZED_SUFFIX)}
    parts: dict[tuple[str, str], set[str]] = {}  # (attention module, suffix) -> the split parts that have it
    for name, _ in items:
        m = _SPLIT.match(name)
        if m:
            parts.setdefault((m["attn"], m["suffix"]), set()).add(m["part"])
    split = {attn for (attn, suffix), found in parts.items() if suffix == QUANTIZED_SUFFIX and len(found) == 3}

    def superseded(fused: re.Match) -> bool:
        """A fused tensor the split parts replace: the weight where all three parts are EXL3, any other tensor
        (the bias) where all three parts carry their own (else the fused one is the layer's only copy)."""
        attn, suffix = fused["attn"], fused["suffix"]
        if attn not in split:
            return False
        return suffix == "weight" or len(parts.get((attn, suffix), ())) == 3

    dropped = sorted({m["attn"] for n, _ in items if (m := _FUSED.match(n)) and superseded(m)})
    if dropped:
        logger.info(
            "quantpack-families: %s: %d attention block(s) hold both a dense fused attn.qkv and split EXL3 "
            "attn.{q,k,v}_proj (as exllamav3's converter writes them); serving the EXL3 parts, ignoring the dense "
            "attn.qkv tensors (first: %s.%s.qkv)",
            prefix,
            len(dropped),
            prefix,
            dropped[0],
        )
    for name, tensor in items:
        fused = _FUSED.match(name)
        if fused and superseded(fused):
            continue
        module, _, suffix = name.rpartition(".")
        if suffix == "bias" and module in quantized:
            tensor = _fit_bias(tower, module, tensor, prefix, LayerLoadError, stored_outputs(quantized[module]))
        m = _SPLIT.match(name)
        if m:
            name = f"{m['attn']}.{m['part']}.{m['suffix']}"
        yield name, tensor


def stored_outputs(trellis: torch.Tensor | None) -> int | None:
    """The output features an EXL3 ``trellis`` ``(in / 16, out / 16, 16 K)`` stores (padded), or None."""
    return None if trellis is None or trellis.dim() != 3 else int(trellis.shape[1]) * 16


def _check_bias(bias: torch.Tensor, outputs: int, stored: int | None, name: str, error: type) -> None:
    """Refuse a bias that is not 1-D with between ``outputs`` and ``stored`` (the padded width) values."""
    longest = max(outputs, stored or outputs)
    if bias.dim() != 1 or not outputs <= bias.shape[0] <= longest:
        raise error(
            f"{name}: the pack's bias has shape {list(bias.shape)} for {outputs} outputs (stored padded to "
            f"{longest}); the pack is damaged or made for another model - re-convert the vision tower"
        )


def _check_split_parts(tower: torch.nn.Module, items: list, prefix: str, error: type) -> None:
    """The checks of :func:`vision_weights` on each block's split ``attn.{q,k,v}_proj`` and kept fused bias, against
    the block's ``attn.qkv`` (``output_sizes``: its q / k / v shards, whole-layer sizes)."""
    by_attn: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    fused_bias = {}
    for name, t in items:
        if m := _SPLIT.match(name):
            by_attn.setdefault(m["attn"], {}).setdefault(m["part"], {})[m["suffix"]] = t
        elif (m := _FUSED.match(name)) and m["suffix"] == "bias":
            fused_bias[m["attn"]] = t
    for attn, parts in by_attn.items():
        try:
            sizes = dict(zip("qkv", tower.get_submodule(f"{attn}.qkv").output_sizes, strict=True))
        except (AttributeError, TypeError, ValueError):
            continue  # not this tower's attention (vLLM's loader names it) or a layer without shard sizes
        with_bias = sorted(p for p, t in parts.items() if "bias" in t)
        if with_bias and len(with_bias) < len(parts):
            missing = sorted(set(parts) - set(with_bias))
            raise error(
                f"{prefix}.{attn}: {', '.join(f'{p}_proj' for p in with_bias)} carry a bias and "
                f"{', '.join(f'{p}_proj' for p in missing)} none: the fused layer's "
                f"{'/'.join(missing)} bias would stay unset - re-download or re-convert the vision tower"
            )
        for part, tensors in parts.items():
            stored = stored_outputs(tensors.get(QUANTIZED_SUFFIX))
            if stored is not None and stored < sizes[part]:
                raise error(
                    f"{prefix}.{attn}.{part}_proj: the trellis stores {stored} outputs, the layer's {part} shard has "
                    f"{sizes[part]}; the pack is made for another model - re-convert the vision tower"
                )
            if "bias" in tensors:
                _check_bias(tensors["bias"], sizes[part], stored, f"{prefix}.{attn}.{part}_proj", error)
        total = sum(sizes.values())
        if attn in fused_bias and not with_bias and fused_bias[attn].shape != (total,):
            raise error(
                f"{prefix}.{attn}.qkv: the dense fused bias has shape {list(fused_bias[attn].shape)} for the layer's "
                f"{total} outputs; the pack is damaged or made for another model - re-convert the vision tower"
            )


def _fit_bias(
    tower: torch.nn.Module, module: str, bias: torch.Tensor, prefix: str, error: type, stored: int | None = None
) -> torch.Tensor:
    """``bias`` of the quantized layer ``module`` (``stored`` padded outputs, where known) cut to the layer's outputs
    where the pack padded it. A split attention part (``attn.q_proj``) is cut to its shard by the checks above."""
    split = _SPLIT.match(module + ".bias")
    try:
        layer = tower.get_submodule(f"{split['attn']}.qkv" if split else module)
    except AttributeError:
        return bias  # not a module of this tower: vLLM's loader names it
    if split:
        sizes = getattr(layer, "output_sizes", None)
        return bias[: dict(zip("qkv", sizes, strict=True))[split["part"]]] if sizes and len(sizes) == 3 else bias
    outputs = getattr(layer, "output_size", None)
    if not isinstance(outputs, int):
        return bias
    if bias.dim() == 1 and bias.shape[0] < outputs:
        raise error(
            f"{prefix}.{module}: the pack's bias has {bias.shape[0]} values for a layer of {outputs} outputs; the "
            "pack is truncated or made for another model - re-convert the vision tower"
        )
    _check_bias(bias, outputs, stored, f"{prefix}.{module}", error)
    return bias[:outputs]


def wrap_tower(cls) -> bool:
    """Make ``cls.load_weights`` (vLLM's ``Qwen3_VisionTransformer``) load :func:`vision_weights` of its stream.
    Idempotent.

    Returns:
        True when this call wrapped it.
    """

    def make(load_weights):
        def wrapped(self, weights):
            return load_weights(self, vision_weights(self, weights))

        return wrapped

    return wrap_attribute(cls, "load_weights", _MARK, make)


#: :func:`wrap_tower` applied to the ``Qwen3_VisionTransformer`` vLLM's module defines
patch = class_patch({"Qwen3_VisionTransformer": wrap_tower})


FAMILY = Family(
    name="qwen_vision",
    why=(
        "vLLM's Qwen3-VL vision tower (Qwen3.5 / Qwen3.8 VL) cannot load exllamav3's split q / k / v projections, "
        "their padded biases, or packs that also keep the dense fused qkv"
    ),
    patches={MODULE: patch},
)
