"""MoE layers whose experts a format stores as an expert bank (a format with
:meth:`~quantpack_core.format.ExpertFormat.build_bank`), as a whole: every expert has every projection the others
have, gate and up of an expert share K (the bank runs them at one width), one codebook per layer, and as many experts
as config.json says. Source: docs/moe-bank.md (the bank's rules); :func:`quantpack_core.moe.plan_moe_layer` enforces
the same at load.
"""

from __future__ import annotations

from ..errors import Problem
from ..format import PackFormat, pack_formats
from ..inventory import ModuleInfo, PackView
from ..names import EXPERT_MODULE
from .base import configured_experts, with_article
from .settings import CheckSettings


def moe_problems(pack: PackView, settings: CheckSettings) -> list[Problem]:
    """Each MoE layer of bank experts (:func:`_bank_problems`), in the order of the layers' names."""
    formats = pack_formats()
    banked = {name for name, fmt in formats.items() if callable(getattr(fmt, "build_bank", None))}
    layers: dict[str, dict[int, dict[str, ModuleInfo]]] = {}
    for m in pack.modules.values():
        hit = EXPERT_MODULE.match(m.key)
        if hit and m.format in banked:
            layers.setdefault(hit["layer"], {}).setdefault(int(hit["e"]), {})[hit["proj"]] = m
    out: list[Problem] = []
    configured = configured_experts(pack)
    for layer, experts in sorted(layers.items()):
        first = next(iter(next(iter(experts.values())).values()))
        out += _bank_problems(layer, experts, configured, formats[first.format])
    return out


def _bank_problems(
    layer: str, experts: dict[int, dict[str, ModuleInfo]], configured: int | None, fmt: PackFormat
) -> list[Problem]:
    """One MoE layer's experts (expert -> projection -> module) of format ``fmt``: their count against config.json's
    ``configured``, each expert's projections and its gate / up K, the layer's codebooks."""
    out: list[Problem] = []
    projs = sorted({p for e in experts.values() for p in e})
    count = max(experts) + 1
    if configured is not None and count != configured:
        what = (
            f"the pack has {fmt.label} experts 0..{max(experts)} in this layer, config.json says {configured} experts"
        )
        fix = (
            "re-download the pack if experts are missing from it (a file or tensor lost), else use the config.json "
            "the pack was made with"
        )
        out.append(Problem(layer, f"{layer}.{max(experts)}.{projs[0]}.{fmt.main_suffix}", what, fix))
    for e in range(count):
        for p in projs:
            if p not in experts.get(e, {}):
                what = f"expert {e} has no {fmt.label} {p} while other experts of the layer do"
                fix = "re-download the pack (a file or tensor is missing) or re-quantize the layer"
                out.append(Problem(f"{layer}.{e}.{p}", f"{layer}.{e}.{p}.{fmt.main_suffix}", what, fix))
        mods = experts.get(e, {})
        pair = [mods[p] for p in ("gate_proj", "up_proj", "w1", "w3") if p in mods]
        if len(pair) == 2 and pair[0].k_bits is not None and pair[0].k_bits != pair[1].k_bits:
            what = (
                f"expert {e}: gate K={pair[0].k_bits:g} but up K={pair[1].k_bits:g}; {with_article(fmt.label)} "
                "expert bank runs an expert's gate and up projections at one K"
            )
            fix = "re-quantize the layer with one bitrate for each expert's gate_proj and up_proj"
            out.append(Problem(pair[1].key, f"{pair[1].key}.{fmt.main_suffix}", what, fix))
    codebooks = {m.codebook for e in experts.values() for m in e.values() if m.codebook is not None}
    if len(codebooks) > 1:
        what = f"the layer's experts use several codebooks ({', '.join(sorted(c.value for c in codebooks))})"
        out.append(
            Problem(layer, f"{layer}.*", what, "re-quantize the layer with one codebook: an expert bank holds one")
        )
    return out
