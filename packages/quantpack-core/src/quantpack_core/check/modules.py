"""Each module's storage: a norm or a token embedding stored quantized, int8 rows inside a decoder layer, a coded
module's own rules (its format's :meth:`~quantpack_core.format.PackFormat.module_problems`), an int8 table's rows and
scales, a dense module's dtype and values (:func:`module_problems`); modules vLLM fuses stored in different kinds
(:func:`fused_problems`); tensors a module holds that its vLLM layer has no parameter for
(:func:`stray_tensor_problems`).
"""

from __future__ import annotations

import re
from collections import Counter

import torch

from ..errors import Problem
from ..format import pack_formats
from ..inventory import DENSE, FIX_REDOWNLOAD, INT8_ROW_NAMES, INT8_ROWS, OTHER, ModuleInfo, PackView, dtype_name
from ..names import FUSED_LAYERS
from .architectures import stated_class
from .base import TOKEN_EMBEDDINGS, is_coded, is_quantized, main_tensor, storage_label, with_article
from .layers import FIX_DENSE, LAYER_KEY, OTHER_STACKS, is_norm, skipped_by_vllm
from .settings import CheckSettings
from .shapes import OUTSIDE_LAYERS
from .values import vector_problems

#: the tensors vLLM loads into a dense module of a stated class's decoder layers (whether a bias belongs is the
#: layout check's), and into its token embedding, final norm and head (none of them has a bias in those classes)
DENSE_SUFFIXES = frozenset({"weight", "bias"})
OUTSIDE_SUFFIXES = frozenset({"weight"})
FIX_STRAY = "remove the stray tensor(s) from a copy of the pack (and from its index), or re-download the pack"


def module_problems(pack: PackView, settings: CheckSettings) -> list[Problem]:
    """Every module's storage, module by module: where it is stored (:func:`_placement_problems`), then a coded
    module by its format's rules, any other by the int8 table, dtype and (with ``settings.values``) value rules."""
    out: list[Problem] = []
    formats = pack_formats()
    for m in pack.modules.values():
        out += _placement_problems(m)
        if m.format in formats:
            out += formats[m.format].module_problems(pack, m, settings)
            continue
        out += _int8_pair_problems(m)
        out += _dense_dtype_problems(m)
        if settings.values and m.format in (DENSE, INT8_ROWS, OTHER):
            out += vector_problems(pack, m)
    return out


def _placement_problems(m: ModuleInfo) -> list[Problem]:
    """A norm (:func:`~quantpack_core.check.layers.is_norm`) stored quantized: vLLM builds every norm without the
    quantization config and loads a dense weight only. A module of a decoder layer (or a tower's) stored as int8
    rows: the plugins serve int8 rows through their embedding method only, which vLLM builds for token embeddings and
    heads, never inside a layer (vLLM: "There is no module or parameter named ...qweight"; a fused q / k / v or gate /
    up: the plugin's LayerLoadError). A token embedding stored coded: vLLM's embedding loads a dense table, or int8
    rows through the project's embedding method (:mod:`quantpack_core.vllm.embedding`), nothing else ("There is no
    module or parameter named 'embed_tokens.mul1'", vLLM 0.32). Each would stop vLLM's loader in the worker."""
    out: list[Problem] = []
    tensor = f"{m.key}.{main_tensor(m)}"
    if is_quantized(m) and is_norm(m.key):
        what = (
            f"a norm stored as {storage_label(m)}: vLLM builds norms without the quantization config "
            "and loads a dense weight only, so its loader would stop in the worker"
        )
        out.append(Problem(m.key, tensor, what, FIX_DENSE))
    elif m.format == INT8_ROWS and LAYER_KEY.search(m.key):
        what = (
            "stored as int8 rows, which the plugins serve for token embeddings and heads only (`quantpack "
            "embed-int8`'s tables): vLLM's layer here loads a trellis or a dense weight, so its load would stop in "
            "the worker"
        )
        fix = "store the module as exllamav3's converter writes it (a trellis or a dense weight): re-convert the pack"
        out.append(Problem(m.key, tensor, what, fix))
    if is_coded(m) and m.key.rsplit(".", 1)[-1] in TOKEN_EMBEDDINGS:
        what = (
            f"the token embedding stored as {storage_label(m)}: vLLM's embedding takes a dense table or "
            "int8 rows only, so its loader would stop in the worker"
        )
        fix = (
            "store the table dense, as exllamav3's converter does (then `quantpack embed-int8` makes it int8 rows, "
            "half its bf16 size): re-convert the pack, or re-download it if it was altered"
        )
        out.append(Problem(m.key, tensor, what, fix))
    return out


def _int8_pair_problems(m: ModuleInfo) -> list[Problem]:
    """An int8 table's rows without their per-row scales or the reverse (either naming of
    :data:`~quantpack_core.inventory.INT8_ROW_NAMES`), rows that are not int8, and scales that are not one float per
    row."""
    out: list[Problem] = []
    owners = {"weight", *(fmt.main_suffix for fmt in pack_formats().values())}
    for rows, scales in INT8_ROW_NAMES:
        r, sc = m.tensors.get(rows), m.tensors.get(scales)
        if r is not None and sc is not None and r.dtype != torch.int8:
            what = f"{dtype_name(r.dtype)} {list(r.shape)}, not int8: the rows of an int8 table with .{scales}"
            out.append(Problem(m.key, f"{m.key}.{rows}", what, FIX_REDOWNLOAD))
            continue
        if (r is None) == (sc is None):
            if (
                r is not None
                and r.dtype == torch.int8
                and (len(r.shape) != 2 or sc.shape != (r.shape[0],) or not sc.dtype.is_floating_point)
            ):
                what = (
                    f"{dtype_name(sc.dtype)} {list(sc.shape)}; the int8 rows {list(r.shape)} need one float scale "
                    "per row"
                )
                out.append(Problem(m.key, f"{m.key}.{scales}", what, FIX_REDOWNLOAD))
            continue
        have, lack = (rows, scales) if r is not None else (scales, rows)
        if have == scales and m.tensors.keys() & owners:
            continue  # a coded or dense module's own scales (an FP8 weight's ``weight_scale``), not an int8 table
        what = f"missing: the module stores .{have} but no .{lack} (an int8 table needs both)"
        out.append(Problem(m.key, f"{m.key}.{lack}", what, f"the pack is incomplete: {FIX_REDOWNLOAD}"))
    return out


