"""Bad input is refused while loading, with the layer, the tensor and the fix named - never a silent dense
fallback or garbage output."""

import pytest
import torch

from quantpack_core.errors import GeometryError
from quantpack_core.synthetic import random_exl3_layer


def layer_qkv(cfg_cls):
    from vllm.model_executor.layers.linear import QKVParallelLinear

    cfg = cfg_cls.from_config({"quant_method": "exl3", "bits": 4})
    return QKVParallelLinear(
        256,
        64,
        4,
        2,
        bias=False,
        quant_config=cfg,
        prefix="model.layers.0.self_attn.qkv_proj",
        params_dtype=torch.float32,
    )


def shard(out_f, k=4, seed=0, in_f=256):
    return random_exl3_layer(in_f, out_f, k, "mul1", generator=torch.Generator().manual_seed(seed))


def load(layer, tensors, sid):
    for s, w in tensors.items():
        p = getattr(layer, s)
        p.weight_loader(p, w, sid)


def process(layer):
    layer.quant_method.process_weights_after_loading(layer)


def test_fused_layer_mixing_trellis_and_dense(vllm_layers):
    from quantpack_core.errors import LayerLoadError

    layer = layer_qkv(vllm_layers)
    load(layer, shard(256), "q")
    load(layer, shard(128, seed=1), "k")
    load(layer, {"weight": torch.randn(128, 256)}, "v")
    with pytest.raises(LayerLoadError, match=r"qkv_proj: .*EXL3 trellis .*dense.*re-quantize"):
        process(layer)


def test_missing_shard(vllm_layers):
    from quantpack_core.errors import LayerLoadError

    layer = layer_qkv(vllm_layers)
    load(layer, shard(256), "q")
    load(layer, shard(128, seed=1), "k")
    with pytest.raises(LayerLoadError, match=r"qkv_proj: output partitions \[2\] received no tensor.*v_proj"):
        process(layer)


def test_shard_vectors_without_trellis(vllm_layers):
    from quantpack_core.errors import LayerLoadError

    layer = layer_qkv(vllm_layers)
    load(layer, shard(256), "q")
    load(layer, shard(128, seed=1), "k")
    v = shard(128, seed=2)
    del v["trellis"]
    load(layer, v, "v")
    with pytest.raises(LayerLoadError, match=r"shard 'v' has \.(suh|svh|mul1) but no \.trellis"):
        process(layer)


def test_shard_missing_svh(vllm_layers):
    from quantpack_core.errors import LayerLoadError

    layer = layer_qkv(vllm_layers)
    load(layer, shard(256), "q")
    k = shard(128, seed=1)
    del k["svh"]
    load(layer, k, "k")
    load(layer, shard(128, seed=2), "v")
    with pytest.raises(LayerLoadError, match=r"shard 'k' \(model.layers.0.self_attn.k_proj\): missing .svh"):
        process(layer)


def test_shard_arriving_twice(vllm_layers):
    from quantpack_core.errors import LayerLoadError

    layer = layer_qkv(vllm_layers)
    load(layer, shard(256), "q")
    with pytest.raises(LayerLoadError, match="arrived twice"):
        load(layer, shard(256), "q")


def test_stored_shape_does_not_fit_the_layer(vllm_layers):
    layer = layer_qkv(vllm_layers)
    load(layer, shard(384), "q")  # the model wants 256 q outputs
    load(layer, shard(128, seed=1), "k")
    load(layer, shard(128, seed=2), "v")
    with pytest.raises(GeometryError, match=r"shard 'q' .* stores a 256x384 .* needs 256x256.*config"):
        process(layer)


def test_illegal_trellis_at_load(vllm_layers):
    from quantpack_core.errors import LayerLoadError

    layer = layer_qkv(vllm_layers)
    q = shard(256)
    q["trellis"] = q["trellis"][..., :50].contiguous()
    load(layer, q, "q")
    load(layer, shard(128, seed=1), "k")
    load(layer, shard(128, seed=2), "v")
    with pytest.raises(LayerLoadError, match=r"shard 'q' .*width 50.*re-download or re-quantize"):
        process(layer)


