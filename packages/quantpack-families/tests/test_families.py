"""quantpack-families on vLLM's CPU build: which fixes register where, and the Qwen3.5 name mapping on the bundled
Qwen3.5 pack (the model class itself needs torchvision; it is exercised end to end by the GPU tier on vLLM 0.25.1,
which lacks the architecture)."""

from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures"


@pytest.fixture
def fresh_plugin():
    """The plugin module with its once-per-process guard reset, and vLLM's registry restored afterwards."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from quantpack_families import plugin

    saved, saved_hooks = dict(ModelRegistry.models), dict(MODELS_CONFIG_MAP)
    plugin._registered = False
    yield plugin
    ModelRegistry.models.clear()
    ModelRegistry.models.update(saved)
    MODELS_CONFIG_MAP.clear()
    MODELS_CONFIG_MAP.update(saved_hooks)
    plugin._registered = False


def registered_target(arch: str) -> str:
    from vllm import ModelRegistry

    m = ModelRegistry.models[arch]
    return f"{m.module_name}:{m.class_name}"


def test_known_architectures_are_left_to_vllm(fresh_plugin):
    """This vLLM registers Qwen3_5ForCausalLM itself (0.29+): the plugin must not replace it."""
    before = registered_target("Qwen3_5ForCausalLM")
    fresh_plugin.register()
    assert registered_target("Qwen3_5ForCausalLM") == before
    assert before.startswith("vllm.")


def test_missing_architecture_is_registered(fresh_plugin, monkeypatch):
    """As on vLLM 0.20 - 0.28, where the name is not registered: the fix class is, with the Qwen3.5 config hook
    (Gated DeltaNet state dtype) vLLM runs by architecture name."""
    from vllm import ModelRegistry
    from vllm.model_executor.models import config as model_configs

    from quantpack_families import registry

    monkeypatch.setattr(registry, "vllm_version", lambda: "0.28.0")  # the family applies below 0.29
    del ModelRegistry.models["Qwen3_5ForCausalLM"]
    del model_configs.MODELS_CONFIG_MAP["Qwen3_5ForCausalLM"]
    fresh_plugin.register()
    assert registered_target("Qwen3_5ForCausalLM") == "quantpack_families.models.qwen3_5:Qwen3_5TextForCausalLM"
    hook = model_configs.MODELS_CONFIG_MAP["Qwen3_5ForCausalLM"]
    assert hook is model_configs.Qwen3_5ForConditionalGenerationConfig
    fresh_plugin.register()  # idempotent
    assert registered_target("Qwen3_5ForCausalLM") == "quantpack_families.models.qwen3_5:Qwen3_5TextForCausalLM"


def test_entry_point_is_installed():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("quantpack_families") == "quantpack_families.plugin:register"


def test_qwen3_5_pack_names_map_onto_the_text_model():
    """Every tensor of the bundled Qwen3.5 pack maps, through vLLM's WeightsMapper and the fix's prefixes, to a
    name under the text model's modules (``model.layers``, ``model.embed_tokens``, ``model.norm``, ``lm_head``)."""
    from safetensors import safe_open
    from vllm.model_executor.models.utils import WeightsMapper

    from quantpack_families.families.qwen3_5 import TEXT_PREFIXES

    mapper = WeightsMapper(orig_to_new_prefix=TEXT_PREFIXES)
    with safe_open(str(FIXTURES / "qwen3_5-tiny-exl3-4.0bpw-mul1" / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(n.startswith("model.language_model.") for n in names)
    mapped = mapper.apply_list(names)
    assert len(mapped) == len(names)
    roots = ("model.layers.", "model.embed_tokens.", "model.norm.", "lm_head.")
    assert all(m.startswith(roots) for m in mapped), [m for m in mapped if not m.startswith(roots)]
    assert mapper.apply_list(["mtp.fc.weight", "model.visual.blocks.0.attn.qkv.weight"]) == []


def test_model_init_announces_its_embedding_to_compressed_tensors():
    """A model class wrapped by registry.wrap_init builds its unnamed embedding with the compressed-tensors config
    and the name '<prefix>.embed_tokens' (vLLM's Qwen3NextModel / Qwen3_5Model build it with neither)."""
    import tempfile

    import torch
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import cleanup_dist_env_and_memory, init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from quantpack_core.vllm.layers import patch_embedding_constructors
    from quantpack_families.registry import wrap_init

    patch_embedding_constructors()  # the families plugin installs it too

    class TinyModel(torch.nn.Module):  # stands in for the model file's class: same signature, same unnamed embedding
        def __init__(self, *, vllm_config, prefix: str = ""):
            super().__init__()
            self.embed_tokens = VocabParallelEmbedding(1024, 256)

    assert wrap_init(TinyModel) and not wrap_init(TinyModel)
    ct = CompressedTensorsConfig.from_config(
        {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "g": {
                    "targets": ["re:.*embed_tokens$"],
                    "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                }
            },
            "ignore": [],
        }
    )
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    own_world = not model_parallel_is_initialized()  # another test module may have set up the one-rank world
    with tempfile.TemporaryDirectory() as tmp:
        vc = VllmConfig(device_config=DeviceConfig("cpu"), quant_config=ct)
        with set_current_vllm_config(vc):
            if own_world:
                init_distributed_environment(1, 0, f"file://{tmp}/d", 0, backend="gloo")
                initialize_model_parallel(1, 1)
            try:
                model = TinyModel(vllm_config=vc, prefix="model")
            finally:
                if own_world:
                    cleanup_dist_env_and_memory()
    assert type(model.embed_tokens.quant_method).__name__ == "CompressedTensorsEmbeddingWNA16Int"


def test_vllm_model_modules_are_patched_when_imported():
    """The post-import hook wraps Qwen3NextModel when vLLM imports qwen3_next.py (here, or already imported)."""
    from quantpack_families.families import FAMILIES
    from quantpack_families.registry import _MARK, install_announcements

    install_announcements(FAMILIES)
    from vllm.model_executor.models.qwen3_next import Qwen3NextModel

    assert getattr(Qwen3NextModel.__init__, _MARK, False)


def test_registry_declares_versions_and_imports_no_model_code():
    """Each family says where it applies (Qwen3.5's registration below vLLM 0.29, announcements everywhere), and
    reading the registry, even applying it, imports no vLLM model file (they are patched when vLLM imports them)."""
    import subprocess
    import sys

    from quantpack_families.families import FAMILIES

    by_name = {f.name: f for f in FAMILIES}
    assert set(by_name) == {
        "qwen3_5",
        "qwen3_next",
        "qwen4_exp",
        "flint",
        "spark",
        "nemotron_h",
        "nemotron_vl",
        "qwen_vision",
    }
    assert by_name["qwen3_5"].applies_to("0.25.1") and not by_name["qwen3_5"].applies_to("0.32.0")
    assert by_name["qwen3_5"].applies_to("0.28.0rc1") and not by_name["qwen3_5"].applies_to("0.29.0")
    assert all(
        by_name[f].applies_to(v)
        for f in ("qwen3_next", "qwen4_exp", "flint", "spark", "nemotron_h", "nemotron_vl", "qwen_vision")
        for v in ("0.20.0", "0.25.1", "0.32.0")
    )
    code = (
        "import sys\n"
        "from quantpack_families.families import FAMILIES\n"
        "from quantpack_families.registry import install_announcements\n"
        "install_announcements(FAMILIES)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('vllm.model_executor.models.', 'vllm.models.'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
