"""The end-to-end runner's engine arguments (tests/vllm_e2e.py): ``QUANTPACK_GPU_LLM_KWARGS`` goes over every job's
``llm_kwargs``, which go over the runner's defaults; a value that is not a JSON object is refused with the
variable named. The GPU matrix's lanes rely on it to give every engine a fixed KV cache (ci/gpu/jobs.toml)."""

from __future__ import annotations

import sys
import types

import pytest
import vllm_e2e


@pytest.fixture
def recorded(monkeypatch):
    """A stand-in ``vllm`` module whose ``LLM`` records its keyword arguments (the runner imports it lazily), so the
    arguments a job would build its engine with are read without building one."""
    calls: list[dict] = []
    fake = types.ModuleType("vllm")
    fake.LLM = lambda **kwargs: calls.append(kwargs) or kwargs
    fake.ModelRegistry = types.SimpleNamespace(get_supported_archs=lambda: [], register_model=lambda *a: None)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    return calls


JOB = {"pack": "/packs/p", "llm_kwargs": {"max_num_seqs": 8, "gpu_memory_utilization": 0.15}}


def test_the_variable_goes_over_the_jobs_arguments_and_those_over_the_defaults(recorded, monkeypatch):
    monkeypatch.setenv(
        "QUANTPACK_GPU_LLM_KWARGS", '{"kv_cache_memory_bytes": 2147483648, "max_num_seqs": 4, "max_model_len": 256}'
    )
    kwargs = vllm_e2e.make_llm(JOB, "float16", False, 20, seed=7)
    assert kwargs["model"] == "/packs/p" and kwargs["dtype"] == "float16" and kwargs["enforce_eager"] is False
    assert kwargs["max_logprobs"] == 20 and kwargs["seed"] == 7  # the caller's extra over the defaults
    assert kwargs["kv_cache_memory_bytes"] == 2147483648
    assert kwargs["max_num_seqs"] == 4 and kwargs["max_model_len"] == 256  # over the job's and the default 512
    assert kwargs["gpu_memory_utilization"] == 0.15  # the job's, untouched


def test_unset_or_empty_adds_nothing(recorded, monkeypatch):
    monkeypatch.delenv("QUANTPACK_GPU_LLM_KWARGS", raising=False)
    unset = vllm_e2e.make_llm(JOB, "bfloat16", True)
    monkeypatch.setenv("QUANTPACK_GPU_LLM_KWARGS", "")
    assert vllm_e2e.make_llm(JOB, "bfloat16", True) == unset
    assert "kv_cache_memory_bytes" not in unset and unset["max_model_len"] == 512 and unset["max_num_seqs"] == 8


@pytest.mark.parametrize("text", ["{kv_cache_memory_bytes: 1}", "[1, 2]", '"x"', "3"])
def test_a_value_that_is_no_json_object_is_refused_naming_the_variable(recorded, monkeypatch, text):
    monkeypatch.setenv("QUANTPACK_GPU_LLM_KWARGS", text)
    with pytest.raises(ValueError, match="QUANTPACK_GPU_LLM_KWARGS"):
        vllm_e2e.make_llm(JOB, "float16", True)
    assert recorded == []  # refused before an engine is built
