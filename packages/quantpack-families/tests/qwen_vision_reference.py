"""A tiny Qwen3.5 vision tower as exllamav3 stores it under EXL3, and its references (docs/families.md, "Qwen vision";
sizes from the families' fixture notes: depth 2, hidden 128, 2 heads, MLP 176 padded to 256, merge 2, 64 position
embeddings, out 256).

The pack side is written with the core's writer (random EXL3 codes; exllamav3's converter would quantize a trained
tower instead - not made yet): split ``attn.{q,k,v}_proj`` at K 4 / 3 / 5 with biases, ``attn.proj``, the MLP's
``linear_fc1`` / ``linear_fc2`` at K 6 (the padded ``linear_fc1`` bias as exllamav3 pads it), the merger's two
linears, and the dense patch embedding, position embedding and LayerNorms. The references: per vLLM layer, the
float64 ``(in, out)`` weight and bias decoded by the core codec; for the whole tower, transformers' own
``Qwen3_5VisionModel`` with the decoded weights (its fused ``attn.qkv`` = q / k / v concatenated).
"""

from __future__ import annotations

import torch

from quantpack_core.codec import Exl3Tensors
from quantpack_core.codec.exl3 import dequantize
from quantpack_core.synthetic import random_exl3_layer

#: transformers' ``Qwen3_5VisionConfig`` fields of the tiny tower
TINY_VISION = {
    "depth": 2,
    "hidden_size": 128,
    "num_heads": 2,
    "intermediate_size": 176,
    "hidden_act": "gelu_pytorch_tanh",
    "in_channels": 3,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "num_position_embeddings": 64,
    "out_hidden_size": 256,
    "deepstack_visual_indexes": [],
}
HIDDEN, INTER, OUT = TINY_VISION["hidden_size"], TINY_VISION["intermediate_size"], TINY_VISION["out_hidden_size"]
MERGED = HIDDEN * TINY_VISION["spatial_merge_size"] ** 2
#: K of each quantized projection
QKV_K = {"q": 4, "k": 3, "v": 5}
PROJ_K, MLP_K, MERGER_K = 4, 6, 4
#: value the padded tail of a stored bias holds (large, so serving it would show)
PAD = 3.0


def exl3_layer(g: torch.Generator, n_in: int, n_out: int, k: float, padded_bias: bool = False):
    """One EXL3 layer with a bias: its pack tensors (the bias padded to the stored width when ``padded_bias``, as
    exllamav3 pads it), its float64 ``(in, out)`` weight and its float64 bias (logical length)."""
    t = random_exl3_layer(n_in, n_out, k, "mul1", generator=g, bias=True)
    bias = t["bias"]
    if padded_bias:
        stored = t["svh"].shape[0]
        t["bias"] = torch.cat([bias, torch.full((stored - n_out,), PAD, dtype=bias.dtype)])
    w = dequantize(Exl3Tensors.from_tensors(t)).double()[:n_in, :n_out]
    return t, w, bias.double()


