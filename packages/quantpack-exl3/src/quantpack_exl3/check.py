"""The EXL3 format's rules of the pack check (:class:`~quantpack_core.format.PackFormat`, through
:class:`~quantpack_exl3.format.Exl3Format`): one module's trellis, scales and markers (:func:`module_problems`, their
values :func:`value_problems`), each manifest entry's codebook multipliers (:func:`manifest_problems`), one codebook
per pack (:func:`codebook_mixture_problems`), and sizes inside the padding held against the padded scales
(:func:`padding_problems`). No vLLM import: quantpack-core's check runs them where quantpack-core alone is installed
beside this package.

Follows docs/exl3-format.md ("Tensors of one layer") and exllamav3 (``exllamav3/modules/quant/exl3.py``; its converter
``exllamav3/conversion/convert_model.py``: one codebook per pack, the multipliers it records, the padding it writes).
"""

from __future__ import annotations

import torch

from quantpack_core.check.base import bias_misfit
from quantpack_core.check.layers import OTHER_STACKS
from quantpack_core.check.settings import CheckSettings
from quantpack_core.check.values import finite_problems, implausible_vector_problems, read_value
from quantpack_core.codec import check_marker
from quantpack_core.codec.codebook import Codebook
from quantpack_core.codec.exl3 import FORMAT
from quantpack_core.codec.hadamard import HAD_BLOCK
from quantpack_core.codec.trellis import HALF_K, TILE
from quantpack_core.errors import CodecError, Problem
from quantpack_core.inventory import FIX_REDOWNLOAD, MANIFEST_FILE, ModuleInfo, PackView, TensorInfo, dtype_name

FIX_REQUANTIZE = "re-quantize this module with exllamav3, or re-download the pack"
#: which config.json sizes fix a projection's outputs (:meth:`quantpack_core.pack.Pack.config_logical_shape`), for
#: messages
OUTPUT_SIZES = {
    "q_proj": "num_attention_heads x head_dim",
    "k_proj": "num_key_value_heads x head_dim",
    "v_proj": "num_key_value_heads x head_dim",
    "gate_proj": "intermediate_size",
    "up_proj": "intermediate_size",
    "in_proj_qkvz": "the linear attention's heads x their widths",
}
#: an EXL3 module's tensors beside its trellis: scales (legacy packed signs) and codebook markers
VECTORS = frozenset({"suh", "svh", "su", "sv", "mcg", "mul1"})


def codebook_of(t: dict[str, TensorInfo]) -> Codebook | None:
    """The codebook a module's markers say (``.mcg`` / ``.mul1``, none: 3INST); None when it holds both."""
    return None if ("mcg" in t and "mul1" in t) else Codebook.from_markers("mcg" in t, "mul1" in t)


def remains(t: dict[str, TensorInfo]) -> bool:
    """The vectors of an EXL3 layer whose trellis is gone (nor a dense weight beside them)."""
    return bool(t.keys() & VECTORS) and "trellis" not in t and "weight" not in t


def pack_codebook(pack: PackView) -> Codebook | None:
    """The codebook the pack's quantization config names (exllamav3 writes ``codebook``), or None."""
    name = pack.quant_config.get("codebook")
    try:
        return Codebook.parse(name) if isinstance(name, str) else None
    except CodecError:
        return None


def module_problems(pack: PackView, m: ModuleInfo, settings: CheckSettings) -> list[Problem]:
    """One EXL3 module: an int16 trellis of a legal width and whole 128-feature blocks; one codebook marker, mul1 for
    a half-integer K, the one quantization_config names; suh / svh (or legacy su / sv) of the trellis' widths; a bias
    that fits; no dense weight beside the trellis; with ``settings.values``, where all of that holds, the markers'
    values and finite, plausible scales (:func:`value_problems`)."""
    key, t = m.key, m.tensors
    if "trellis" not in t:
        what = f"missing: the module has {', '.join(sorted('.' + s for s in t))} but no trellis"
        fix = f"the pack is incomplete: re-download the shard that should hold {key}.trellis"
        return [Problem(key, f"{key}.trellis", what, fix)]
    out = _trellis_problems(m) + _codebook_problems(pack, m) + _scale_problems(m)
    if "bias" in t and (misfit := bias_misfit(t["bias"], (m.padded_shape or (0, 0))[1])):
        out.append(Problem(key, f"{key}.bias", misfit, FIX_REQUANTIZE))
    if "weight" in t:
        what = "a dense .weight stored beside the module's .trellis: the pack holds two versions of this layer"
        fix = "remove the one that does not belong, or re-download / re-quantize the pack"
        out.append(Problem(key, f"{key}.weight", what, fix))
    if settings.values and not out and not any(i.file in pack.bad_files for i in t.values()):
        out += value_problems(pack, key, t)
    return out


