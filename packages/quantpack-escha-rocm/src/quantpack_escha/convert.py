"""``quantpack escha-from-exl3``: an EXL3 pack coded with the mcg codebook, rewritten as an escha pack.

escha's codes are EXL3 trellis tiles decoded with mcg (docs/escha-format.md), so each EXL3 module becomes an escha
module with the same code: ``escha_code = trellis``, and the EXL3 scales (applied around normalized transforms)
split into escha's four (applied around unnormalized ones): ``s_in * rin = suh / sqrt(128)`` and
``rout * s_out = svh / sqrt(128)``. By default the split is the plain one, ``s_in = s_out = 1`` (the same pack for the
same source, byte for byte); ``random_split`` (a test device) draws ``s_in`` / ``s_out`` at random in [0.5, 2] so that
a reader who swaps the pre- and post-scales, or drops one, gets a different layer. ``embed_tokens`` and ``lm_head``
(an EXL3 head
is decoded first) are stored as int8 rows ``weight_int8`` with a float16 per-row ``weight_scale``, as escha packs
store them. ``layer_meta`` lists every coded module with its K; optionally each coded module gets a random nonzero
``bias`` (which escha never applies) and the config switches the model's biases on so that they are loaded.

The source pack is only read; the output directory must be new or empty.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from quantpack_core.codec import HAD_BLOCK, Codebook, dequantize
from quantpack_core.embedding import check_output_folder, default_file_mode, quantize_rows
from quantpack_core.errors import QuantpackError
from quantpack_core.inventory import INDEX_FILE, MANIFEST_FILE
from quantpack_core.names import EXPERT_MODULE, normalize_prefix
from quantpack_core.pack import Pack

from .codec import CODE

#: files of the source pack not copied (rewritten, or describing the EXL3 pack: its layout, exllamav3's logits of it)
NOT_COPIED = {INDEX_FILE, MANIFEST_FILE, "config.json", "reference_logits.pt"}
INT8_TABLES = ("embed_tokens", "lm_head")


class ConversionError(QuantpackError):
    """The source pack cannot become an escha pack (the message names the module and why)."""


@dataclass(frozen=True)
class ConversionReport:
    """What :func:`escha_from_exl3` wrote.

    Attributes:
        out_dir: the escha pack.
        coded: coded modules (checkpoint names) -> K.
        int8_tables: modules stored as int8 rows.
        biases: whether random biases were written.
    """

    out_dir: Path
    coded: dict[str, int]
    int8_tables: tuple[str, ...]
    biases: bool


def split_scale(total: torch.Tensor, g: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``total`` (float32) as ``(r, s)`` float16 with ``r * s ~= total``: ``s`` random in [0.5, 2] drawn from ``g``,
    or 1 without a generator; ``r`` the rest."""
    if g is None:
        return total.half(), torch.ones_like(total, dtype=torch.float16)
    s = torch.exp2(torch.rand(total.shape, generator=g) * 2 - 1).half()
    r = (total / s.float()).half()
    return r, s


def escha_from_exl3(
    src: str | Path, out: str | Path, *, seed: int = 0, biases: bool = False, random_split: bool = False
) -> ConversionReport:
    """Write the escha pack of an mcg-coded EXL3 pack (see the module).

    Args:
        src: the EXL3 pack (validated first; only read).
        out: the new escha pack's directory (created; must not exist or be empty).
        seed: seed of the random scale split and the biases.
        biases: write a random nonzero ``bias`` for every coded module and set the config's ``attention_bias`` /
            ``mlp_bias`` (a test device).
        random_split: split each scale at random (a test device; see the module) instead of ``s_in = s_out = 1``.

    Returns:
        a :class:`ConversionReport`.

    Raises:
        PackError: an unsound source pack.
        ConversionError: a module coded with another codebook than mcg, coded experts (escha expert banks are not
            served), a table already in int8 rows, or a pack without a token embedding.
        FileExistsError: ``out`` exists and is not empty.
    """
    src, dst = Path(src), Path(out)
    pack = Pack.open(src)
    check_source(pack)
    check_output_folder(src, dst)
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    coded: dict[str, int] = {}
    meta: dict[str, dict] = {}
    tables: list[str] = []
    for key, m in pack.modules.items():
        if normalize_prefix(key).rsplit(".", 1)[-1] in INT8_TABLES:
            q, s = int8_table(pack, key)
            tensors[f"{key}.weight_int8"], tensors[f"{key}.weight_scale"] = q, s
            tables.append(key)
        elif m.format != "exl3":
            for info in m.tensors.values():
                tensors[info.name] = pack.get_tensor(info.name)
        else:
            coded[key], meta[key] = escha_module(pack, key, tensors, g if random_split else None, g if biases else None)
    if not tables:
        raise ConversionError(f"{src}: no embed_tokens table found; an escha pack stores it as int8 rows")
    pack.close()
    config = json.loads((src / "config.json").read_text())
    bits = sum(coded.values()) / max(len(coded), 1)
    config["quantization_config"] = {"quant_method": "escha", "bits": bits, "layer_meta": meta}
    if biases:
        config["attention_bias"] = config["mlp_bias"] = True
    write_escha_pack(src, dst, tensors, config)
    return ConversionReport(dst, coded, tuple(tables), biases)


