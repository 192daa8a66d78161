"""The pack's files: what the reader could not read (:attr:`~quantpack_core.inventory.PackView.unread`), the shard
files against the index and their headers against themselves (:func:`shard_problems`), the manifest against the
files (:func:`manifest_problems`), files the index does not list (:func:`unindexed_problems`) and the tokenizer files
vLLM reads (:func:`tokenizer_problems`).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import Problem
from ..format import pack_formats
from ..inventory import FIX_REDOWNLOAD, INDEX_FILE, MANIFEST_FILE, SAFETENSORS_DTYPES, HeaderEntry, PackView
from ..names import split_tensor_name
from ..ngram import NGRAM_FILE, RECOPY
from .settings import CheckSettings

#: the tokenizer files vLLM reads from the pack folder (when it is also the tokenizer's), each a JSON object
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
FIX_TOKENIZER = "re-download the pack's tokenizer files (or give vLLM --tokenizer with a sound copy)"


def config_read_problems(pack: PackView, settings: CheckSettings) -> list[Problem]:
    """The pack folder and config.json where the reader could not read them (missing, not JSON, not objects)."""
    return list(pack.unread.config)


def manifest_read_problems(pack: PackView, settings: CheckSettings) -> list[Problem]:
    """quantization_config.json where the reader could not read it (not JSON, not objects, shapes that are no lists
    of sizes)."""
    return list(pack.unread.manifest)


def shard_problems(pack: PackView, settings: CheckSettings) -> list[Problem]:
    """The shard files: those the reader could not list, the index where it could not read it, files the index
    names but the pack lacks, several files without an index (or none at all), each header's entries (unreadable,
    of another byte count than their dtype and shape, not where the index says, stored twice), truncated files, and
    tensors the index lists in a file that does not hold them. Nothing where the pack folder is missing (the reader
    named it)."""
    if not pack.path.is_dir():
        return []
    out = list(pack.unread.files)
    out += _absent_shard_problems(pack) if pack.weight_map is not None else _unindexed_shard_problems(pack)
    seen: dict[str, str] = {}  # tensor -> the file first holding it
    for shard in pack.headers:
        f = shard.file
        if shard.error is not None:
            out.append(Problem("", f, shard.error, f"re-download {f}"))
            continue
        for name, entry in shard.entries.items():
            out += _entry_problems(pack, f, name, entry, seen)
        if shard.truncated:
            what = f"truncated: the header describes {shard.start + shard.end} bytes, the file has {shard.size}"
            out.append(Problem("", f, what, f"re-download {f}"))
    for name, f in (pack.weight_map or {}).items():
        if f in pack.files and name not in pack.tensors:
            what = f"listed in {INDEX_FILE} under {f} but absent from that file"
            out.append(Problem(split_tensor_name(name)[0], name, what, f"re-download {f}"))
    return out


def _absent_shard_problems(pack: PackView) -> list[Problem]:
    """The files the index lists that the pack lacks, each with how many tensors it holds."""
    out: list[Problem] = []
    for f in sorted(set(pack.weight_map.values())):
        if f not in pack.present:
            names = [n for n, s in pack.weight_map.items() if s == f]
            what = f"listed in {INDEX_FILE} for {len(names)} tensors (first: {names[0]}) but the file is absent"
            out.append(Problem(split_tensor_name(names[0])[0], f, what, f"download {f} into {pack.path}"))
    return out


def _unindexed_shard_problems(pack: PackView) -> list[Problem]:
    """Without an index: no safetensors file at all, or several (the index says which tensor lives where)."""
    if pack.has_index:  # an index the reader could not read
        return []
    if not pack.present:
        fix = "point at the pack's folder, or download its model*.safetensors files"
        return [Problem("", "*.safetensors", "no safetensors file in the pack", fix)]
    if len(pack.present) > 1:
        what = f"missing while the pack has {len(pack.present)} safetensors files"
        return [Problem("", INDEX_FILE, what, f"download {INDEX_FILE}; it says which tensor lives in which shard")]
    return []


def _entry_problems(pack: PackView, f: str, name: str, entry: HeaderEntry, seen: dict[str, str]) -> list[Problem]:
    """One header entry of file ``f``: unreadable, or of another byte count than its dtype and shape, not where the
    index says it lives, or stored twice (``seen``: the file first holding each tensor, updated)."""
    module = split_tensor_name(name)[0]
    if entry.unknown_dtype is not None:
        what = (
            f"dtype {entry.unknown_dtype!r} in {f}'s header: not one this check reads (float4 / float6 / complex ...)"
        )
        return [Problem(module, name, what, f"store it as one of {', '.join(SAFETENSORS_DTYPES)}, or re-download {f}")]
    if entry.malformed:
        return [Problem(module, name, f"header entry in {f} is malformed: {entry.raw!r}", f"re-download {f}")]
    out: list[Problem] = []
    if entry.end - entry.start != entry.nbytes:
        what = (
            f"header in {f} gives {entry.end - entry.start} bytes for a {entry.raw['dtype']} {list(entry.shape)} "
            f"tensor ({entry.nbytes} bytes)"
        )
        out.append(Problem(module, name, what, f"re-download {f}"))
    listed = pack.weight_map.get(name) if pack.weight_map is not None else f
    if listed is None:
        fix = f"re-download {INDEX_FILE} (or remove the stray tensor from {f})"
        out.append(Problem(module, name, f"present in {f} but not listed in {INDEX_FILE}", fix))
    elif listed != f:
        what = f"present in {f} but {INDEX_FILE} says it lives in {listed}"
        out.append(Problem(module, name, what, f"re-download {INDEX_FILE} and the shards"))
    if name in seen:
        out.append(Problem(module, name, f"stored twice ({seen[name]} and {f})", "keep one copy"))
    else:
        seen[name] = f
    return out


def manifest_problems(pack: PackView, settings: CheckSettings) -> list[Problem]:
    """The manifest's ``stored_tensors`` against the files: a tensor it lists that the files lack (unless its shard
    file or header entry is named already, or a header could not be read: that file explains every tensor it held),
    a dtype or shape it gives otherwise; and each entry of a coded module against the module, by its format
    (:meth:`~quantpack_core.format.PackFormat.manifest_problems`)."""
    out: list[Problem] = []
    unreadable = any(shard.error is not None for shard in pack.headers)
    for module, entry in pack.manifest.items():
        for name, desc in ((entry or {}).get("stored_tensors") or {}).items():
            info = pack.tensors.get(name)
            if info is None:
                if name not in pack.in_absent_shards and name not in pack.bad_entries and not unreadable:
                    what = f"listed in {MANIFEST_FILE} but absent from the pack's safetensors files"
                    out.append(Problem(module, name, what, "the pack is incomplete: re-download it"))
                continue
            want_shape = tuple(desc.get("shape", info.shape))
            want_dtype = str(desc.get("dtype", str(info.dtype)))
            if want_shape != info.shape or want_dtype != str(info.dtype):
                what = (
                    f"{MANIFEST_FILE} says {want_dtype} {list(want_shape)}, the file holds {info.dtype} "
                    f"{list(info.shape)}"
                )
                out.append(Problem(module, name, what, FIX_REDOWNLOAD))
        m = pack.modules.get(module)
        fmt = pack_formats().get(m.format) if m is not None else None
        if fmt is not None:
            out += fmt.manifest_problems(pack, module, entry)
    return out


def unindexed_problems(pack: PackView, settings: CheckSettings) -> list[Problem]:
    """Files a model needs that the pack's index does not list, so copies of a pack often lack them: the hashed
    n-gram table of a model with per-layer n-gram embeddings (config ``ple_layer_ids``: Qwen3.8-Flash-Next).
    Source: docs/families.md (Flash-Next PLE)."""
    for cfg in (pack.config, pack.config.get("text_config") or {}):
        if isinstance(cfg, dict) and cfg.get("ple_layer_ids") and not (pack.path / NGRAM_FILE).is_file():
            what = (
                f"missing: config.json gives per-layer n-gram embeddings (ple_layer_ids {cfg['ple_layer_ids']}), "
                "whose table is stored outside the index"
            )
            return [Problem("", NGRAM_FILE, what, f"{RECOPY} into {pack.path}")]
    return []


def tokenizer_problems(pack: PackView, settings: CheckSettings) -> list[Problem]:
    """The pack's tokenizer files where vLLM (transformers) cannot read them: not a JSON object, a ``tokenizer.json``
    without its ``model``, or one the ``tokenizers`` library refuses (where it is installed, as beside vLLM). vLLM
    reads them after the pack's check, in its own process, and stopped there with a parse error naming no file."""
    out: list[Problem] = []
    for name in TOKENIZER_FILES:
        path = pack.path / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            out.append(Problem("", name, f"not valid JSON ({type(e).__name__}: {str(e)[:80]})", FIX_TOKENIZER))
            continue
        if not isinstance(data, dict):
            out.append(Problem("", name, f"is a JSON {type(data).__name__}, not an object", FIX_TOKENIZER))
        elif name == "tokenizer.json" and (why := _tokenizer_refusal(path, data)):
            out.append(Problem("", name, why, FIX_TOKENIZER))
    return out


def _tokenizer_refusal(path: Path, data: dict) -> str | None:
    """Why the ``tokenizers`` library cannot build the tokenizer ``path`` (holding ``data``), else None."""
    if not isinstance(data.get("model"), dict):
        return "has no tokenizer model (its 'model' object is missing)"
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    try:
        Tokenizer.from_file(str(path))
    except Exception as e:  # the library's own refusal (a Rust error raised as an Exception)
        return f"the tokenizers library cannot read it ({str(e)[:120]})"
    return None
