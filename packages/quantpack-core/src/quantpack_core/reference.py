"""A pack as a dense transformers model: the test oracle of every serving path.

Every EXL3 tensor of a pack is decoded by the core codec (:meth:`quantpack_core.pack.Pack.dense_state_dict`; a module
of another coded format by its plugin's decoder), trimmed to the model's logical shapes, and loaded into transformers'
own model class in float32 (or float64), so a forward pass gives reference logits that depend only on the pack's
weights and transformers' model code - no kernel of exllamav3 or vLLM. :func:`router_top_k` records which experts each
MoE layer picks.

Needs ``transformers`` (not a dependency of quantpack-core; the test environments install it). Follows transformers
5's checkpoint layout: MoE experts as fused ``experts.gate_up_proj (E, 2I, H)`` / ``experts.down_proj (E, H, I)``
parameters, which exllamav3 packs store expert by expert.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from .pack import Pack

_EXPERT_WEIGHT = re.compile(r"^(?P<layer>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


def fuse_experts(state: dict[str, torch.Tensor], expected: set[str]) -> dict[str, torch.Tensor]:
    """Per-expert ``<layer>.experts.{e}.{gate,up,down}_proj.weight`` -> the fused ``<layer>.experts.gate_up_proj``
    ``(E, 2I, H)`` and ``<layer>.experts.down_proj`` ``(E, H, I)`` transformers 5 models hold, for every expert layer
    whose fused names are in ``expected`` (other tensors pass through).

    Raises:
        KeyError: a layer whose experts are not numbered 0..E-1 or lack a projection.
    """
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for key, tensor in state.items():
        m = _EXPERT_WEIGHT.match(key)
        if m and f"{m['layer']}.gate_up_proj" in expected:
            groups.setdefault(m["layer"], {}).setdefault(int(m["e"]), {})[m["proj"]] = tensor
        else:
            out[key] = tensor
    for layer, experts in groups.items():
        ids = range(len(experts))
        out[f"{layer}.gate_up_proj"] = torch.stack([torch.cat([experts[e]["gate"], experts[e]["up"]]) for e in ids])
        out[f"{layer}.down_proj"] = torch.stack([experts[e]["down"] for e in ids])
    return out


def dense_transformers_model(
    pack_dir: str | Path,
    cls_name: str | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    rename: tuple[str, str] = ("", ""),
):
    """Build transformers' model of a pack's ``config.json`` with every weight decoded from the pack.

    Args:
        pack_dir: the pack folder.
        cls_name: transformers class (default: the config's first ``architectures`` entry).
        dtype: float32 or float64.
        rename: ``(old, new)`` substring replaced in every pack tensor name (e.g. Qwen3.5's
            ``model.language_model.`` -> ``model.`` for the text-only class).

    Returns:
        the model in eval mode.

    Raises:
        ImportError: transformers is missing.
        ValueError: the pack's tensors do not cover the model's parameters, or the pack has tensors the model lacks
            (names listed).
    """
    import transformers

    pack = Pack.open(pack_dir, require_exl3=False)  # EXL3, or another plugin's coded format (Pack.dense_state_dict)
    cfg = transformers.AutoConfig.from_pretrained(pack_dir)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    if any(k.rsplit(".", 1)[-1] == "lm_head" for k in pack.modules):
        # a pack that stores its head is served with it even where the config ties it (vLLM's side:
        # quantpack_core.vllm.config.untie_if_head_stored); tied, transformers would overwrite one table with the other
        for c in (cfg, getattr(cfg, "text_config", None)):
            if c is not None and getattr(c, "tie_word_embeddings", False):
                c.tie_word_embeddings = False
    cls = getattr(transformers, cls_name or cfg.architectures[0])
    model = cls(cfg).to(dtype).eval()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    state = {k.replace(*rename): v for k, v in pack.dense_state_dict(dtype).items()}
    state = fuse_experts(state, set(shapes))
    state = {k: v[tuple(slice(0, n) for n in shapes[k])] if k in shapes else v for k, v in state.items()}
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if "rotary" not in k]  # rotary buffers are computed, not stored
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{pack_dir}: the pack does not fit {cls.__name__}: missing {missing[:8]}, unexpected "
            f"{result.unexpected_keys[:8]}"
        )
    return model


def router_top_k(model, input_ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """Run ``model(input_ids)`` and record each MoE layer's chosen experts (:func:`router_record`'s picks)."""
    return router_record(model, input_ids)[0]


def router_margins(model, input_ids: torch.Tensor) -> torch.Tensor:
    """``(MoE layers, T)`` float64: per layer (in order) and token, ``compare.router_margin`` of the router's softmax
    probabilities, the margins ``compare.outside_router_ties`` takes (:func:`router_record`)."""
    margins = router_record(model, input_ids)[1]
    return torch.stack([margins[layer] for layer in sorted(margins)])


def router_record(model, input_ids: torch.Tensor) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Run ``model(input_ids)`` and record each MoE layer's chosen experts and router margins.

    Args:
        model: a transformers model whose MoE blocks call a router module named ``mlp.gate`` that returns
            ``(logits, weights, indices)`` (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE in transformers 5).
        input_ids: ``(1, T)`` token ids.

    Returns:
        ``({layer index: int64 (T, top_k)}, {layer index: float64 (T,)})``: the experts in the router's order
        (descending score), and ``compare.router_margin`` of the router's softmax probabilities.

    Raises:
        ValueError: the model has no such router.
    """
    from .compare import router_margin

    picks: dict[int, torch.Tensor] = {}
    margins: dict[int, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        m = re.search(r"layers\.(\d+)\.mlp\.gate$", name)
        if m:
            layer = int(m.group(1))

            def hook(_mod, _inp, output, layer=layer):
                picks[layer] = output[2].detach().reshape(-1, output[2].shape[-1]).long().clone()
                probs = output[0].detach().double().reshape(-1, output[0].shape[-1]).softmax(-1)
                margins[layer] = router_margin(probs, picks[layer].shape[-1])

            handles.append(module.register_forward_hook(hook))
    if not handles:
        raise ValueError(f"{type(model).__name__} has no '<...>.layers.<n>.mlp.gate' router modules")
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for h in handles:
            h.remove()
    return picks, margins