def test_layer_with_nothing_loaded(vllm_layers):
    from quantpack_core.errors import LayerLoadError

    layer = layer_qkv(vllm_layers)
    with pytest.raises(LayerLoadError, match="no tensor of this layer was loaded"):
        process(layer)


def test_manifest_mixing_exl3_and_dense_behind_one_layer(vllm_layers):
    """Refused when the config is built (in vLLM's front-end process), before any layer exists."""
    from quantpack_core.errors import LayerLoadError

    storage = {
        "model.layers.0.mlp.gate_proj": {"quant_format": "exl3", "stored_tensors": {}},
        "model.layers.0.mlp.up_proj": {"stored_tensors": {"model.layers.0.mlp.up_proj.weight": {}}},
    }
    with pytest.raises(LayerLoadError, match=r"layers.0.mlp.gate_proj as exl3, .*up_proj as dense.*re-quantize"):
        vllm_layers.from_config({"quant_method": "exl3", "tensor_storage": storage})


def test_unknown_codebook_name_in_config_is_only_informational(vllm_layers):
    cfg = vllm_layers.from_config({"quant_method": "exl3", "codebook": "foo"})
    assert cfg.codebook == "foo"


def test_bad_backend_choice(vllm_layers, monkeypatch):
    from quantpack_core.errors import BackendUnavailableError
    from quantpack_core.kernels import Platform
    from quantpack_exl3.config import Exl3Config

    monkeypatch.setenv("QUANTPACK_EXL3_BACKEND", "marlin")
    with pytest.raises(BackendUnavailableError, match="QUANTPACK_EXL3_BACKEND='marlin'"):
        Exl3Config.resolve_kernels(Platform("cpu"))
    monkeypatch.delenv("QUANTPACK_EXL3_BACKEND")
    with pytest.raises(BackendUnavailableError, match="QUANTPACK_EXL3_BACKEND=reference"):
        Exl3Config.resolve_kernels(Platform("cuda", 90))  # no exllamav3 extension on this CPU machine
    monkeypatch.setenv("QUANTPACK_EXL3_BACKEND", "reference")
    linear, experts = Exl3Config.resolve_kernels(Platform("cuda", 90))
    assert [k.name for k in linear] == [k.name for k in experts] == ["reference"]


def test_unfused_layer_is_named_by_its_module(vllm_layers):
    from vllm.model_executor.layers.linear import RowParallelLinear

    cfg = vllm_layers.from_config({"quant_method": "exl3"})
    layer = RowParallelLinear(
        640, 256, bias=False, quant_config=cfg, prefix="model.layers.0.mlp.down_proj", params_dtype=torch.float32
    )
    load(layer, shard(256, in_f=512), None)
    with pytest.raises(GeometryError, match=r"^model\.layers\.0\.mlp\.down_proj stores a 512x256 .*needs 640x256") as e:
        process(layer)
    assert str(e.value).count("down_proj") == 1  # a layer that is its only shard is named once


def test_kernel_list_errors_name_the_way_out(monkeypatch):
    """A GPU older than sm_80 fails at config time with the reason and the variable that forces the reference
    kernel, and forcing it works there (vLLM's own capability check is left to the kernel lists: minimum 0); a forced
    kernel that cannot run here names the other choices."""
    from quantpack_core.errors import BackendUnavailableError
    from quantpack_core.kernels import Platform
    from quantpack_exl3.config import Exl3Config

    monkeypatch.delenv("QUANTPACK_EXL3_BACKEND", raising=False)
    with pytest.raises(
        BackendUnavailableError, match=r"compute capability 8.0 or newer \(this GPU has 7.5\).*=reference"
    ):
        Exl3Config.resolve_kernels(Platform("cuda", 75))
    assert Exl3Config.get_min_capability() == 0
    monkeypatch.setenv("QUANTPACK_EXL3_BACKEND", "reference")
    assert [k.name for k in Exl3Config.resolve_kernels(Platform("cuda", 75))[0]] == ["reference"]
    monkeypatch.setenv("QUANTPACK_EXL3_BACKEND", "exllamav3")
    with pytest.raises(
        BackendUnavailableError, match=r"needs a CUDA device .*Choose another that runs here \(reference\), or unset"
    ):
        Exl3Config.resolve_kernels(Platform("cpu"))


