"""GPU tier, end to end: escha packs converted (``quantpack escha-from-exl3``) from the bundled mcg EXL3 packs, served
by vLLM's CUDA build through the plugin, float16, eager and with torch.compile + CUDA graphs, with CUDA's first kernel
(quantpack-core's trellis_mma) and, for the two-K pack, the Triton kernel forced
(``QUANTPACK_ESCHA_BACKEND=triton``): prompt logprobs against the source pack's reference logits (exllamav3's own
forward; for a Qwen3.5 source without them, the core codec's dequantized source weights in transformers, float32).

The packs: llama-tiny 4.0 bpw; llama-tiny with every gate_proj at K=2 and up_proj at K=3 (vLLM's merged
gate_up_proj runs two K in one layer); the Qwen3.5 text model (Gated DeltaNet layers). The int8 embedding and head
of an escha pack add their rounding to the trellis's: their bounds are the escha kind's (tests/e2e_bounds.py).
"""

from pathlib import Path

import e2e_bounds as bounds
import pytest
import torch
from e2e_runner import recorded, run_runner, unsupported_architecture

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU tier: nox -s gpu-tests)"),
]

SOURCES = ["llama-tiny-exl3-4.0bpw-mcg", "llama-tiny-exl3-mcg-k2k3", "qwen3_5-tiny-exl3-4.0bpw-mcg"]
#: the slim vLLM bundle of the GPU machine has no FlashAttention / FlashInfer binaries (ci/gpu/README.md)
LLM_KWARGS = {
    "attention_backend": "TRITON_ATTN",
    "gpu_memory_utilization": 0.15,
    "max_num_seqs": 8,
    "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8]},
    "additional_config": {"gdn_prefill_backend": "triton"},
}


def reference(fixtures_dir: Path, source: str, tmp: Path) -> str:
    """The source pack's reference_logits.pt, or (without one) its dense core-codec weights in transformers
    (float32, on the GPU), on the llama fixture's 128 reference ids."""
    path = fixtures_dir / source / "reference_logits.pt"
    if path.exists():
        return str(path)
    from quantpack_core.reference import dense_transformers_model

    if source.startswith("qwen3_5"):  # the text-only class of a Qwen3.5 pack
        model = dense_transformers_model(
            fixtures_dir / source, "Qwen3_5ForCausalLM", rename=("model.language_model.", "model.")
        )
    else:
        model = dense_transformers_model(fixtures_dir / source)
    ids = torch.load(fixtures_dir / "llama-tiny-exl3-4.0bpw-mul1" / "reference_logits.pt")["input_ids"]
    with torch.no_grad():
        logits = model.cuda()(ids.cuda()).logits.float().cpu()
    out = tmp / f"{source}.reference.pt"
    torch.save({"input_ids": ids, "logits": logits}, out)
    return str(out)


@pytest.fixture(scope="module")
def results(fixtures_dir, tmp_path_factory):
    from quantpack_escha.convert import escha_from_exl3

    tmp = tmp_path_factory.mktemp("escha_gpu_e2e")
    jobs, unsupported = {}, {}
    for source in SOURCES:
        why = unsupported_architecture(fixtures_dir / source)
        if why:  # an older vLLM of the GPU matrix without the model
            unsupported[source] = why
            continue
        pack = escha_from_exl3(fixtures_dir / source, tmp / source, random_split=True).out_dir
        base = {"kind": "logits", "pack": str(pack), "dtype": "float16", "llm_kwargs": LLM_KWARGS}
        base["reference"] = reference(fixtures_dir, source, tmp)
        jobs[f"{source}/eager"] = dict(base, eager=True)
        jobs[f"{source}/graphs"] = dict(base, eager=False)
        if source == TRITON_SOURCE:
            jobs[f"{source}/triton/eager"] = dict(base, eager=True, env={"QUANTPACK_ESCHA_BACKEND": "triton"})
    return {**run_runner(jobs, tmp, timeout=1800), "_unsupported": unsupported}


#: the pack also served with the Triton kernel forced (its merged gate_up_proj runs two K)
TRITON_SOURCE = "llama-tiny-exl3-mcg-k2k3"


@pytest.mark.parametrize(
    "job",
    [f"{s}/{m}" for s in SOURCES for m in ("eager", "graphs")] + [f"{TRITON_SOURCE}/triton/eager"],
)
def test_converted_packs_on_cuda(results, figures, gpu_record, job):
    why = results["_unsupported"].get(job.split("/")[0])
    if why:
        pytest.skip(why)
    res, rec = recorded(gpu_record, results, job)
    kernels = res["shard_kernels"]
    figures.append(f"GPU escha {job} float16: KL {res['kl']:.3g}, top-1 {100 * res['top1']:.2f}%, runs {kernels}")
    rec.figures["shard_kernels"] = kernels
    rec.check("kl", res["kl"], bounds.ESCHA_KL)
    rec.check("top1", res["top1"], bounds.ESCHA_TOP1)
    rec.assert_passed()
    assert all("EschaInt8Embedding" in m["method"] for m in res["vocab_modules"].values()), res["vocab_modules"]
    want, other = ("triton", "trellis_mma") if "/triton/" in job else ("trellis_mma", "triton")
    assert want in kernels and other not in kernels, kernels  # every coded layer on the kernel this job asks for
