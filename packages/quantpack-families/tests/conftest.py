"""Fixtures of the families' tests that build vLLM layers in-process on CPU."""

import tempfile

import pytest


@pytest.fixture(scope="module")
def world():
    """A one-rank world and the EXL3 config class (the plugins registered)."""
    from vllm.distributed import cleanup_dist_env_and_memory, init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    from quantpack_core.vllm.layers import patch_embedding_constructors
    from quantpack_exl3.config import Exl3Config

    patch_embedding_constructors()
    own = not model_parallel_is_initialized()
    with tempfile.TemporaryDirectory() as tmp:
        if own:
            from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

            with set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"))):
                init_distributed_environment(1, 0, f"file://{tmp}/d", 0, backend="gloo")
                initialize_model_parallel(1, 1)
        yield Exl3Config
        if own:
            cleanup_dist_env_and_memory()