def _trellis_problems(m: ModuleInfo) -> list[Problem]:
    """The trellis' dtype, width (a legal K) and features (whole Hadamard blocks)."""
    tr = m.tensors["trellis"]
    name = f"{m.key}.trellis"
    out: list[Problem] = []
    if tr.dtype != torch.int16:
        out.append(Problem(m.key, name, f"dtype {dtype_name(tr.dtype)}, an EXL3 trellis is int16", FIX_REQUANTIZE))
    if m.k_bits is None:
        legal = "16*K for K in 1..8, or 16*KA+8 for K in 1.5/2.5/3.5"
        what = f"width {tr.shape[-1]} (shape {list(tr.shape)}) is not {legal}"
        out.append(Problem(m.key, name, what, FIX_REQUANTIZE))
    if tr.shape[0] * TILE % HAD_BLOCK or tr.shape[1] * TILE % HAD_BLOCK:
        what = (
            f"shape {list(tr.shape)} gives {tr.shape[0] * TILE}x{tr.shape[1] * TILE} features, not "
            f"multiples of {HAD_BLOCK} (the Hadamard block)"
        )
        out.append(Problem(m.key, name, what, FIX_REQUANTIZE))
    return out


def _codebook_problems(pack: PackView, m: ModuleInfo) -> list[Problem]:
    """Both markers; a half-integer K without mul1; a marker other than the codebook quantization_config names
    (exllamav3 quantizes a whole pack with one codebook, marked per tensor: a lost, or stray, marker would silently
    decode the layer with another codebook; the tensor named is the marker the module has, or the one it lacks;
    where every coded module disagrees alike, quantization_config is what is wrong)."""
    key, t = m.key, m.tensors
    if "mcg" in t and "mul1" in t:
        what = "both .mcg and .mul1 markers present; a tensor uses exactly one codebook"
        fix = "remove the marker that does not match how this tensor was quantized, or re-quantize it"
        return [Problem(key, f"{key}.mul1", what, fix)]
    if m.k_bits in HALF_K and m.codebook is not Codebook.MUL1:
        what = (
            f"half-integer K={m.k_bits:g} needs the mul1 codebook, the module has "
            f"{m.codebook.value if m.codebook else 'none'}"
        )
        return [Problem(key, f"{key}.trellis", what, FIX_REQUANTIZE)]
    said = pack_codebook(pack)
    if said is None or m.codebook is None or m.codebook is said:
        return []
    if m.codebook is Codebook.INST3:
        what = f"its .{said.value} marker is missing (quantization_config says codebook {said.value}; without "
        what += "the marker the layer would decode as 3inst)"
        config_fix = 'where no coded layer has a marker, set quantization_config\'s codebook to "3inst"'
    else:
        what = f"has a .{m.codebook.value} marker, but quantization_config says codebook {said.value}"
        config_fix = (
            f'where every coded layer has that marker, set quantization_config\'s codebook to "{m.codebook.value}"'
        )
    fix = (
        f"{config_fix} (config.json and any quantization_config.json); otherwise re-download the pack's file that "
        "holds this layer"
    )
    marker = said.value if m.codebook is Codebook.INST3 else m.codebook.value
    return [Problem(key, f"{key}.{marker}", what, fix)]


