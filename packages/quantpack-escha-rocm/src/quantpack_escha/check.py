"""The escha format's rules of the pack check (:class:`~quantpack_core.format.PackFormat`, through
:class:`~quantpack_escha.format.EschaFormat`): one module's code and scales (:func:`module_problems`), the config's
``layer_meta`` against the codes (:func:`layer_meta_problems`; the escha config makes the same check when vLLM
builds it, :meth:`~quantpack_escha.config.EschaConfig.check_layer_meta`), and the sizes no escha tensor proves
(:func:`unproven_sizes`). No vLLM import. The format: docs/escha-format.md.
"""

from __future__ import annotations

import torch

from quantpack_core.check.base import TOKEN_EMBEDDINGS, bias_misfit
from quantpack_core.check.settings import CheckSettings
from quantpack_core.check.values import finite_problems, implausible_vector_problems, read_value
from quantpack_core.codec.exl3 import FORMAT as EXL3
from quantpack_core.codec.hadamard import HAD_BLOCK
from quantpack_core.codec.trellis import TILE
from quantpack_core.errors import LayerLoadError, Problem
from quantpack_core.inventory import ModuleInfo, PackView, dtype_name
from quantpack_core.names import normalize_prefix

from .codec import CODE, IN_SCALES, OUT_SCALES

NAME = "escha"
FIX_META = "re-download or re-convert the pack"


def meta_key(name: str) -> str:
    """The key an escha module is matched by in ``layer_meta``: its tail from ``layers.`` when it has one (the
    checkpoint's and vLLM's namespaces agree there), else its canonical name
    (:func:`quantpack_core.names.normalize_prefix`). Source: docs/escha-format.md."""
    i = name.find("layers.")
    if i == 0 or (i > 0 and name[i - 1] == "."):
        return name[i:]
    return normalize_prefix(name)


def layer_ks(layer_meta: object) -> dict[str, tuple[str, int]]:
    """``quantization_config.layer_meta`` of an escha pack as ``{match key: (module as listed, K)}``.

    Raises:
        LayerLoadError: ``layer_meta`` is not a mapping, or an entry has no integer K in 1..8 (the entry named).
    """
    meta = layer_meta or {}
    if not isinstance(meta, dict):
        raise LayerLoadError(
            f"quantization_config.layer_meta must map module names to entries, got {type(meta).__name__} - the "
            "pack's config.json is damaged"
        )
    ks: dict[str, tuple[str, int]] = {}
    for name, entry in meta.items():
        k = entry.get("K") if isinstance(entry, dict) else None
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 8:
            if not isinstance(entry, dict):
                said = f"is {entry!r}, not an entry with its K"
            else:
                said = f"has K={k!r}" if "K" in entry else "has no K"
            raise LayerLoadError(
                f"quantization_config.layer_meta[{name!r}] {said}; escha codes need an integer K from 1 to 8 "
                "- the pack's config.json is damaged"
            )
        ks[meta_key(name)] = (name, k)
    return ks