def tiny_tower(seed: int = 0, dense_qkv: bool = False):
    """The tiny tower.

    Args:
        seed: RNG seed.
        dense_qkv: also store each block's dense fused ``attn.qkv.{weight,bias}`` beside the split EXL3 parts (the
            layout exllamav3's converter writes; random, so serving it would show).

    Returns:
        ``(pack, layers, dense)``: the pack's tensors named relative to ``model.visual.`` (fp16, int16, int32);
        ``{vLLM layer: (weight (in, out), bias)}`` in float64 for each quantized layer (``blocks.0.attn.qkv``...);
        transformers' ``Qwen3_5VisionModel`` state dict (float64, the decoded weights as ``(out, in)``).
    """
    g = torch.Generator().manual_seed(seed)
    pack: dict[str, torch.Tensor] = {}
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    dense: dict[str, torch.Tensor] = {}

    def quantized(name: str, n_in: int, n_out: int, k: float, padded_bias: bool = False):
        t, w, b = exl3_layer(g, n_in, n_out, k, padded_bias)
        pack.update({f"{name}.{s}": v for s, v in t.items()})
        return w, b

    def plain(name: str, tensor: torch.Tensor) -> None:
        pack[name] = tensor.to(torch.float16)
        dense[name] = pack[name].double()

    def norm(name: str, width: int) -> None:
        plain(f"{name}.weight", 1 + 0.1 * torch.randn(width, generator=g))
        plain(f"{name}.bias", 0.1 * torch.randn(width, generator=g))

    t, p = TINY_VISION["temporal_patch_size"], TINY_VISION["patch_size"]
    plain("patch_embed.proj.weight", 0.02 * torch.randn(HIDDEN, TINY_VISION["in_channels"], t, p, p, generator=g))
    plain("patch_embed.proj.bias", 0.02 * torch.randn(HIDDEN, generator=g))
    plain("pos_embed.weight", 0.5 * torch.randn(TINY_VISION["num_position_embeddings"], HIDDEN, generator=g))
    for i in range(TINY_VISION["depth"]):
        b = f"blocks.{i}"
        norm(f"{b}.norm1", HIDDEN)
        norm(f"{b}.norm2", HIDDEN)
        parts = [quantized(f"{b}.attn.{n}_proj", HIDDEN, HIDDEN, k) for n, k in QKV_K.items()]
        layers[f"{b}.attn.qkv"] = (torch.cat([w for w, _ in parts], 1), torch.cat([bias for _, bias in parts]))
        if dense_qkv:
            pack[f"{b}.attn.qkv.weight"] = torch.randn(3 * HIDDEN, HIDDEN, generator=g).to(torch.float16)
            pack[f"{b}.attn.qkv.bias"] = torch.randn(3 * HIDDEN, generator=g).to(torch.float16)
        layers[f"{b}.attn.proj"] = quantized(f"{b}.attn.proj", HIDDEN, HIDDEN, PROJ_K)
        layers[f"{b}.mlp.linear_fc1"] = quantized(f"{b}.mlp.linear_fc1", HIDDEN, INTER, MLP_K, padded_bias=True)
        layers[f"{b}.mlp.linear_fc2"] = quantized(f"{b}.mlp.linear_fc2", INTER, HIDDEN, MLP_K)
    norm("merger.norm", HIDDEN)
    layers["merger.linear_fc1"] = quantized("merger.linear_fc1", MERGED, MERGED, MERGER_K)
    layers["merger.linear_fc2"] = quantized("merger.linear_fc2", MERGED, OUT, MERGER_K)
    for name, (w, bias) in layers.items():
        dense[f"{name}.weight"] = w.T.contiguous()
        dense[f"{name}.bias"] = bias
    return pack, layers, dense


def image_patches(grid_thw: list[tuple[int, int, int]], seed: int = 1) -> torch.Tensor:
    """Random pixel patches for images of ``grid_thw`` (temporal, height, width in patches), flattened as the Qwen
    image processor flattens them: ``(sum t*h*w, channels * temporal_patch * patch * patch)`` float32."""
    t, p = TINY_VISION["temporal_patch_size"], TINY_VISION["patch_size"]
    rows = sum(a * b * c for a, b, c in grid_thw)
    return torch.randn(rows, TINY_VISION["in_channels"] * t * p * p, generator=torch.Generator().manual_seed(seed))


def reference_tower(dense: dict[str, torch.Tensor], dtype: torch.dtype = torch.float64):
    """transformers' ``Qwen3_5VisionModel`` of :data:`TINY_VISION` holding ``dense`` (every parameter, checked), in
    ``dtype``, eager attention, on CPU.

    Raises:
        AssertionError: ``dense`` misses a parameter of the model or has one it lacks.
    """
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    config = Qwen3_5VisionConfig(**TINY_VISION)
    config._attn_implementation = "eager"
    model = Qwen3_5VisionModel(config).to(dtype).eval()
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in dense.items()}, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model


def reference_features(dense: dict[str, torch.Tensor], pixels: torch.Tensor, grid_thw) -> torch.Tensor:
    """The tower's merged image features ``(tokens, out_hidden_size)`` in float64 (transformers' forward)."""
    model = reference_tower(dense)
    with torch.no_grad():
        out = model(pixels.double(), torch.tensor(grid_thw))
    return getattr(out, "pooler_output", out)