def check_source(pack: Pack) -> None:
    """:class:`ConversionError` for a pack escha cannot serve: a module coded with another codebook than mcg, or
    coded experts."""
    other = {k: m.codebook for k, m in pack.modules.items() if m.format == "exl3" and m.codebook != Codebook.MCG}
    if other:
        k, cb = next(iter(other.items()))
        raise ConversionError(
            f"{k}: coded with the {cb.value} codebook ({len(other)} modules are not mcg); escha decodes mcg codes only "
            "- quantize the model with exllamav3's --codebook mcg and convert that pack"
        )
    experts = [k for k, m in pack.modules.items() if m.format == "exl3" and EXPERT_MODULE.match(k)]
    if experts:
        raise ConversionError(
            f"{experts[0]}: an expert of an MoE bank ({len(experts)} expert projections are coded); this version of "
            "quantpack-escha-rocm serves no escha expert banks, so the pack it would write could not load - serve "
            "the EXL3 pack with quantpack-exl3"
        )


def int8_table(pack: Pack, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight_int8, weight_scale)`` of the embedding or head ``key``: its rows (an EXL3 head decoded and trimmed
    to the vocabulary and hidden size of the config, or a dense table) as int8 with a float16 scale per row.

    Raises:
        ConversionError: a table already in int8 rows, or of another format.
    """
    m = pack.modules[key]
    if m.format == "exl3":
        w = dequantize(pack.exl3_tensors(key), torch.float32).T  # (out, in), padded
        text = pack.config.get("text_config") or pack.config
        leaf = normalize_prefix(key).rsplit(".", 1)[-1]
        vocab = int(text.get("vocab_size", w.shape[0])) if leaf == "lm_head" else w.shape[0]
        hidden = int(text.get("hidden_size", w.shape[1]))
        w = w[:vocab, :hidden]
    elif "weight" in m.tensors:
        w = pack.get_tensor(m.tensors["weight"].name)
    elif m.format == "int8-rows":
        raise ConversionError(
            f"{key}: already int8 rows (quantpack embed-int8); convert the pack from before embed-int8, whose "
            "table the converter quantizes itself"
        )
    else:
        raise ConversionError(f"{key}: neither an EXL3 nor a dense table; cannot store it as int8 rows")
    q, s = quantize_rows(w)
    return q, s.half()


def escha_module(
    pack: Pack, key: str, tensors: dict[str, torch.Tensor], split: torch.Generator | None, bias: torch.Generator | None
) -> tuple[int, dict]:
    """Add the escha tensors of the EXL3 module ``key`` to ``tensors``: its code, the four scales (split at random
    from ``split``, else plainly), its config, and its bias (the source's, else a random one from ``bias``, else
    none). Returns ``(K, its layer_meta entry)``."""
    t = pack.exl3_tensors(key)
    k_in, n_out = t.padded_shape
    k_bits = int(t.k_bits)
    rin, s_in = split_scale(t.suh.float() / math.sqrt(HAD_BLOCK), split)
    rout, s_out = split_scale(t.svh.float() / math.sqrt(HAD_BLOCK), split)
    tensors.update(
        {
            f"{key}.{CODE}": t.trellis.contiguous(),
            f"{key}.escha_rin": rin,
            f"{key}.escha_s_in": s_in,
            f"{key}.escha_rout": rout,
            f"{key}.escha_s_out": s_out,
            f"{key}.escha_config": torch.tensor([16, k_bits, 2, 1, k_in, n_out], dtype=torch.int32),
        }
    )
    logical_shape = pack.modules[key].logical_shape
    logical = logical_shape[1] if logical_shape and logical_shape[1] else n_out
    if t.bias is not None:  # carried as the source stores it (escha never applies it)
        tensors[f"{key}.bias"] = t.bias
    elif bias is not None:
        tensors[f"{key}.bias"] = (torch.randn(logical, generator=bias) * 0.5).half()
    return k_bits, {"K": k_bits, "bits": k_bits, "in_features": k_in, "out_features": n_out}


def write_escha_pack(src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """Write the escha pack into a hidden folder beside ``dst`` and move it into place whole, so that a conversion
    that fails (a full disk) leaves no partial pack where ``dst`` was asked for: ``tensors`` in one
    model.safetensors, ``config``, and the source's other files but those of :data:`NOT_COPIED`."""
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.TemporaryDirectory(dir=dst.parent, prefix=f".{dst.name}.partial-")
    except OSError as e:
        raise ConversionError(f"{dst}: cannot write there ({e.strerror or e})") from e
    with staging as tmp:
        work = Path(tmp) / "pack"
        work.mkdir()
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name not in NOT_COPIED:
                shutil.copy2(f, work / f.name)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(work / "model.safetensors"), {"format": "pt"})
        default_file_mode(work / "model.safetensors")
        (work / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if dst.is_dir():
            dst.rmdir()  # the empty folder check_output_folder accepted
        work.rename(dst)
