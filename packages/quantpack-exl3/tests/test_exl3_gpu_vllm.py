"""GPU tier, end to end: vLLM's CUDA build serves the bundled packs with exllamav3's kernels through the plugin
(entry point, as any user's process). Prompt logprobs against exllamav3's reference logits (for the Qwen3.5 pack,
against the core codec's dequantized weights in transformers), and identical greedy tokens eager and with
torch.compile + CUDA graphs."""

from pathlib import Path

import pytest
import torch
from e2e_jobs import LLAMA_PACKS, get, run_runner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU tier: nox -s gpu-tests)"),
]

QWEN_PACK = "qwen3_5-tiny-exl3-4.0bpw-mul1"
#: the slim vLLM bundle of the GPU machine has no FlashAttention/FlashInfer binaries
LLM_KWARGS = {
    "attention_backend": "TRITON_ATTN",
    "gpu_memory_utilization": 0.15,
    "max_num_seqs": 8,
    "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8]},
}
#: vLLM 0.20-0.26 ship the text-only Qwen3.5 class but do not register its architecture name
REGISTER = {"Qwen3_5ForCausalLM": "vllm.model_executor.models.qwen3_5:Qwen3_5ForCausalLM"}


def qwen_reference(fixtures_dir: Path, out: Path) -> Path:
    """Reference logits for the Qwen3.5 pack: the core codec's dequantized weights in transformers (fp32, GPU), on
    the llama fixture's 128 reference token ids (same tokenizer)."""
    import transformers

    from quantpack_core import Pack

    pack_dir = fixtures_dir / QWEN_PACK
    cfg = transformers.AutoConfig.from_pretrained(pack_dir)
    del cfg.quantization_config
    model = transformers.Qwen3_5ForCausalLM(cfg).float().eval()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    state = {
        k.replace("model.language_model.", "model."): v
        for k, v in Pack.open(pack_dir).dense_state_dict(torch.float32).items()
    }
    state = {k: v[tuple(slice(0, n) for n in shapes[k])] if k in shapes else v for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    ids = torch.load(fixtures_dir / LLAMA_PACKS[0] / "reference_logits.pt")["input_ids"]
    with torch.no_grad():
        logits = model.cuda()(ids.cuda()).logits.float().cpu()
    torch.save({"input_ids": ids, "logits": logits}, out)
    return out


@pytest.fixture(scope="module")
def gpu_e2e(fixtures_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_e2e")
    qref = qwen_reference(fixtures_dir, tmp / "qwen_reference.pt")
    jobs = {}
    for name in [*LLAMA_PACKS, QWEN_PACK]:
        base = {"kind": "logits", "pack": str(fixtures_dir / name), "llm_kwargs": LLM_KWARGS, "register": REGISTER}
        if name == QWEN_PACK:
            base["reference"] = str(qref)
        jobs[f"{name}/float16/eager"] = dict(base, dtype="float16", eager=True)
        jobs[f"{name}/float16/graphs"] = dict(base, dtype="float16", eager=False)
        jobs[f"{name}/bfloat16/eager"] = dict(base, dtype="bfloat16", eager=True)
    return run_runner(jobs, tmp, timeout=1800)


@pytest.mark.parametrize("name", [*LLAMA_PACKS, QWEN_PACK])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_prompt_logprobs_match_reference(gpu_e2e, figures, name, dtype):
    res = get(gpu_e2e, f"{name}/{dtype}/eager")
    figures.append(
        f"GPU {name} {dtype} eager: KL {res['kl']:.3g}, top-1 {100 * res['top1']:.2f}%, load {res['load_s']:.1f} s"
    )
    assert res["kl"] <= 5e-4
    assert res["top1"] >= 0.99


@pytest.mark.parametrize("name", [*LLAMA_PACKS, QWEN_PACK])
def test_graphs_match_eager(gpu_e2e, figures, name):
    eager, graphs = get(gpu_e2e, f"{name}/float16/eager"), get(gpu_e2e, f"{name}/float16/graphs")
    figures.append(f"GPU {name} float16 compile+graphs: KL {graphs['kl']:.3g}, load {graphs['load_s']:.1f} s")
    assert graphs["kl"] <= 5e-4
    assert graphs["greedy"] == eager["greedy"]
