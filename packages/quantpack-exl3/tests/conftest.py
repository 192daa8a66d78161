"""Fixtures for tests that build vLLM layers in-process on CPU (tier 2)."""

import tempfile

import pytest

vllm = pytest.importorskip("vllm")


@pytest.fixture(scope="session")
def vllm_layers():
    """A world of one rank (gloo) and a current vLLM config, as vLLM's own layer tests set up; the plugin is
    registered. Yields the Exl3Config class."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        cleanup_dist_env_and_memory,
        init_distributed_environment,
        initialize_model_parallel,
    )

    from quantpack_exl3.plugin import register

    register()
    from quantpack_exl3.config import Exl3Config

    with tempfile.TemporaryDirectory() as tmp, set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"))):
        init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"file://{tmp}/dist", local_rank=0, backend="gloo"
        )
        initialize_model_parallel(1, 1)
        yield Exl3Config
        cleanup_dist_env_and_memory()


@pytest.fixture(scope="session")
def e2e(fixtures_dir, tmp_path_factory):
    """Results of every end-to-end vLLM job (see e2e_jobs.py), run once per session in one vLLM process."""
    from e2e_jobs import run_jobs

    return run_jobs(fixtures_dir, tmp_path_factory.mktemp("e2e"))


@pytest.fixture(scope="session")
def e2e_tp(fixtures_dir, tmp_path_factory):
    """Results of the tensor-parallel (TP 2) end-to-end jobs (see e2e_jobs.run_tp_jobs), once per session."""
    from e2e_jobs import run_tp_jobs

    return run_tp_jobs(fixtures_dir, tmp_path_factory.mktemp("e2e_tp"))
