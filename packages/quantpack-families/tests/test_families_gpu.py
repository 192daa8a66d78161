"""The families' tiny packs served by vLLM's CUDA build (GPU tier: ``nox -s gpu-tests``): Spark 2.5 and Flint
through the model classes the families register, and the Nemotron-H text tower through vLLM's own model with the
family's Mamba2 ``in_proj`` fix, each EXL3 pack and its bf16 twin in float16, eager and with compile + CUDA graphs.
Their prompt logprobs are compared with the same independent references as on CPU (spark_reference.py,
flint_reference.py, nemotron_h_reference.py: float64 forwards written from each architecture's description), within
the GPU bound of the family issue: KL <= 5e-4 and top-1 >= 99%; graphs must give eager's greedy tokens (or part
from them only at an exact near-tie, ``e2e_runner.greedy_agreement``).

One runner process serves every job (first engine start included, a few minutes on the H200). The EXL3 layers run
on the CUDA kernels the platform chooses (trellis_mma for float16). ``QUANTPACK_GPU_JOBS`` narrows the jobs as for
the EXL3 end-to-end tests (substrings of the job ids, e.g. ``flint``).
"""

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU tier: nox -s gpu-tests)"),
]

#: the GPU bound of the family issue (float16 against the float64 references)
KL_BOUND, TOP1_BOUND = 5e-4, 0.99
#: prompt length of the GPU packs' references: 127 compared positions, so the 99% bound tolerates one argmax flip at
#: a float16 near-tie (the tiny random models have many; 31 positions, the CPU tests' length, tolerate none)
LENGTH = 128
#: vLLM settings of the GPU tier (the slim bundle has no FlashAttention / FlashInfer; a small share of the GPU)
LLM_KWARGS = {"attention_backend": "TRITON_ATTN", "gpu_memory_utilization": 0.15}


def selected(key: str) -> bool:
    """Whether ``QUANTPACK_GPU_JOBS`` (comma-separated substrings; unset: every job) selects the job ``key``."""
    only = [s for s in os.environ.get("QUANTPACK_GPU_JOBS", "").split(",") if s]
    return not only or any(s in key for s in only)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Every family pack written at test time, served in float16 eager and with graphs by one runner run."""
    pytest.importorskip("vllm")
    from e2e_runner import run_runner
    from flint_reference import write_flint_packs
    from nemotron_h_reference import write_nemotron_h_packs
    from spark_reference import write_spark_packs

    packs = {}
    for family, write in (("spark", write_spark_packs), ("flint", write_flint_packs)):
        packs.update(write(tmp_path_factory.mktemp(family), length=LENGTH))
    packs.update(write_nemotron_h_packs(tmp_path_factory.mktemp("nemotron_h"), length=LENGTH))
    jobs = {}
    for name, path in packs.items():
        for mode, eager in (("eager", True), ("graphs", False)):
            key = f"{name}/float16/{mode}"
            if selected(key):
                jobs[key] = {"kind": "logits", "pack": str(path), "dtype": "float16", "eager": eager}
                jobs[key]["llm_kwargs"] = LLM_KWARGS
    if not jobs:
        pytest.skip(f"no family job selected by QUANTPACK_GPU_JOBS={os.environ.get('QUANTPACK_GPU_JOBS')}")
    return jobs, run_runner(jobs, tmp_path_factory.mktemp("runner"), timeout=1800)


def test_family_packs_match_their_references_on_the_gpu(served):
    """Each pack (EXL3 and bf16 twin) within the bound in both modes; graphs give eager's greedy tokens."""
    from e2e_runner import get, greedy_agreement

    jobs, results = served
    failures = []
    for key in jobs:  # every job's figures first, then the failures together
        res = results.get(key, {})
        if "kl" not in res:
            failures.append(f"{key}: {res.get('failed', 'no result')}")
            continue
        print(f"GPU {key}: KL {res['kl']:.2e}, top-1 {res['top1']:.3f} over {res['positions']} positions")
        if not (res["kl"] <= KL_BOUND and res["top1"] >= TOP1_BOUND):
            failures.append(f"{key}: KL {res['kl']:.3g}, top-1 {res['top1']:.3f}")
        eager = key.replace("/graphs", "/eager")
        if key.endswith("/graphs") and eager in jobs and "kl" in results.get(eager, {}):
            print(f"GPU {key} greedy vs eager: {greedy_agreement(get(results, eager), res)}")
    assert not failures, "\n".join(failures)


def test_exl3_modules_are_served_by_the_exl3_method_on_the_gpu(served):
    """The EXL3 packs' heads are served by the EXL3 method on CUDA too (no dense fallback), the twins' by vLLM's."""
    from e2e_runner import get

    jobs, results = served
    for key in jobs:
        if "/eager" not in key:
            continue
        head = get(results, key)["vocab_modules"].get("lm_head")
        if head is None:  # a tied head has no module of its own
            continue
        want = "Exl3LinearMethod" if "-exl3" in key else "Unquantized"
        assert head["method"].startswith(want), (key, head)