def meta_mismatches(ks: dict[str, tuple[str, int]], widths: dict[str, int]) -> list[tuple[str, str, str]]:
    """Where ``layer_meta`` and the stored codes disagree, as ``(module, what, fix)``, at most one per kind with
    the count of the others: a module storing ``.escha_code`` that ``layer_meta`` does not list (vLLM would build it
    dense and fail deep in its loader), a listed module storing none (``layer_meta`` describes another model), and a
    K that is not the code's (16*K words per tile).

    Args:
        ks: :func:`layer_ks` of the pack's ``layer_meta``.
        widths: every module storing ``.escha_code`` -> that tensor's last dimension (16*K; an illegal width is the
            layout check's to report, not compared here).
    """
    coded = {m: w // TILE if w % TILE == 0 and 1 <= w // TILE <= 8 else None for m, w in widths.items()}
    stored = {meta_key(m): m for m in coded}

    def more(n: int, what: str = "modules") -> str:
        return f" (and {n - 1} more{' ' + what if what else ''})" if n > 1 else ""

    out: list[tuple[str, str, str]] = []
    unlisted = [stored[k] for k in stored if k not in ks]
    if unlisted:
        what = (
            f"the pack stores .{CODE} for it{more(len(unlisted))} but quantization_config.layer_meta does not list it, "
            "so vLLM would build it as a dense layer"
        )
        out.append((unlisted[0], what, "add it to layer_meta with its K, or re-convert the pack"))
    absent = [ks[k][0] for k in ks if k not in stored]
    if absent:
        what = (
            f"quantization_config.layer_meta lists it{more(len(absent), '')} but the pack stores no "
            f"{absent[0]}.{CODE} - config.json does not describe these tensors"
        )
        out.append((absent[0], what, FIX_META))
    wrong = [(ks[k][0], ks[k][1], coded[stored[k]]) for k in stored if k in ks and coded[stored[k]] is not None]
    wrong = [w for w in wrong if w[1] != w[2]]
    if wrong:
        name, want, have = wrong[0]
        what = (
            f".{CODE} holds K={have} (16*K words per tile), layer_meta says K={want}{more(len(wrong))} - the pack's "
            "config.json does not match its tensors"
        )
        out.append((name, what, FIX_META))
    return out


def layer_meta_problems(pack: PackView) -> list[Problem]:
    """For a pack whose config.json says ``quant_method: "escha"``: ``layer_meta`` against the stored codes
    (:func:`layer_ks`, :func:`meta_mismatches`: the checks the escha config makes when vLLM builds it)."""
    if pack.config_method != NAME:
        return []
    qc = pack.config.get("quantization_config")
    try:
        ks = layer_ks(qc.get("layer_meta") if isinstance(qc, dict) else None)
    except LayerLoadError as e:
        return [Problem("", "config.json", str(e).split(" - ")[0], "re-download the pack's config.json")]
    widths = {m.key: m.tensors[CODE].shape[-1] for m in pack.modules.values() if m.format == NAME}
    return [Problem(module, "config.json", what, fix) for module, what, fix in meta_mismatches(ks, widths)]


def module_problems(pack: PackView, m: ModuleInfo, settings: CheckSettings) -> list[Problem]:
    """One escha-coded module: in a pack whose config.json says EXL3, a module the exl3 plugin cannot load; its layout
    (docs/escha-format.md): an int16 ``(in/16, out/16, 16*K)`` code of an integer K and whole 128-feature blocks, its
    four scale vectors present, floating, of the code's widths (:func:`_scale_problems`), no dense ``.weight`` beside
    it, a bias that fits; and with ``settings.values``, where all of that holds, finite, plausible scales."""
    key, t = m.key, m.tensors
    out: list[Problem] = []
    if pack.config_method == EXL3 and key.rsplit(".", 1)[-1] not in TOKEN_EMBEDDINGS:
        what = (
            "an escha-coded module in an EXL3 pack (config.json's quant_method 'exl3'): the exl3 plugin loads "
            "EXL3 trellises and dense weights, so vLLM's loader would stop in the worker"
        )
        fix = "re-convert the pack in one format (an escha pack says quant_method 'escha' in config.json)"
        out.append(Problem(key, f"{key}.{CODE}", what, fix))
    layout = _code_problems(m) + _scale_problems(m)
    if "bias" in t and (misfit := bias_misfit(t["bias"], (m.padded_shape or (0, 0))[1])):
        layout.append(Problem(key, f"{key}.bias", misfit, FIX_META))
    if "weight" in t:
        what = f"a dense .weight stored beside the module's .{CODE}: the pack holds two versions of this layer"
        layout.append(
            Problem(
                key, f"{key}.weight", what, "remove the one that does not belong, or re-download / re-convert the pack"
            )
        )
    if settings.values and not layout and not any(i.file in pack.bad_files for i in t.values()):
        layout += _value_problems(pack, key)
    return out + layout


def _code_problems(m: ModuleInfo) -> list[Problem]:
    """The code's dtype, width (an integer K) and features (whole 128-feature blocks)."""
    code = m.tensors[CODE]
    name = f"{m.key}.{CODE}"
    out: list[Problem] = []
    if code.dtype != torch.int16:
        out.append(Problem(m.key, name, f"dtype {dtype_name(code.dtype)}, an escha code is int16", FIX_META))
    width = code.shape[-1]
    if width % TILE or not 1 <= width // TILE <= 8:
        what = f"width {width} (shape {list(code.shape)}) is not 16*K for an integer K in 1..8"
        out.append(Problem(m.key, name, what, FIX_META))
    kp, np_ = m.padded_shape or (0, 0)
    if kp % HAD_BLOCK or np_ % HAD_BLOCK:
        what = f"shape {list(code.shape)} gives {kp}x{np_} features, not multiples of {HAD_BLOCK}"
        out.append(Problem(m.key, name, what, FIX_META))
    return out


def _scale_problems(m: ModuleInfo) -> list[Problem]:
    """Each side's scales: where both are floating vectors of one length other than the code's, the code (it does
    not belong to its scales); else each scale missing, or not a float vector of the code's width."""
    key, t = m.key, m.tensors
    code = t[CODE]
    kp, np_ = m.padded_shape or (0, 0)
    out: list[Problem] = []
    for names, length, side in ((IN_SCALES, kp, "input"), (OUT_SCALES, np_, "output")):
        vectors = [t[s] for s in names if s in t]
        lengths = {v.shape for v in vectors if v.dtype.is_floating_point}
        if len(vectors) == len(names) and len(lengths) == 1 and (only := lengths.pop()) != (length,):
            # both scale vectors of the side agree: the code is the tensor that does not fit
            held = " and ".join(f".{s}" for s in names)
            what = (
                f"shape {list(code.shape)} gives {length} {side} features, but {held} both hold {list(only)}: "
                "the code does not belong to its scales (cut short, or another module's)"
            )
            out.append(Problem(key, f"{key}.{CODE}", what, FIX_META))
            continue
        for suffix in names:
            v = t.get(suffix)
            if v is None:
                fix = f"the pack is incomplete: {FIX_META}"
                out.append(Problem(key, f"{key}.{suffix}", f"missing (the .{CODE} is there)", fix))
            elif not v.dtype.is_floating_point or v.shape != (length,):
                what = (
                    f"{dtype_name(v.dtype)} {list(v.shape)}; the code's {side} side needs a float vector of [{length}]"
                )
                out.append(Problem(key, f"{key}.{suffix}", what, FIX_META))
    return out


def _value_problems(pack: PackView, key: str) -> list[Problem]:
    """Finite scales, none beyond the value limit (not held to be non-zero: escha's rout may hold zeros for pruned
    channels)."""
    out: list[Problem] = []
    for suffix in (*IN_SCALES, *OUT_SCALES):
        name = f"{key}.{suffix}"
        v = read_value(pack, key, name, out)
        if v is not None:
            out += finite_problems(key, name, v)
            out += implausible_vector_problems(key, name, v, scale=True, zero_ok=True)
    return out


def unproven_sizes(pack: PackView) -> list[str]:
    """The escha modules whose outputs config.json ends inside their padding: the pack check holds such sizes
    against EXL3's padded scales, which escha's writers do not zero."""
    padded = [
        k
        for k, m in pack.modules.items()
        if m.format == NAME
        and (shape := pack.config_logical_shape(m)) is not None
        and m.padded_shape is not None
        and shape[1] < m.padded_shape[1]
    ]
    return (
        [f"the outputs of {len(padded)} escha module(s) ending inside their padding ({padded[0]}, ...)"]
        if padded
        else []
    )