def test_bit_counts_that_are_not_numbers_reach_the_pack_check(vllm_layers, fixtures_dir, tmp_path):
    """``bits: "four"`` in config.json: the config vLLM builds keeps it as unknown (it only informs the log), and
    the pack check that follows names the field, instead of a bare conversion error inside vLLM's config."""
    import json
    import shutil

    from quantpack_core.errors import PackError

    cfg = vllm_layers.from_config({"quant_method": "exl3", "bits": "four", "head_bits": True})
    assert cfg.bits is None and cfg.head_bits is None
    assert vllm_layers.from_config({"quant_method": "exl3", "bits": 4, "head_bits": 6}).head_bits == 6.0
    pack = tmp_path / "p"
    shutil.copytree(fixtures_dir / "llama-tiny-exl3-4.0bpw-mul1", pack)
    config = json.loads((pack / "config.json").read_text())
    config["quantization_config"]["bits"] = "four"
    (pack / "config.json").write_text(json.dumps(config))
    with pytest.raises(PackError, match=r"config.json: quantization_config: bits is 'four', not a bit count in"):
        cfg.maybe_update_config(str(pack))


def test_the_pack_check_reads_the_config_the_server_built(vllm_layers, fixtures_dir, tmp_path):
    """maybe_update_config holds the layers against vLLM's hf_config (config.json after --hf-overrides), not the
    file alone: a config.json whose attention_bias the pack contradicts is refused as it stands, and passes with the
    override that corrects it; a draft's class as vLLM renames it is not held against Llama's layer."""
    import json
    import shutil

    from transformers import LlamaConfig

    from quantpack_core.errors import PackError

    pack = tmp_path / "p"
    shutil.copytree(fixtures_dir / "llama-tiny-exl3-4.0bpw-mul1", pack)
    config = json.loads((pack / "config.json").read_text())
    (pack / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    cfg = vllm_layers.from_config(config["quantization_config"])
    with pytest.raises(PackError, match="holds no bias, but vLLM's LlamaForCausalLM gives it one"):
        cfg.maybe_update_config(str(pack))
    with pytest.raises(PackError, match="holds no bias"):
        cfg.maybe_update_config(str(pack), LlamaConfig(**{**config, "attention_bias": True}))
    cfg.maybe_update_config(str(pack), LlamaConfig(**{**config, "attention_bias": False}))  # --hf-overrides
    draft = LlamaConfig(**{**config, "attention_bias": True, "architectures": ["EagleLlamaForCausalLM"]})
    cfg.maybe_update_config(str(pack), draft)


def test_a_hugging_face_repository_is_checked_before_loading(vllm_layers, fixtures_dir, tmp_path, monkeypatch):
    """``vllm serve OWNER/REPO --revision B`` hands maybe_update_config the repository id: the check runs on the
    branch's snapshot in huggingface_hub's cache (here an offline cache holding it), as on a folder - the damaged
    branch refused with the pack check's message, the sound one read (its manifest) - instead of only fetching the
    manifest and leaving the check to no one."""
    import json
    import shutil

    huggingface_hub = pytest.importorskip("huggingface_hub")
    from quantpack_core.errors import PackError

    cache, repo = tmp_path / "hub", "someone/llama-tiny-exl3"
    root = cache / f"models--{repo.replace('/', '--')}"
    for i, branch in enumerate(("4.0bpw", "broken")):
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / branch).write_text(f"{i + 1:040x}")
        shutil.copytree(fixtures_dir / "llama-tiny-exl3-4.0bpw-mul1", root / "snapshots" / f"{i + 1:040x}")
    broken = root / "snapshots" / f"{2:040x}" / "config.json"
    config = json.loads(broken.read_text())
    config["quantization_config"]["bits"] = "four"
    broken.write_text(json.dumps(config))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cfg = vllm_layers.from_config(config["quantization_config"] | {"bits": 4})
    with pytest.raises(PackError, match=r"config.json: quantization_config: bits is 'four', not a bit count in"):
        cfg.maybe_update_config(repo, None, "broken")
    cfg.maybe_update_config(repo, None, "4.0bpw")
    assert cfg.storage and set(cfg.storage.values()) >= {"exl3"}
