"""Write small EXL3 packs: random layers for kernel and loader tests, packs built from given tensors, and copies of
a pack with one module's tensors replaced.

Any int16 pattern is a valid trellis (every bit string decodes), so random words make a legal layer of any K and
codebook; with suh/svh of realistic magnitude their dequantized weights look like real ones to a kernel. The files
follow the layout exllamav3's converter writes (``config.json`` with ``quantization_config``,
``quantization_config.json`` with ``tensor_storage``, one safetensors file or an index with shards), see
docs/exl3-format.md.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from .codec.codebook import Codebook
from .codec.exl3 import FORMAT as EXL3
from .codec.trellis import check_k_codebook, width_from_k
from .inventory import INDEX_FILE, MANIFEST_FILE
from .names import split_tensor_name
from .tp import padded


def random_exl3_layer(
    in_features: int,
    out_features: int,
    k_bits: float,
    codebook: Codebook | str = "mul1",
    *,
    generator: torch.Generator | None = None,
    bias: bool = False,
    scale: float = 0.02,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """Tensors of one random EXL3 linear layer, as a pack stores them.

    Args:
        in_features, out_features: logical sizes; stored sizes are padded up to multiples of 128.
        k_bits: bits per weight (1..8, or 1.5/2.5/3.5 with mul1).
        codebook: which codebook (adds the ``.mcg`` / ``.mul1`` marker holding its multiplier).
        generator: torch RNG for reproducibility.
        bias: add a float16 ``bias`` of the logical output length.
        scale: magnitude of ``svh`` (dequantized weights are about ``scale`` in size).
        device: where to draw and keep the tensors (default CPU; a GPU draws a large layer much faster). The
            generator must live on the same device.

    Returns:
        ``{suffix: tensor}`` with ``trellis`` int16 ``(kp/16, np/16, 16*K)``, ``suh`` float16 ``(kp,)``,
        ``svh`` float16 ``(np,)`` (0 past ``out_features``, as exllamav3 writes padding), the marker and optionally
        ``bias``.

    Raises:
        CodecError: illegal K or K/codebook combination.
    """
    cb = Codebook.parse(codebook)
    check_k_codebook(k_bits, cb)
    kp, np_ = padded(in_features), padded(out_features)
    width = width_from_k(k_bits)
    g, kw = generator, {"device": device}
    trellis = torch.randint(-32768, 32768, (kp // 16, np_ // 16, width), dtype=torch.int32, generator=g, **kw)
    sign_u = torch.randint(0, 2, (kp,), generator=g, **kw) * 2 - 1
    sign_v = torch.randint(0, 2, (np_,), generator=g, **kw) * 2 - 1
    suh = sign_u * (0.5 + torch.rand(kp, generator=g, **kw))
    svh = sign_v * scale * (0.5 + torch.rand(np_, generator=g, **kw))
    svh[out_features:] = 0  # exllamav3 zero-pads the layer, and an all-zero output's scale is 0
    out: dict[str, torch.Tensor] = {
        "trellis": trellis.to(torch.int16),
        "suh": suh.to(torch.float16),
        "svh": svh.to(torch.float16),
    }
    if cb.marker is not None:
        m = cb.multiplier
        out[cb.marker] = torch.tensor(m - (1 << 32) if m >= 1 << 31 else m, dtype=torch.int32, **kw)
    if bias:
        out["bias"] = (0.1 * torch.randn(out_features, generator=g, **kw)).to(torch.float16)
    return out


def _manifest_entry(module: str, tensors: dict[str, torch.Tensor]) -> dict:
    entry: dict = {
        "stored_tensors": {
            name: {"shape": list(t.shape), "n_bytes": t.numel() * t.element_size(), "dtype": str(t.dtype)}
            for name, t in tensors.items()
        }
    }
    tr = tensors.get(f"{module}.trellis")
    if tr is not None and tr.dim() == 3:
        entry["quant_format"] = EXL3
        w = tr.shape[-1]
        entry["bits_per_weight"] = w // 16 if w % 16 == 0 else (w - 8) / 16 + 0.5
        # exllamav3's quantization_config.json records each marker's multiplier (as an unsigned 32-bit value)
        for marker in ("mul1", "mcg"):
            m = tensors.get(f"{module}.{marker}")
            if m is not None and m.numel() == 1:
                entry[f"{marker}_multiplier"] = int(m.reshape(()).item()) & 0xFFFFFFFF
    return entry


def write_pack(
    path: str | os.PathLike,
    tensors: dict[str, torch.Tensor],
    config: dict,
    *,
    shards: int = 1,
    manifest: bool = True,
    quant_config: dict | None = None,
) -> Path:
    """Write a pack directory.

    Args:
        path: directory to create (must not exist or be empty).
        tensors: full tensor name -> tensor (CPU).
        config: ``config.json`` content; ``quantization_config`` is added unless present.
        shards: number of safetensors files; above 1 an index is written.
        manifest: write ``quantization_config.json`` with ``tensor_storage``.
        quant_config: the quantization config (default: exl3, 4 bits, and the tensors' codebook as exllamav3 writes
            it, when they share one: from their ``.mcg`` / ``.mul1`` markers, 3INST without either).

    Returns:
        the pack directory.

    Raises:
        FileExistsError: when ``path`` exists and is not empty (nothing is overwritten).
    """
    path = Path(path)
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} exists and is not empty; write_pack never overwrites")
    path.mkdir(parents=True, exist_ok=True)
    if quant_config is None:
        quant_config = {"quant_method": EXL3, "version": "1.6.5", "bits": 4.0, "head_bits": 6}
        trellis = {n.removesuffix(".trellis") for n in tensors if n.endswith(".trellis") and tensors[n].dim() == 3}
        used = {"mcg" if f"{m}.mcg" in tensors else "mul1" if f"{m}.mul1" in tensors else "3inst" for m in trellis}
        if len(used) == 1:
            quant_config["codebook"] = used.pop()
    qc = dict(quant_config)
    cfg = dict(config)
    cfg.setdefault("quantization_config", qc)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    if manifest:
        modules: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            modules.setdefault(split_tensor_name(name)[0], {})[name] = t
        storage = {m: _manifest_entry(m, ts) for m, ts in modules.items()}
        (path / MANIFEST_FILE).write_text(json.dumps({**qc, "tensor_storage": storage}, indent=2))
    names = list(tensors)
    if shards <= 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(path / "model.safetensors"))
        return path
    per = math.ceil(len(names) / shards)
    weight_map = {}
    for i in range(shards):
        part = names[i * per : (i + 1) * per]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(path / fname))
        weight_map.update({n: fname for n in part})
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    return path


def replace_module(
    src: str | os.PathLike, dst: str | os.PathLike, module: str, tensors: dict[str, torch.Tensor]
) -> Path:
    """Copy pack ``src`` to ``dst`` with module ``module``'s own tensors (not those of modules below it) replaced by
    ``tensors`` (a dense module made an EXL3 one by :func:`random_exl3_layer`'s tensors, or the reverse): they go
    into the shard that held the module, and the index and the manifest's ``tensor_storage`` entry follow. ``src``
    is only read.

    Args:
        src: a pack folder holding ``module``.
        dst: the folder to create (must not exist).
        module: the module key (``model.layers.0.mlp.gate``).
        tensors: ``{suffix: tensor}`` (``{"trellis": ..., "suh": ..., "svh": ..., "mul1": ...}``), CPU tensors.

    Returns:
        ``dst``.

    Raises:
        FileExistsError: ``dst`` exists.
        KeyError: no shard of ``src`` holds a tensor of ``module``.
    """
    import shutil

    from safetensors.torch import load_file

    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise FileExistsError(f"{dst} exists; replace_module never overwrites")
    shutil.copytree(src, dst)

    def own(name: str) -> bool:  # a tensor of the module itself, not of a module below it
        return split_tensor_name(name)[0] == module

    shards = [f for f in sorted(dst.glob("*.safetensors")) if any(own(n) for n in load_file(f))]
    if not shards:
        raise KeyError(f"{src}: no shard holds a tensor of {module}")
    new = {f"{module}.{suffix}": t.contiguous() for suffix, t in tensors.items()}
    for i, shard in enumerate(shards):  # the module's tensors leave every shard; the new ones go into the first
        kept = {n: t for n, t in load_file(shard).items() if not own(n)}
        save_file({**kept, **(new if i == 0 else {})}, str(shard), metadata={"format": "pt"})
    index = dst / INDEX_FILE
    if index.exists():
        j = json.loads(index.read_text())
        j["weight_map"] = {n: f for n, f in j["weight_map"].items() if not own(n)}
        j["weight_map"].update(dict.fromkeys(new, shards[0].name))
        index.write_text(json.dumps(j, indent=2))
    manifest = dst / MANIFEST_FILE
    if manifest.exists():
        j = json.loads(manifest.read_text())
        if module in j.get("tensor_storage", {}):
            j["tensor_storage"][module] = _manifest_entry(module, new)
            manifest.write_text(json.dumps(j, indent=2))
    return dst


def write_word_tokenizer(path: str | os.PathLike, vocab: int) -> None:
    """Write a word-level tokenizer covering ``vocab`` ids (``t0`` ... ``t{vocab-1}``, whitespace-split; ``t1`` BOS,
    ``t2`` EOS) into a pack folder, for synthetic packs served by token ids (benchmarks). Needs ``tokenizers``.

    Files: ``tokenizer.json`` and ``tokenizer_config.json`` (``PreTrainedTokenizerFast``); existing ones are replaced.
    """
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    path = Path(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "t1", "eos_token": "t2", "tokenizer_class": "PreTrainedTokenizerFast"})
    )