def _scale_problems(m: ModuleInfo) -> list[Problem]:
    """suh / svh float16 of the trellis' input / output widths, or legacy packed signs su / sv (int16, one bit per
    feature); neither: missing."""
    key, t = m.key, m.tensors
    tr = t["trellis"]
    out: list[Problem] = []
    for side, legacy, length in (("suh", "su", m.padded_shape[0]), ("svh", "sv", m.padded_shape[1])):
        if side in t:
            v = t[side]
            if v.dtype != torch.float16:
                out.append(
                    Problem(key, f"{key}.{side}", f"dtype {dtype_name(v.dtype)}, expected float16", FIX_REQUANTIZE)
                )
            if v.shape != (length,):
                what = f"shape {list(v.shape)}, the trellis {list(tr.shape)} needs [{length}]"
                out.append(Problem(key, f"{key}.{side}", what, FIX_REQUANTIZE))
        elif legacy in t:
            v = t[legacy]
            if v.dtype != torch.int16 or v.shape != (length // 16,):
                what = (
                    f"legacy packed signs are {dtype_name(v.dtype)} {list(v.shape)}, the trellis {list(tr.shape)} "
                    f"needs int16 [{length // 16}]"
                )
                out.append(Problem(key, f"{key}.{legacy}", what, FIX_REQUANTIZE))
        else:
            fix = f"the pack is incomplete: re-download the shard that should hold {key}.{side}"
            out.append(Problem(key, f"{key}.{side}", "missing (the trellis is there)", fix))
    return out


def value_problems(pack: PackView, key: str, t: dict[str, TensorInfo]) -> list[Problem]:
    """Marker values and finite, plausible suh / svh of one otherwise sound EXL3 module."""
    out: list[Problem] = []
    for suffix in ("mcg", "mul1", "suh", "svh"):
        if suffix not in t:
            continue
        name = f"{key}.{suffix}"
        v = read_value(pack, key, name, out)
        if v is None:
            continue
        if suffix in ("mcg", "mul1"):
            try:
                check_marker(v, Codebook(suffix))
            except CodecError as e:
                out.append(Problem(key, name, str(e), FIX_REQUANTIZE))
        else:
            out += finite_problems(key, name, v)
            out += implausible_vector_problems(key, name, v, scale=True)
    return out


def manifest_states_codebooks(pack: PackView) -> bool:
    """Whether the pack's manifest records codebook multipliers (``mcg_multiplier`` / ``mul1_multiplier``, as
    exllamav3 writes them into ``tensor_storage``): it then states each coded module's codebook (none recorded:
    3INST), and :func:`manifest_problems` holds every module's markers against it."""
    return any(
        isinstance(e, dict) and ("mcg_multiplier" in e or "mul1_multiplier" in e) for e in pack.manifest.values()
    )


def manifest_problems(pack: PackView, module: str, entry: dict) -> list[Problem]:
    """An EXL3 module's markers against its manifest entry, where the quantization config names no codebook (where
    it does, :func:`module_problems` names the module already): exllamav3 records each coded module's codebook
    multiplier, so a module without its marker would decode as 3INST, silently wrong; and a manifest that records
    multipliers records every marker, so a marker it does not record was added."""
    m = pack.modules.get(module)
    if pack_codebook(pack) is not None or not isinstance(entry, dict) or m is None or m.format != FORMAT:
        return []
    out: list[Problem] = []
    stated = manifest_states_codebooks(pack)
    for marker in ("mcg", "mul1"):
        if f"{marker}_multiplier" in entry and marker not in m.tensors:
            what = (
                f"{MANIFEST_FILE} records a {marker} multiplier for this module, but it has no .{marker} "
                "marker: it would decode with the 3INST codebook, silently wrong"
            )
            out.append(Problem(module, f"{module}.{marker}", what, FIX_REDOWNLOAD))
        elif stated and f"{marker}_multiplier" not in entry and marker in m.tensors:
            what = (
                f"has a .{marker} marker, but {MANIFEST_FILE}, which records the codebook multipliers, "
                "records none for this module: it was quantized with another codebook"
            )
            out.append(Problem(module, f"{module}.{marker}", what, FIX_REDOWNLOAD))
    return out


def codebook_mixture_problems(pack: PackView) -> list[Problem]:
    """One codebook per pack, unless the config says otherwise: exllamav3 quantizes a whole pack with one codebook
    and marks it on every coded module (``.mcg`` / ``.mul1``; none for 3INST), so where ``quantization_config``
    names no codebook and the manifest records no multipliers (:func:`manifest_states_codebooks`), EXL3 modules of
    several codebooks mean markers lost or added. A lost ``.mul1`` decodes its layer as 3INST: accepted before, one
    layer of 29 so decoded gave KL 5.50 nats, top-1 2.4% (vLLM 0.32, llama-tiny). Each module of the codebooks
    fewer modules use is named (ties: the marked ones' minority is the unmarked). Where the config names one, each
    module is held against it (:func:`module_problems`)."""
    if pack_codebook(pack) is not None or manifest_states_codebooks(pack):
        return []
    groups: dict[Codebook, list[str]] = {}
    for key, m in pack.modules.items():
        if m.format == FORMAT and m.codebook is not None:
            groups.setdefault(m.codebook, []).append(key)
    if len(groups) < 2:
        return []
    # the codebook most modules use is taken as the pack's; on a tie the marked one (a marker is not lost by chance)
    main = max(groups, key=lambda c: (len(groups[c]), c is not Codebook.INST3))
    counts = ", ".join(f"{len(v)} {c.value}" for c, v in sorted(groups.items(), key=lambda kv: -len(kv[1])))
    fix = (
        f"re-download the file that holds the module (or re-quantize the pack); a pack quantized with several "
        f"codebooks on purpose states them: quantization_config's codebook, or {MANIFEST_FILE}'s per-module "
        "mcg_multiplier / mul1_multiplier as exllamav3 writes them"
    )
    out: list[Problem] = []
    for codebook, keys in groups.items():
        if codebook is main:
            continue
        for key in keys:
            if codebook is Codebook.INST3:
                tensor = f"{key}.{main.value}"
                what = f"has no codebook marker (3INST) while the pack's other coded modules are {main.value}"
            else:
                tensor = f"{key}.{codebook.value}"
                what = f"has a .{codebook.value} marker while the pack's other coded modules are {main.value}"
            what += f" ({counts}; quantization_config names no codebook): one codebook per pack"
            out.append(Problem(key, tensor, what, fix))
    return out


def padding_problems(pack: PackView) -> list[Problem]:
    """Sizes inside EXL3's 128-feature padding, which the stored shapes cannot tell apart (``num_key_value_heads`` 1
    or 2 of 64 features both store 128; ``intermediate_size`` 520, 600 or 640 store 640), held against the padded
    outputs' scales: exllamav3's converter zero-pads a layer to whole blocks (``Linear.pad_out``) and its
    quantizer sets the output scale of an all-zero output channel to 0 (``regularize``: ``sv[zero_out_scales] =
    0``; ``refit_scales`` keeps it), so ``svh`` is 0 past the layer's real outputs. Where config.json's sizes
    (:meth:`~quantpack_core.pack.Pack.config_logical_shape`) end inside the stored outputs of an EXL3 projection and
    ``svh`` is not 0 beyond them, the layer holds more features than config.json says: vLLM would serve it as garbage
    without a word (``num_key_value_heads`` 1 for 2: KL 3.98 nats, top-1 10%; ``intermediate_size`` 600 for 640: KL
    0.077). Not for the head (a vocabulary a model pads itself), a tower's or a draft's modules."""
    out: list[Problem] = []
    for key, m in pack.modules.items():
        leaf = key.rsplit(".", 1)[-1]
        if m.format != FORMAT or leaf == "lm_head" or OTHER_STACKS.search(key) or "svh" not in m.tensors:
            continue
        logical = pack.config_logical_shape(m)
        stored = m.padded_shape[1] if m.padded_shape else None
        if logical is None or stored is None or logical[1] >= stored:
            continue
        svh = read_value(pack, key, f"{key}.svh", out)
        if svh is None or svh.shape != (stored,):
            continue
        live = svh[logical[1] :].float().nonzero()
        if live.numel():
            first = logical[1] + int(live[0, 0])
            sizes = OUTPUT_SIZES.get(leaf, "sizes")
            if ".shared_expert" in key and leaf in ("gate_proj", "up_proj"):
                sizes = "shared_expert_intermediate_size"
            elif ".experts." in key and leaf in ("gate_proj", "up_proj"):
                sizes = "moe_intermediate_size"
            what = (
                f"config.json gives it {logical[1]} outputs ({sizes}) of the {stored} stored, but svh scales output "
                f"{first} (and {live.numel() - 1} more past {logical[1]}): exllamav3 writes 0 there for padding, so "
                "the layer holds more features than config.json says and would be served as garbage"
            )
            out.append(Problem(key, f"{key}.svh", what, "use the config.json the pack was made with"))
    return out