def _dense_dtype_problems(m: ModuleInfo) -> list[Problem]:
    """A dense module's ``weight`` or ``bias`` stored as integers or booleans: vLLM's loader copies it into its
    floating parameter, converting each integer as a number (a float16 norm stored as its bits in uint16 then
    holds values in the tens of thousands): served without an error, and wrong."""
    if m.format != DENSE:
        return []
    return [
        Problem(
            m.key,
            f"{m.key}.{suffix}",
            f"dtype {dtype_name(m.tensors[suffix].dtype)}: a dense {suffix} is a floating tensor",
            "store it as float16, bfloat16 or float32 (as exllamav3's converter does), or re-download the pack",
        )
        for suffix in ("weight", "bias")
        if suffix in m.tensors and not m.tensors[suffix].dtype.is_floating_point
    ]


def fused_problems(pack: PackView, settings: CheckSettings) -> list[Problem]:
    """Modules vLLM fuses into one layer (:data:`~quantpack_core.names.FUSED_LAYERS`: q / k / v, gate / up,
    Qwen3.5's in_proj_qkv / in_proj_z and in_proj_b / in_proj_a) stored in different kinds (a dense q_proj beside
    coded k_proj and v_proj): one vLLM layer is all one kind. The plugins refuse such a pack when vLLM builds its
    config (``quantpack_core.vllm.config.check_fused_storage``, from the manifest); named here from the files too,
    so that ``quantpack inspect`` reports it."""
    out: list[Problem] = []
    # each group once (q / k / v back both Llama's qkv_proj and a vision tower's qkv)
    for group in dict.fromkeys(g for alternatives in FUSED_LAYERS.values() for g in alternatives if len(g) > 1):
        parents: dict[str, dict[str, ModuleInfo]] = {}
        for m in pack.modules.values():
            parent, _, last = m.key.rpartition(".")
            if last in group and m.format != OTHER:
                parents.setdefault(parent, {})[last] = m
        for _parent, members in sorted(parents.items()):
            kinds = Counter(m.format for m in members.values())
            if len(kinds) < 2:
                continue
            common = kinds.most_common(1)[0][0]
            odd = next(m for _, m in sorted(members.items()) if m.format != common)
            listing = ", ".join(f"{name} {m.format}" for name, m in sorted(members.items()))
            what = (
                f"stored as {odd.format} while its fused siblings are not ({listing}): vLLM fuses "
                f"{' / '.join(group)} into one layer, which takes one kind"
            )
            fix = "re-quantize the pack with one setting for all of them (or re-download it if it was altered)"
            out.append(Problem(odd.key, f"{odd.key}.{main_tensor(odd)}", what, fix))
    return out


def stray_tensor_problems(pack: PackView, settings: CheckSettings) -> list[Problem]:
    """Tensors a module holds beside its weight that its vLLM layer has no parameter for: on a coded module,
    anything but its format's tensors (:attr:`~quantpack_core.format.LinearFormat.suffixes`, a bias, and a dense
    weight, which the format's rules name: ``q_proj.weird``, ``gate_proj.bias0``); for the model classes whose layer
    the project states (:func:`~quantpack_core.check.architectures.stated_class`), on a dense module of the decoder
    layers anything but ``weight`` and ``bias``, on the token embedding, the final norm or the head anything but
    ``weight``. vLLM's loader stopped on each in the worker without naming it (vLLM 0.32: ``AttributeError:
    'QKVParallelLinear' object has no attribute 'data'``). One problem per module, naming its stray tensors;
    modules that hold only scales or rotary tables are vLLM's to skip
    (:func:`~quantpack_core.check.layers.skipped_by_vllm`)."""
    stated = stated_class(settings.built(pack.config)) is not None
    formats = pack_formats()
    out: list[Problem] = []
    for key, m in pack.modules.items():
        fmt = formats.get(m.format)
        allowed = {*fmt.suffixes, "bias", "weight"} if fmt is not None else None
        if allowed is None and stated and m.format == DENSE and not skipped_by_vllm(key, set(m.tensors)):
            in_layers = re.match(r"model\.layers\.\d{1,9}\.", key) and not OTHER_STACKS.search(key)
            allowed = DENSE_SUFFIXES if in_layers else OUTSIDE_SUFFIXES if key in OUTSIDE_LAYERS else None
        stray = sorted(set(m.tensors) - allowed) if allowed is not None else []
        if stray:
            shown = ", ".join(f".{s}" for s in stray[:6]) + (f" ... ({len(stray)} in all)" if len(stray) > 6 else "")
            kind = with_article(fmt.label) if fmt is not None else "a dense"
            what = (
                f"holds {shown} beside its weight, which {kind} layer has no parameter for: vLLM's loader would stop "
                "on it in the worker without naming it"
            )
            out.append(Problem(key, f"{key}.{stray[0]}", what, FIX_STRAY))
    return out
