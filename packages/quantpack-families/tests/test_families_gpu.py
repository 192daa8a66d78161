"""The families' tiny packs served by vLLM's CUDA build (GPU tier: ``nox -s gpu-tests``): Spark 2.5 and Flint
through the model classes the families register, and the Nemotron-H text tower through vLLM's own model with the
family's Mamba2 ``in_proj`` fix, each EXL3 pack and its bf16 twin in float16, eager and with compile + CUDA graphs.
Nemotron-H also as a pack of Nemotron-3.5-Super's layer kinds whose routed ungated relu2 experts are EXL3
(``nemotron-h-moe-exl3``: latent MoE, three K groups per layer; vLLM builds such layers on CUDA only). Their prompt
logprobs are compared with the same independent references as on CPU (spark_reference.py,
flint_reference.py, nemotron_h_reference.py: float64 forwards written from each architecture's description), within
the GPU bound of the family issue: KL <= 5e-4 and top-1 >= 99% (over the positions that are not float16 near-ties,
``e2e_runner.NEAR_TIE``); graphs must give eager's greedy tokens (or part from them only at an exact near-tie,
``e2e_runner.greedy_agreement``).

Where ``QUANTPACK_FAMILY_CONVERTED`` names the output of ``fixtures/tools/make_family_exl3.py``, the Spark and
Nemotron-H packs exllamav3's own converter made from the bf16 twins are served too (``spark-exl3-converter``,
``nemotron-h-exl3-converter``), against the same float64 forwards on their own decoded weights.

One runner process per family serves its jobs (first engine start included, a few minutes on the H200). The EXL3
layers run on the CUDA kernels the platform chooses (trellis_mma for float16). ``QUANTPACK_GPU_JOBS`` narrows the
jobs as for the EXL3 end-to-end tests (substrings of the job ids, e.g. ``flint``).
"""

import json
import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU tier: nox -s gpu-tests)"),
]

#: the GPU bound of the family issue (float16 against the float64 references); top-1 over the positions whose
#: reference top-2 are more than e2e_runner.NEAR_TIE apart (0.05 nats, the near-tie of the greedy comparison): the
#: tiny random models' logits are flat enough that some positions lie within the float16 noise their KL implies
#: (about 0.02 nats at KL 2e-4; the SiLU-gate Spark pack has 5 of 127 within 0.03 nats), and a flip there says
#: nothing about the model. The raw top-1 and the count of near-ties are printed beside it.
KL_BOUND, TOP1_BOUND = 5e-4, 0.99
#: prompt length of the GPU packs' references: 127 compared positions
LENGTH = 128
#: vLLM settings of the GPU tier (the slim bundle has no FlashAttention / FlashInfer; a small share of the GPU);
#: ``QUANTPACK_GPU_LLM_KWARGS`` (a JSON object) goes over them for a diagnostic run (tests/vllm_e2e.py), e.g.
#: ``{"compilation_config": {"cudagraph_mode": "PIECEWISE"}}``
LLM_KWARGS = {
    "attention_backend": "TRITON_ATTN",
    "gpu_memory_utilization": 0.15,
}


#: the packs exllamav3's converter made (fixtures/tools/make_family_exl3.py), by folder name under
#: QUANTPACK_FAMILY_CONVERTED; each holds reference_logits.pt (the family's float64 forward on its decoded weights)
CONVERTED = ("spark-exl3-converter", "nemotron-h-exl3-converter")


def converted_packs() -> tuple[dict, list[str]]:
    """The converter-made packs under ``QUANTPACK_FAMILY_CONVERTED`` (unset: none): ``({name: folder}, missing)``,
    ``missing`` naming each pack (or its reference) that is not there - a failure of the test, with the tool's
    REPORT.json saying why, while the packs that are there are still served."""
    from pathlib import Path

    root = os.environ.get("QUANTPACK_FAMILY_CONVERTED")
    if not root:
        return {}, []
    out, missing = {}, []
    for name in CONVERTED:
        pack = Path(root) / name
        if (pack / "reference_logits.pt").is_file():
            out[name] = pack
        else:
            missing.append(f"QUANTPACK_FAMILY_CONVERTED={root}: no {name} with its reference (see REPORT.json there)")
    return out, missing


