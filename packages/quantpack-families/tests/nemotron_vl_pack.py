"""A tiny Nemotron-3.5-Super-VL (``NemotronH_Omni_Reasoning_V3``) EXL3 pack and its float64 reference, for vLLM's
``nano_nemotron_vl.py`` on the GPU (docs/families.md, Nemotron-3.5-Super-VL; families-notes section 5 sizes).

- Language tower: the tiny model of Super's layer kinds (``nemotron_h_reference.SUPER``: Mamba2, latent MoE with
  EXL3 relu2 experts in three K groups, NoPE attention; an MTP layer declared, none stored) under
  ``language_model.backbone.*`` / ``language_model.lm_head``, EXL3 as the core writer stores it.
- Vision tower: a two-block RADIO ViT (hidden 128, 2 heads of 64, MLP 256, patch 16, 64 x 64 tiles, one teacher's
  class token and three registers) in the released checkpoint's (timm) layout under
  ``vision_model.radio_model.model.*``, dense bf16; ``vision_projector.vision_final_layernorm`` non-trivial (so a
  model that drops it gives other features); the projector ``mlp1`` (RMSNorm 512, Linear 512 -> 192, relu^2,
  Linear 192 -> 256) as ``mlp1.{0,1,3}``.
- ``config.json``: the fields vLLM 0.25.1 reads (``force_image_size``, ``patch_size``, ``downsample_ratio``,
  ``ps_version`` v2, ``vit_hidden_size``, ``projector_hidden_size``, ``norm_mean`` / ``norm_std``,
  ``use_thumbnail``, ``vision_config.args``), the EXL3 ``quantization_config`` at the top level, and an ``auto_map``
  to a small ``configuration_nemotron_vl_tiny.py`` beside it: transformers 5.17 (the GPU machine's) has no
  ``nemotron_h_omni`` config class, so the pack is served with ``trust_remote_code``.
- Tokenizer: one two-letter word per id 0 - 1020 (:func:`word`: letters only, since transformers 5.19 splits the
  digits of ``t17``-style words) and the processor's ``<image>``, ``<img>``, ``</img>`` as special tokens at
  ids 1021 - 1023 (inside the vocabulary: rows the embedding has).

The reference (:func:`reference`): the image as vLLM's processor gives it for one 64 x 64 tile (no thumbnail for one
tile; ``(x / 255 - mean) / std``, rounded to the config's bfloat16), the RADIO forward written from the architecture's
description (patches flattened channel-major, position embedding, class and register tokens prepended and dropped
after the blocks, pre-LN blocks with exact GELU), the final LayerNorm, the 2 x 2 pixel shuffle, ``mlp1``, the four
projected rows placed at the ``<image>`` positions of the expanded prompt, then ``nemotron_h_reference.forward``; the
text prompt's logits and 16 greedy tokens of the image prompt with each step's top-2 (float64).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch
from nemotron_h_reference import SUPER, config_json, forward, router_margin, tiny_nemotron_h

VISION = dict(hidden=128, blocks=2, heads=2, mlp=256, patch=16, image=64, registers=3)
#: class tokens (one teacher) + registers prepended to the patches
PREFIX = 1 + VISION["registers"]
PROJ, TEXT = 192, SUPER["hidden_size"]
MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
#: the processor's tags (vLLM 0.25.1 ``transformers_utils/processors/nano_nemotron_vl.py``) at ids past the words
IMAGE, IMG_START, IMG_END = "<image>", "<img>", "</img>"
SPECIAL = {IMAGE: 1021, IMG_START: 1022, IMG_END: 1023}
#: tokens per 64 x 64 tile: (64 / 16)^2 patches, 2 x 2 of them per token after the pixel shuffle
TILE_TOKENS = (VISION["image"] // VISION["patch"]) ** 2 // 4


LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def word(i: int) -> str:
    """The tokenizer's word of id ``i`` (0 - 1020): two letters, ``aa`` for 0 (the unknown word). Two, because
    exllamav3's tokenizer reads its vocabulary by decoding ``" t"``: an unknown word of two characters keeps it on
    its plain path."""
    return LETTERS[i // len(LETTERS)] + LETTERS[i % len(LETTERS)]


IMAGE_PROMPT = "<image> " + " ".join(word(i) for i in (17, 230, 5, 881, 64, 300))
#: the tokenizer's words: id -> word for the ids below the tags
WORDS = {word(i): i for i in range(min(SPECIAL.values()))}
GREEDY_TOKENS = 16
TEXT_LENGTH = 64

CONFIG_CODE = '''"""The tiny Nemotron-VL test pack's config class (transformers 5.17 has no nemotron_h_omni): the
language and vision configs as sub-configs, every other field as given."""

from transformers import PretrainedConfig
from transformers.models.nemotron_h import NemotronHConfig


class NemotronVLTinyConfig(PretrainedConfig):
    model_type = "nemotron_h_omni"

    def __init__(self, llm_config=None, vision_config=None, **kwargs):
        self.llm_config = llm_config or {}
        self.text_config = NemotronHConfig(**self.llm_config)
        self.vision_config = PretrainedConfig(**(vision_config or {}))
        super().__init__(**kwargs)
'''


def tiny_vision(seed: int = 0) -> dict[str, torch.Tensor]:
    """The tower, final LayerNorm and projector tensors (float32, checkpoint names)."""
    g = torch.Generator().manual_seed(seed + 10)
    h, m = VISION["hidden"], VISION["mlp"]

    def r(*shape, scale=0.05):
        return torch.randn(*shape, generator=g) * scale

    p = "vision_model.radio_model.model."
    grid = (VISION["image"] // VISION["patch"]) ** 2
    out = {
        p + "patch_generator.embedder.weight": r(h, 3 * VISION["patch"] ** 2, scale=0.03),
        p + "patch_generator.pos_embed": r(1, grid, h, scale=0.3),
        p + "patch_generator.cls_token.token": r(PREFIX, h, scale=0.3),
        "vision_projector.vision_final_layernorm.weight": 1 + r(h, scale=0.3),
        "vision_projector.vision_final_layernorm.bias": r(h, scale=0.3),
        "mlp1.0.weight": 1 + r(4 * h, scale=0.2),
        "mlp1.1.weight": r(PROJ, 4 * h, scale=1 / math.sqrt(4 * h)),
        "mlp1.3.weight": r(TEXT, PROJ, scale=1 / math.sqrt(PROJ)),
    }
    for i in range(VISION["blocks"]):
        b = f"{p}blocks.{i}."
        out.update(
            {
                b + "norm1.weight": 1 + r(h, scale=0.1),
                b + "norm1.bias": r(h),
                b + "attn.qkv.weight": r(3 * h, h, scale=0.15),
                b + "attn.qkv.bias": r(3 * h),
                b + "attn.proj.weight": r(h, h, scale=1 / math.sqrt(h)),
                b + "attn.proj.bias": r(h),
                b + "norm2.weight": 1 + r(h, scale=0.1),
                b + "norm2.bias": r(h),
                b + "mlp.fc1.weight": r(m, h, scale=1 / math.sqrt(h)),
                b + "mlp.fc1.bias": r(m),
                b + "mlp.fc2.weight": r(h, m, scale=1 / math.sqrt(m)),
                b + "mlp.fc2.bias": r(h),
            }
        )
    return out


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def radio_features(w: dict[str, torch.Tensor], pixels: torch.Tensor) -> torch.Tensor:
    """The tower's patch features ``(N, patches, hidden)`` float64 of normalized ``pixels`` ``(N, 3, S, S)``:
    each 16 x 16 patch flattened channel-major (channel, row, column) through the embedder, plus the position
    embedding, the class and register tokens prepended, pre-LN blocks (LayerNorm eps 1e-6, softmax attention over
    every token, exact GELU MLP), then the prefix tokens dropped (RADIO's summary tokens)."""
    p = "vision_model.radio_model.model."
    w = {k: v.double() for k, v in w.items()}
    x = pixels.double()
    n, c, s, _ = x.shape
    ps, h, heads = VISION["patch"], VISION["hidden"], VISION["heads"]
    g = s // ps
    patches = x.reshape(n, c, g, ps, g, ps).permute(0, 2, 4, 1, 3, 5).reshape(n, g * g, c * ps * ps)
    t = patches @ w[p + "patch_generator.embedder.weight"].T + w[p + "patch_generator.pos_embed"]
    t = torch.cat([w[p + "patch_generator.cls_token.token"].expand(n, -1, -1), t], dim=1)
    hd = h // heads
    for i in range(VISION["blocks"]):
        b = f"{p}blocks.{i}."
        y = layer_norm(t, w[b + "norm1.weight"], w[b + "norm1.bias"], 1e-6)
        qkv = (y @ w[b + "attn.qkv.weight"].T + w[b + "attn.qkv.bias"]).reshape(n, -1, 3, heads, hd)
        q, k, v = qkv.unbind(2)
        att = torch.einsum("nthd,nshd->nhts", q, k) / math.sqrt(hd)
        o = torch.einsum("nhts,nshd->nthd", att.softmax(-1), v).reshape(n, -1, h)
        t = t + o @ w[b + "attn.proj.weight"].T + w[b + "attn.proj.bias"]
        y = layer_norm(t, w[b + "norm2.weight"], w[b + "norm2.bias"], 1e-6)
        y = torch.nn.functional.gelu(y @ w[b + "mlp.fc1.weight"].T + w[b + "mlp.fc1.bias"])
        t = t + y @ w[b + "mlp.fc2.weight"].T + w[b + "mlp.fc2.bias"]
    return t[:, PREFIX:]


def pixel_shuffle(x: torch.Tensor) -> torch.Tensor:
    """``(N, g*g, C)`` -> ``(N, (g/2)^2, 4C)``: each 2 x 2 block of the row-major patch grid becomes one token, the
    blocks in row-major order, a token's channels ordered (row in the block, column in the block, channel) - the
    "v2" shuffle at ratio 0.5 (v1 left the grid transposed)."""
    n, t, c = x.shape
    g = round(t**0.5)
    x = x.reshape(n, g // 2, 2, g // 2, 2, c).permute(0, 1, 3, 2, 4, 5)  # (N, block row, block col, dy, dx, C)
    return x.reshape(n, (g // 2) ** 2, 4 * c)


def project(w: dict[str, torch.Tensor], pixels: torch.Tensor, final_norm: bool = True) -> torch.Tensor:
    """The image tokens ``(N * TILE_TOKENS, text hidden)`` float64: tower features, the final LayerNorm (eps 1e-6;
    skipped with ``final_norm=False``, for the test that it matters), pixel shuffle, ``mlp1`` (RMSNorm eps 1e-5,
    Linear, relu^2, Linear)."""
    w64 = {k: v.double() for k, v in w.items()}
    x = radio_features(w, pixels)
    if final_norm:
        x = layer_norm(
            x,
            w64["vision_projector.vision_final_layernorm.weight"],
            w64["vision_projector.vision_final_layernorm.bias"],
            1e-6,
        )
    x = pixel_shuffle(x)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w64["mlp1.0.weight"]
    x = torch.relu(x @ w64["mlp1.1.weight"].T) ** 2 @ w64["mlp1.3.weight"].T
    return x.reshape(-1, x.shape[-1])


def sample_image():
    """A deterministic 64 x 64 RGB test image (PIL): smooth gradients and a bright square."""
    from PIL import Image

    s = VISION["image"]
    yy, xx = torch.meshgrid(torch.arange(s), torch.arange(s), indexing="ij")
    rgb = torch.stack([xx * 4, yy * 4, (xx + yy) * 2], -1).clamp(0, 255)
    rgb[20:40, 24:44] = torch.tensor([250, 240, 30])
    return Image.fromarray(rgb.to(torch.uint8).numpy(), "RGB")


def pixels_of(image) -> torch.Tensor:
    """``(1, 3, 64, 64)`` float64: the image as vLLM's processor normalizes one tile of its own size."""
    import numpy as np

    x = torch.from_numpy(np.asarray(image, dtype=np.float64).copy())  # (rows, columns, RGB)
    x = x.permute(2, 0, 1)[None] / 255
    return (x - torch.tensor(MEAN, dtype=torch.float64)[:, None, None]) / torch.tensor(STD, dtype=torch.float64)[
        :, None, None
    ]


def expand(prompt: str) -> list[int]:
    """The prompt's ids as vLLM's processor expands it: ``<image>`` -> ``<img>`` + ``<image>`` x tile tokens +
    ``</img>``, each word -> its id."""
    ids = []
    for w in prompt.split():
        if w == IMAGE:
            ids += [SPECIAL[IMG_START], *[SPECIAL[IMAGE]] * TILE_TOKENS, SPECIAL[IMG_END]]
        else:
            ids.append(WORDS[w])
    return ids


def write_tokenizer(path: Path) -> None:
    """Word tokenizer of :data:`WORDS` (id 1 BOS, 2 EOS) with the processor's tags as special tokens."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(dict(WORDS), unk_token=word(0)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    for t, i in SPECIAL.items():
        if tok.token_to_id(t) != i:
            raise ValueError(f"tokenizer gave {t} id {tok.token_to_id(t)}, not {i}")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": word(1), "eos_token": word(2), "tokenizer_class": "PreTrainedTokenizerFast"})
    )


def vl_config(naming: str = "layers_block_type") -> dict:
    """``config.json`` of the pack (see the module docstring). ``naming="hybrid_override_pattern"``: the language
    layers as letters (exllamav3 1.6.5's converter reads ``layers_block_type`` only with its own words, ``mamba`` /
    ``attention``, which transformers refuses; both read the letters), the MTP layer declared as
    ``mtp_hybrid_override_pattern``. The vision config carries the fields exllamav3 reads beside vLLM's ``args``."""
    llm = config_json(True, naming, cfg=SUPER)
    if naming == "hybrid_override_pattern":  # an MTP layer declared (the final LayerNorm's cue), as letters
        llm.update(num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*E")
    quant = llm.pop("quantization_config")
    llm["dtype"] = "bfloat16"
    v = VISION
    return {
        "architectures": ["NemotronH_Omni_Reasoning_V3"],
        "model_type": "nemotron_h_omni",
        "auto_map": {"AutoConfig": "configuration_nemotron_vl_tiny.NemotronVLTinyConfig"},
        "llm_config": llm,
        "vision_config": {
            # exllamav3's reading of the tower (architecture/nemotronh.py, read_nemotronh_omni_vision_config)
            "hidden_size": v["hidden"],
            "num_hidden_layers": v["blocks"],
            "num_attention_heads": v["heads"],
            "max_img_size": v["image"],
            "num_cls_tokens": 1,
            "num_registers": v["registers"],
            "layer_norm_eps": 1e-6,
            "mlp_ratio": v["mlp"] / v["hidden"],
            "hidden_act": "gelu",
            # vLLM's (nano_nemotron_vl.py, get_vit_model_from_radio_config)
            "patch_size": v["patch"],
            "preferred_resolution": [v["image"], v["image"]],
            "video_temporal_patch_size": 1,
            "separate_video_embedder": False,
            "args": {
                "model": "vit_huge_patch16_224",
                "hidden_size": v["hidden"],
                "num_hidden_layers": v["blocks"],
                "num_attention_heads": v["heads"],
                "intermediate_size": v["mlp"],
                "cpe_max_size": v["image"],
                "teachers": [{"name": "teacher", "use_summary": True}],
                "cls_token_per_teacher": True,
                "register_multiple": PREFIX,
                "qkv_bias": True,
            },
        },
        "force_image_size": v["image"],
        "patch_size": v["patch"],
        "downsample_ratio": 0.5,
        "ps_version": "v2",
        "template": "nemotron-h",
        "image_tag_type": "internvl",
        "vit_hidden_size": v["hidden"],
        "projector_hidden_size": PROJ,
        "norm_mean": list(MEAN),
        "norm_std": list(STD),
        "use_thumbnail": True,
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
        "vocab_size": SUPER["vocab_size"],
        "quantization_config": quant,
    }


def write_vl_pack(path: Path, seed: int = 0) -> Path:
    """The pack folder (see the module docstring). Returns ``path``."""
    from quantpack_core.synthetic import write_pack

    pack, _ = tiny_nemotron_h(seed, SUPER, routed_exl3=True)
    tensors = {f"language_model.{k}": v for k, v in pack.items()}
    tensors.update({k: v.to(torch.bfloat16) for k, v in tiny_vision(seed).items()})
    write_pack(path, tensors, vl_config())
    (path / "configuration_nemotron_vl_tiny.py").write_text(CONFIG_CODE)
    write_tokenizer(path)
    return path


#: exllamav3's image preprocessing fields (``preprocessor_config.json``; vLLM 0.25.1 reads none of them): one
#: 64 x 64 tile of 16 patches
PREPROCESSOR = {
    "norm_mean": list(MEAN),
    "norm_std": list(STD),
    "patch_size": VISION["patch"],
    "min_num_patches": (VISION["image"] // VISION["patch"]) ** 2,
    "max_num_patches": (VISION["image"] // VISION["patch"]) ** 2,
    "video_target_num_patches": (VISION["image"] // VISION["patch"]) ** 2,
}


def write_vl_source(path: Path, seed: int = 0) -> Path:
    """The pack's model unquantized, as exllamav3's converter takes it: the language tower's dense weights (the EXL3
    ones decoded, bfloat16; the router, its bias and ``A_log`` / ``D`` / ``dt_bias`` float32, as the Nemotron-H twin
    keeps them) under ``language_model.``, the vision half bfloat16, :func:`vl_config` with the letters naming and no
    quantization config, its config class, the tokenizer and ``preprocessor_config.json``. Returns ``path``."""
    from safetensors.torch import save_file

    language, vision = dense_weights(seed)
    keep_fp32 = (".gate.", ".A_log", ".D", ".dt_bias")
    tensors = {
        f"language_model.{k}": v.float() if any(s in k for s in keep_fp32) else v.to(torch.bfloat16)
        for k, v in language.items()
    }
    tensors.update({k: v.to(torch.bfloat16) for k, v in vision.items()})
    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    cfg = vl_config("hybrid_override_pattern")
    cfg.pop("quantization_config")
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    (path / "configuration_nemotron_vl_tiny.py").write_text(CONFIG_CODE)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    write_tokenizer(path)
    return path


@functools.lru_cache(maxsize=2)
def dense_weights(seed: int = 0) -> tuple[dict, dict]:
    """``(language, vision)`` dense weights of the pack (language: the EXL3 ones decoded; vision: bf16-rounded, as
    stored), in the references' names. Encoded once per seed (cached: callers only read them)."""
    _, dense = tiny_nemotron_h(seed, SUPER, routed_exl3=True)
    vision = {k: v.to(torch.bfloat16).double() for k, v in tiny_vision(seed).items()}
    return dense, vision


def reference(seed: int = 0, image=None, weights: tuple[dict, dict] | None = None) -> dict:
    """The float64 reference of the pack: ``input_ids`` ``(1, TEXT_LENGTH)`` and ``logits`` of a text-only prompt
    (words only), ``image_ids`` (the image prompt as expanded), ``greedy`` (GREEDY_TOKENS ids) and ``greedy_top2``
    (per step ``{str(id): logprob}`` of the two best) of the image prompt, ``image_tokens`` (the projected rows), and
    ``router_margin`` / ``router_noise`` / ``router_swaps`` of the text prompt (:func:`router_near_ties`; the
    rounding forward is an all-bfloat16 one: KL 1.4e-3 from this one on the core writer's pack, within the served
    pack's 3e-3 bound, which moves a margin by up to 1.0e-2 / 1.5e-2 in the two MoE layers; it flips no route
    itself).
    ``weights``: ``(language, vision)`` dense weights in :func:`dense_weights`' names (default: the pack's own; a
    converter-made pack's decoded ones)."""
    language, vision = weights if weights is not None else dense_weights(seed)
    g = torch.Generator().manual_seed(seed + 3)
    text_ids = torch.randint(3, min(SPECIAL.values()), (TEXT_LENGTH,), generator=g)
    routers, rounded, top_k = [], [], SUPER["num_experts_per_tok"]
    text_logits = forward(language, SUPER, text_ids, routers=routers)
    forward(language, SUPER, text_ids, routers=rounded, dtype=torch.bfloat16)
    pixels = pixels_of(image if image is not None else sample_image()).to(torch.bfloat16)  # as vLLM's processor casts
    image_rows = project(vision, pixels)
    ids = expand(IMAGE_PROMPT)
    embed = language["backbone.embeddings.weight"].double()
    greedy, top2 = [], []
    for _ in range(GREEDY_TOKENS):
        seq = torch.tensor(ids + greedy)
        x = embed[seq].clone()
        x[seq == SPECIAL[IMAGE]] = image_rows
        logp = forward(language, SUPER, seq, inputs_embeds=x)[-1].log_softmax(-1)
        best = logp.topk(2)
        top2.append({str(int(i)): float(v) for v, i in zip(best.values, best.indices, strict=True)})
        greedy.append(int(best.indices[0]))
    return {
        "input_ids": text_ids[None],
        "logits": text_logits.float()[None],
        "image_ids": ids,
        "greedy": greedy,
        "greedy_top2": top2,
        "image_tokens": image_rows,
        **router_near_ties(routers, rounded, top_k, lambda swap: forward(language, SUPER, text_ids, swap=swap)),
    }


def router_near_ties(routers: list, rounded: list, top_k: int, swapped) -> dict:
    """A prompt's router near-ties (``quantpack_core.compare.ROUTER_NEAR_TIE``), from the float64 forward's choice
    scores ``routers`` (a list of ``(T, experts)``, one per MoE layer) and a forward's that rounds (``rounded``, the
    same layout):

    - ``router_margin`` ``(layers, T)`` float64, each layer's :func:`nemotron_h_reference.router_margin`;
    - ``router_noise`` ``(layers,)``, the most ``rounded`` moved one of that layer's margins: the measurement the
      one near-tie threshold must cover (``test_nemotron_vl_pack.py`` checks it does);
    - ``router_swaps`` ``{token: (n, vocab) float32}``, per near-tie token its logits row with the token routed to
      its ``(k+1)``-th expert, one row per layer where it is a near-tie (``swapped((moe_layer, token))`` gives the
      logits ``(T, vocab)`` of the forward with that swap).

    Raises:
        ValueError: a margin or a noise that is not finite (a broken reference, which would set positions apart
            unseen)."""
    from quantpack_core.compare import ROUTER_NEAR_TIE

    margin = torch.stack([router_margin(c, top_k) for c in routers])
    moved = torch.stack([router_margin(a, top_k, b.double()) for a, b in zip(routers, rounded, strict=True)])
    noise = (margin - moved).abs().amax(-1)
    if not (margin.isfinite().all() and noise.isfinite().all()):
        raise ValueError("router margins of the reference are not finite: its forward is broken")
    moe_layers = [i for i, kind in enumerate(SUPER["layers_block_type"]) if kind == "moe"]
    swaps: dict[int, list] = {}
    for layer, token in (margin < ROUTER_NEAR_TIE).nonzero().tolist():
        swaps.setdefault(token, []).append(swapped((moe_layers[layer], token))[token].float())
    return {
        "router_margin": margin,
        "router_noise": noise,
        "router_swaps": {t: torch.stack(rows) for t, rows in sorted(swaps.items())},
    }
