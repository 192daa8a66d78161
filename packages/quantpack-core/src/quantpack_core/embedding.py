"""Int8 embedding rows: the token-embedding table of a pack stored as int8 rows with one scale per row.

exllamav3 keeps the embedding table dense (bf16) and in host RAM; vLLM keeps it on the GPU, where it is often the
largest single tensor of a pack (2.54 GB in bf16 for a 248,320-token vocabulary). Symmetric per-row int8 halves that
(a quarter of an fp32 table) and costs almost nothing in quality, because each row is read whole and only the
gathered rows are ever dequantized.

In a pack the table ``<key>.weight`` becomes ``<key>.qweight`` (int8, ``(vocab, hidden)``) and ``<key>.scales``
(float32, ``(vocab,)``), with ``row = qweight[i] * scales[i]``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .codec.int8_rows import dequantize_rows as dequantize_rows  # re-exported: the table's reader
from .codec.int8_rows import quantize_rows
from .errors import PackError, Problem
from .inventory import INDEX_FILE, MANIFEST_FILE
from .pack import Pack

INT8_SUFFIXES = ("qweight", "scales")
INT8_FORMAT = "int8_rows"


@dataclass(frozen=True)
class Int8Report:
    """What :func:`convert_embedding_int8` did.

    Attributes:
        module: the embedding module (``model.embed_tokens``).
        shape: the table's shape.
        bytes_before: bytes of the dense table as stored.
        bytes_after: bytes of ``qweight`` + ``scales``.
        max_rel_error: largest per-row relative error ``||row - dequantized|| / ||row||``.
        out_dir: the pack written.
    """

    module: str
    shape: tuple[int, int]
    bytes_before: int
    bytes_after: int
    max_rel_error: float
    out_dir: Path


def find_embedding(pack: Pack) -> str:
    """The token-embedding module of a pack (``...embed_tokens`` with a 2-D dense weight).

    Raises:
        PackError: none, several, or one already stored as int8 rows.
    """
    found = [k for k, m in pack.modules.items() if k.rsplit(".", 1)[-1] == "embed_tokens"]
    if not found:
        raise PackError(
            str(pack.path),
            [
                Problem(
                    "",
                    "embed_tokens",
                    "the pack has no module named *.embed_tokens",
                    "convert a pack whose token embedding is called embed_tokens",
                )
            ],
        )
    if len(found) > 1:
        raise PackError(
            str(pack.path),
            [
                Problem(
                    "",
                    "embed_tokens",
                    f"several embedding tables: {found}",
                    "convert one pack at a time with one embed_tokens",
                )
            ],
        )
    key = found[0]
    t = pack.modules[key].tensors
    if all(s in t for s in INT8_SUFFIXES):
        raise PackError(
            str(pack.path),
            [
                Problem(
                    key,
                    f"{key}.qweight",
                    "already stored as int8 rows",
                    "nothing to do: this pack was converted before",
                )
            ],
        )
    if "weight" not in t or len(t["weight"].shape) != 2:
        raise PackError(
            str(pack.path),
            [
                Problem(
                    key,
                    f"{key}.weight",
                    "no 2-D dense table to convert",
                    "this converter handles dense embed_tokens.weight tables only",
                )
            ],
        )
    return key


def convert_embedding_int8(
    src: str | os.PathLike, out: str | os.PathLike | None = None, *, in_place: bool = False
) -> Int8Report:
    """Rewrite a pack's token-embedding table as int8 rows + per-row scales.

    The shard holding the table is rewritten with ``<key>.qweight`` and ``<key>.scales`` in place of
    ``<key>.weight``; the index (if any) and ``quantization_config.json``'s ``tensor_storage`` are updated; every
    other file is copied unchanged.

    Args:
        src: the pack directory (validated first).
        out: where to write the converted pack (must not exist, or be empty). Required unless ``in_place``.
        in_place: rewrite ``src`` itself (each file replaced atomically).

    Returns:
        an :class:`Int8Report`.

    Raises:
        PackError: an unsound pack, no or an already converted embedding.
        FileExistsError: ``out`` is not a new or empty folder outside ``src`` (:func:`check_output_folder`).
        ValueError: neither ``out`` nor ``in_place``, or both.
    """
    if (out is None) == (not in_place):
        raise ValueError("give an output directory, or in_place=True (not both)")
    pack = Pack.open(src)
    key = find_embedding(pack)
    info = pack.modules[key].tensors["weight"]
    dst = Path(src) if in_place else Path(out)
    if not in_place:
        check_output_folder(Path(src), dst)
        dst.mkdir(parents=True, exist_ok=True)
        for f in Path(src).iterdir():
            if f.is_file() and f.name != info.file:
                shutil.copy2(f, dst / f.name)

    with safe_open(str(Path(src) / info.file), framework="pt") as h:
        metadata = h.metadata()
        tensors = {name: h.get_tensor(name) for name in h.keys()}
    table = tensors.pop(info.name)
    qweight, scales = quantize_rows(table)
    back = dequantize_rows(qweight, scales)
    norms = table.float().norm(dim=1).clamp_min(1e-30)
    max_rel = float(((table.float() - back).norm(dim=1) / norms).max())
    tensors[f"{key}.qweight"] = qweight
    tensors[f"{key}.scales"] = scales
    _atomic_save(tensors, dst / info.file, metadata)
    pack.close()

    index = Path(src) / INDEX_FILE
    if index.is_file():
        data = json.loads(index.read_text())
        wm = data["weight_map"]
        shard = wm.pop(info.name)
        wm[f"{key}.qweight"] = wm[f"{key}.scales"] = shard
        _atomic_write_text(dst / INDEX_FILE, json.dumps(data, indent=2))
    manifest = Path(src) / MANIFEST_FILE
    if manifest.is_file():
        data = json.loads(manifest.read_text())
        storage = data.setdefault("tensor_storage", {})
        storage[key] = {
            "quant_format": INT8_FORMAT,
            "stored_tensors": {
                f"{key}.qweight": {"shape": list(qweight.shape), "n_bytes": qweight.numel(), "dtype": "torch.int8"},
                f"{key}.scales": {"shape": list(scales.shape), "n_bytes": scales.numel() * 4, "dtype": "torch.float32"},
            },
        }
        _atomic_write_text(dst / MANIFEST_FILE, json.dumps(data, indent=4))
    after = qweight.numel() + scales.numel() * 4
    return Int8Report(key, tuple(table.shape), info.nbytes, after, max_rel, dst)


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict | None) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".safetensors.tmp")
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        default_file_mode(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json.tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    default_file_mode(tmp)
    os.replace(tmp, path)


def check_output_folder(src: Path, dst: Path) -> None:
    """Refuse a converter's output folder that would overwrite, or nest in, what the user gave (``quantpack
    embed-int8 --out``, ``quantpack escha-from-exl3 --out``).

    Raises:
        FileExistsError: ``dst`` is a file, a symbolic link (dangling or not), a folder that is not empty, is (or
            lies inside) the source pack ``src``, or lies below a file.
    """
    above = next((a for a in Path(os.path.abspath(dst)).parents if a.exists() or a.is_symlink()), None)
    if above is not None and not above.is_dir():
        raise FileExistsError(f"{dst} lies below {above}, which is a file, not a folder")
    source, target = src.resolve(), dst.resolve()
    if target == source or source in target.parents:
        raise FileExistsError(f"{dst} lies inside the source pack {src}; write the converted pack outside it")
    if dst.is_symlink():
        raise FileExistsError(f"{dst} is a symbolic link; --out names a new folder for the converted pack")
    if dst.exists() and not dst.is_dir():
        raise FileExistsError(f"{dst} is a file; --out names the folder the converted pack is written to")
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} exists and is not empty; the converter never overwrites")


def default_file_mode(path: str | os.PathLike) -> None:
    """Give a file made by ``tempfile.mkstemp`` or a writer that creates 0600 files the mode a plain ``open`` would:
    0666 minus the umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