def twin_with_layers_naming(twin, tmp_path_factory):
    """A copy of the Nemotron-H bf16 twin whose config.json names its layers as the EXL3 pack's does
    (``layers_block_type``, an MTP layer declared) instead of ``hybrid_override_pattern``: the one config difference
    between the twin, which fails with compile + CUDA graphs on the H200 (KL 4.6), and the EXL3 pack, which passes
    (``QUANTPACK_NEMOTRON_TWIN_NAMING=1``, step ``nemotron-twin`` of ``ci/gpu/pending.sh``)."""
    import shutil

    from nemotron_h_reference import TINY, config_json

    out = tmp_path_factory.mktemp("nemotron_h_naming") / "nemotron-h-bf16-layers-naming"
    shutil.copytree(twin, out)
    (out / "config.json").write_text(json.dumps(config_json(False, "layers_block_type", cfg=TINY), indent=2))
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Every family pack written at test time, served in float16 eager and with graphs by one runner run."""
    pytest.importorskip("vllm")
    from e2e_runner import NEAR_TIE, run_runner, selected
    from flint_reference import write_flint_packs
    from nemotron_h_reference import write_nemotron_h_packs, write_nemotron_moe_pack
    from spark_reference import write_spark_packs

    packs = {}
    for family, write in (("spark", write_spark_packs), ("flint", write_flint_packs)):
        packs.update(write(tmp_path_factory.mktemp(family), length=LENGTH))
    packs.update(write_nemotron_h_packs(tmp_path_factory.mktemp("nemotron_h"), length=LENGTH))
    if os.environ.get("QUANTPACK_NEMOTRON_TWIN_NAMING"):  # diagnostic: the twin's graph fault and its config naming
        packs["nemotron-h-bf16-layers-naming"] = twin_with_layers_naming(packs["nemotron-h-bf16"], tmp_path_factory)
    packs.update(write_nemotron_moe_pack(tmp_path_factory.mktemp("nemotron_h_moe"), length=LENGTH))
    converted, missing = converted_packs()
    packs.update(converted)
    from quantpack_families.models.spark import stacked_names_supported

    if not stacked_names_supported():  # an older vLLM of the GPU matrix: Spark's model refuses it by design
        import vllm

        print(f"Spark's packs not served: its model file needs vLLM 0.25 or newer, this is {vllm.__version__}")
        packs = {name: path for name, path in packs.items() if not name.startswith("spark")}
        missing = [m for m in missing if "spark-" not in m]
    jobs = {}
    for name, path in packs.items():
        for mode, eager in (("eager", True), ("graphs", False)):
            key = f"{name}/float16/{mode}"
            if selected(key):
                jobs[key] = {"kind": "logits", "pack": str(path), "dtype": "float16", "eager": eager}
                jobs[key]["llm_kwargs"] = LLM_KWARGS
                jobs[key]["tie"] = NEAR_TIE
    if not jobs and not missing:
        pytest.skip(f"no family job selected by QUANTPACK_GPU_JOBS={os.environ.get('QUANTPACK_GPU_JOBS')}")
    # one runner process per family: engines of one process do not give all their GPU memory back (on the H200,
    # 2026-12-03, the twelve Spark and Flint engines of one process left 12.9 of 140 GiB free, and the Nemotron-H
    # engines after them failed vLLM's free-memory check at start)
    results = {}
    for family in ("spark", "flint", "nemotron"):
        group = {key: job for key, job in jobs.items() if key.startswith(family)}
        if group:
            out = run_runner(group, tmp_path_factory.mktemp(f"runner-{family}"), timeout=1800)
            results["_log"] = results.get("_log", "") + out.pop("_log")
            results.update(out)
    results["_missing"] = missing
    return jobs, results


#: the job that is the control of a fault of vLLM's own: the dense Nemotron-H twin (no quantpack method serves it at
#: TP 1) compiled and run in float16 outside CUDA graphs gives KL 4.6, top-1 7% - on the H200 on 2026-12-05 with
#: vLLM 0.22.1 and 0.25.1, not 0.26.0, and on 0.25.1 on some runs only (docs/families.md, Nemotron-H; the family
#: warns when vLLM builds such a model). Its failure alone makes the test an expected failure that names it; any
#: other job's failure fails the test
UPSTREAM_FAULT = "nemotron-h-bf16/float16/graphs"


def test_family_packs_match_their_references_on_the_gpu(served):
    """Each pack (EXL3 and bf16 twin) within the bound in both modes; graphs give eager's greedy tokens. Every job's
    figures are printed before the failures are reported together (:data:`UPSTREAM_FAULT` alone: xfail)."""
    from e2e_runner import NEAR_TIE, get, greedy_agreement

    jobs, results = served
    failures = [("converted", m) for m in results["_missing"]]  # converter-made packs asked for and not there
    for key in jobs:
        res = results.get(key, {})
        if "kl" not in res:
            failures.append((key, f"{key}: {res.get('failed', 'no result')}"))
            continue
        print(
            f"GPU {key}: KL {res['kl']:.2e}, top-1 {res['top1_decided']:.3f} over the {res['positions'] - res['ties']} "
            f"positions not within {NEAR_TIE} nats of a tie (over all {res['positions']}: {res['top1']:.3f})"
        )
        if not (res["kl"] <= KL_BOUND and res["top1_decided"] >= TOP1_BOUND):
            failures.append(
                (key, f"{key}: KL {res['kl']:.3g}, top-1 {res['top1_decided']:.3f} ({res['ties']} near-ties)")
            )
        eager = key.replace("/graphs", "/eager")
        if key.endswith("/graphs") and eager in jobs and "kl" in results.get(eager, {}):
            try:
                print(f"GPU {key} greedy vs eager: {greedy_agreement(get(results, eager), res)}")
            except AssertionError as e:
                failures.append((key, f"{key}: greedy tokens not eager's: {e}"))
    messages = "\n".join(m for _, m in failures)
    assert all(key == UPSTREAM_FAULT for key, _ in failures), messages
    if failures:
        pytest.xfail(f"only the control of vLLM's own float16 Nemotron-H compiled-path fault failed: {messages}")


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


def test_nemotron_routed_relu2_experts_are_served_by_the_exl3_banks_on_the_gpu(served):
    """The latent-MoE pack's routed ungated relu2 experts (EXL3, three K groups) reach the EXL3 expert method in
    both MoE layers (its logprobs are checked against the reference with the other packs)."""
    from e2e_runner import get

    jobs, results = served
    key = "nemotron-h-moe-exl3/float16/eager"
    if key not in jobs:
        pytest.skip("the Nemotron-H MoE pack's eager job is not selected")
    methods = get(results, key)["quant_methods"]
    experts = {n: m for n, m in methods.items() if ".mixer.experts" in n}
    assert {n.split(".mixer")[0] for n in experts} == {"model.layers.1", "model.layers.3"}, experts
    assert all(m == "Exl3MoEMethod" for m in experts.values()), experts
