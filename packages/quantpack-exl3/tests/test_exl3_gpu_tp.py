"""GPU tier, tensor parallelism end to end: vLLM's CUDA build serves every bundled EXL3 pack at tensor-parallel
size 2 on two GPUs (NCCL all-reduce; NVLink multicast off, ci/gpu/env.sh), with exllamav3's kernels per rank, and
its prompt log-probabilities are compared with each pack's reference as at size 1 (test_exl3_gpu_vllm.py).

Size 2 exercises every cut (see test_exl3_tp_e2e.py): block-aligned slices, the column and row fallbacks, a fused
layer with both (qkv_proj: q sliced, k / v whole), Qwen3.5's tuple shard ids, the vocabulary-parallel head and
embedding, the experts' intermediate cut (Qwen3-MoE, 128 channels per rank) and their expert-split fallback
(Qwen3-Next: 64 per rank, so each rank runs half the experts whole). Qwen3-Next also runs at size 1 here.

``QUANTPACK_GPU_TP_ONLY=qwen3next,mixed`` (substrings of job names) runs only the matching jobs; the other tests
skip."""

import os

import e2e_bounds as bounds
import pytest
import torch
from e2e_jobs import LLAMA_PACKS, MIXED_PACK, MOE_PACKS, NEXT_PACK, run_runner
from e2e_runner import recorded, router_split
from test_exl3_gpu_vllm import LLM_KWARGS, QWEN_LLM_KWARGS, QWEN_PACK, qwen_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two CUDA devices (the GPU tier on a machine of two: nox -s gpu-tests)",
    ),
]

PACKS = [*LLAMA_PACKS, QWEN_PACK, *MOE_PACKS, NEXT_PACK]
#: packs with a router (a rounding difference can flip a near-tie of two expert scores and move that one token) and
#: their bounds (tests/e2e_bounds.py); the others are dense float16 jobs as at size 1
ROUTED = {
    **dict.fromkeys(MOE_PACKS, (bounds.QWEN3MOE_KL, bounds.QWEN3MOE_TOP1)),
    NEXT_PACK: (bounds.QWEN3NEXT_KL, bounds.QWEN3NEXT_TOP1),
}
#: job-name substrings to run (all jobs when empty)
ONLY = [s for s in os.environ.get("QUANTPACK_GPU_TP_ONLY", "").split(",") if s]


@pytest.fixture(scope="module")
def gpu_tp(fixtures_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_tp")
    qref = qwen_reference(fixtures_dir, tmp / "qwen_reference.pt")
    jobs = {}
    # Qwen3-Next at size 1 first, on GPUs no size-2 engine has used yet (those engines' worker processes once held
    # their memory after the job; vllm_e2e.release now shuts them down)
    next_kwargs = {"kind": "logits", "pack": str(fixtures_dir / NEXT_PACK), "llm_kwargs": QWEN_LLM_KWARGS}
    jobs[f"{NEXT_PACK}/tp1/eager"] = dict(next_kwargs, dtype="float16", eager=True)
    for name in PACKS:
        kwargs = QWEN_LLM_KWARGS if name in (QWEN_PACK, NEXT_PACK) else LLM_KWARGS
        base = {"kind": "logits", "pack": str(fixtures_dir / name), "llm_kwargs": kwargs, "dtype": "float16"}
        if name == QWEN_PACK:
            base["reference"] = str(qref)
        jobs[f"{name}/tp2/eager"] = dict(base, eager=True, tp=2)
    # under graph capture: the fallbacks' index_select / zero-extension, and the expert split's -1 picks
    for name in (LLAMA_PACKS[0], MIXED_PACK, NEXT_PACK):
        jobs[f"{name}/tp2/graphs"] = dict(jobs[f"{name}/tp2/eager"], eager=False)
    jobs = {k: v for k, v in jobs.items() if not ONLY or any(s in k for s in ONLY)}
    out = run_runner(jobs, tmp, timeout=1800)
    out["_jobs"] = sorted(jobs)
    return out


def result(results: dict, key: str, gpu_record) -> tuple[dict, object]:
    """The job's result and record; skips a job left out by ``QUANTPACK_GPU_TP_ONLY``."""
    if key not in results["_jobs"]:
        pytest.skip(f"{key} not selected by QUANTPACK_GPU_TP_ONLY={','.join(ONLY)}")
    return recorded(gpu_record, results, key)


def check(res: dict, rec, name: str, fixtures_dir, figures, label: str) -> None:
    """The bounds as at size 1: a dense pack's float16 ones; a routed pack's outside the router near-ties that
    departed (``quantpack_core.compare.outside_router_ties``, each position left out recorded with its margin)."""
    if name in ROUTED:
        kl_bound, top1_bound = ROUTED[name]
        split = router_split(fixtures_dir / name, res, kl_bound.limit)
        rec.outside_router_ties(split)
        rec.check("kl_outside_router_ties", split.kl, kl_bound)
        rec.check("top1", res["top1"], top1_bound)
        kl = f"{res['kl']:.3g} ({split.kl:.3g} outside the departed router near-ties {list(split.excluded)})"
    else:
        rec.check("kl", res["kl"], bounds.F16_KL)
        rec.check("top1", res["top1"], bounds.F16_TOP1)
        kl = f"{res['kl']:.3g}"
    rec.figures["load_s"] = res["load_s"]
    figures.append(f"GPU {name} {label} float16: KL {kl}, top-1 {100 * res['top1']:.2f}%, load {res['load_s']:.0f} s")
    rec.assert_passed()


@pytest.mark.parametrize("name", PACKS)
def test_tp2_matches_reference(gpu_tp, figures, fixtures_dir, gpu_record, name):
    res, rec = result(gpu_tp, f"{name}/tp2/eager", gpu_record)
    check(res, rec, name, fixtures_dir, figures, "TP 2 eager")


@pytest.mark.parametrize("name", [LLAMA_PACKS[0], MIXED_PACK, NEXT_PACK])
def test_tp2_graphs(gpu_tp, figures, fixtures_dir, gpu_record, name):
    res, rec = result(gpu_tp, f"{name}/tp2/graphs", gpu_record)
    check(res, rec, name, fixtures_dir, figures, "TP 2 compile + graphs")


def test_qwen3_next_tp1_on_cuda(gpu_tp, figures, fixtures_dir, gpu_record):
    res, rec = result(gpu_tp, f"{NEXT_PACK}/tp1/eager", gpu_record)
    check(res, rec, NEXT_PACK, fixtures_dir, figures, "TP 1 eager")
