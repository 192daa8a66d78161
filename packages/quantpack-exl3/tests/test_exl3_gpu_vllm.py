"""GPU tier, end to end: vLLM's CUDA build serves the bundled packs through the plugin (entry point, as any user's
process) with the kernels it chooses: trellis_mma for linear shards of float16 / bfloat16 models (exllamav3's
kernels for the row buckets of each layer where the load-time measurement found them faster) and for expert banks;
with ci/gpu/jobs.toml's e2e-*-tc / -dense jobs, the kernels those force. Prompt logprobs against exllamav3's reference
logits (for the Qwen3.5 pack, against the core codec's dequantized weights in transformers), and the same greedy
tokens eager and with torch.compile + CUDA graphs. vLLM 0.25.1 does not register the Qwen3.5 text architecture;
quantpack-families does.
"""

import os
from pathlib import Path

import e2e_bounds as bounds
import pytest
import torch
from e2e_jobs import DRAFT, LLAMA_PACKS, MAIN_PACK, MOE_PACKS, check_draft_vocab, get, run_runner
from e2e_runner import greedy_agreement, recorded, router_split, routing_differences, selected

from quantpack_core.compare import ROUTER_NEAR_TIE

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

#: vLLM 0.25.1 prefers FlashInfer's Gated DeltaNet prefill on Hopper; the slim bundle has no FlashInfer
QWEN_LLM_KWARGS = {**LLM_KWARGS, "additional_config": {"gdn_prefill_backend": "triton"}}
#: job-name substrings to run (every job when empty), e.g. QUANTPACK_GPU_JOBS=moe/ for the MoE packs alone; the
#: tests of the other jobs skip
ONLY = [s for s in os.environ.get("QUANTPACK_GPU_JOBS", "").split(",") if s]


def result(results: dict, key: str) -> dict:
    """The job's result; skips a job left out by ``QUANTPACK_GPU_JOBS`` or whose model this vLLM lacks."""
    skip_unless_served(results, key)
    return get(results, key)


def measured(results: dict, key: str, gpu_record) -> tuple[dict, object]:
    """The job's result and its record (``e2e_runner.recorded``), skipped as :func:`result` skips."""
    skip_unless_served(results, key)
    return recorded(gpu_record, results, key)


def skip_unless_served(results: dict, key: str) -> None:
    """Skip a job left out by ``QUANTPACK_GPU_JOBS`` or whose model this vLLM lacks."""
    for pack, why in results.get("_unsupported", {}).items():
        if key.startswith(pack):
            pytest.skip(why)
    if not selected(key):
        pytest.skip(f"{key} not selected by QUANTPACK_GPU_JOBS={','.join(ONLY)}")


def qwen_reference(fixtures_dir: Path, out: Path) -> Path:
    """Reference logits for the Qwen3.5 pack: the core codec's dequantized weights in transformers (fp32, GPU), on
    the llama fixture's 128 reference token ids (same tokenizer)."""
    from quantpack_core.reference import dense_transformers_model

    model = dense_transformers_model(
        fixtures_dir / QWEN_PACK, "Qwen3_5ForCausalLM", rename=("model.language_model.", "model.")
    )
    ids = torch.load(fixtures_dir / LLAMA_PACKS[0] / "reference_logits.pt")["input_ids"]
    with torch.no_grad():
        logits = model.cuda()(ids.cuda()).logits.float().cpu()
    torch.save({"input_ids": ids, "logits": logits}, out)
    return out


@pytest.fixture(scope="module")
def gpu_e2e(fixtures_dir, tmp_path_factory):
    from e2e_runner import unsupported_architecture

    tmp = tmp_path_factory.mktemp("gpu_e2e")
    unsupported = {QWEN_PACK: unsupported_architecture(fixtures_dir / QWEN_PACK)}
    unsupported = {k: v for k, v in unsupported.items() if v}
    if QWEN_PACK in unsupported:
        unsupported["qwen-int8"] = unsupported[QWEN_PACK]
    qwen = (selected(f"{QWEN_PACK}/") or selected("qwen-int8")) and QWEN_PACK not in unsupported
    qref = qwen_reference(fixtures_dir, tmp / "qwen_reference.pt") if qwen else None
    jobs = {}
    for name in [*LLAMA_PACKS, QWEN_PACK] if qwen else LLAMA_PACKS:
        base = {"kind": "logits", "pack": str(fixtures_dir / name), "llm_kwargs": LLM_KWARGS}
        if name == QWEN_PACK:
            base.update(reference=str(qref), llm_kwargs=QWEN_LLM_KWARGS)
        jobs[f"{name}/float16/eager"] = dict(base, dtype="float16", eager=True)
        jobs[f"{name}/float16/graphs"] = dict(base, dtype="float16", eager=False)
        jobs[f"{name}/bfloat16/eager"] = dict(base, dtype="bfloat16", eager=True)
    # vLLM's qwen3_5 builds embed_tokens / lm_head without a quant config: the int8 rows must still reach them
    from quantpack_core.embedding import convert_embedding_int8

    if qwen:
        int8 = convert_embedding_int8(fixtures_dir / QWEN_PACK, tmp / "qwen-int8").out_dir
        jobs["qwen-int8"] = {
            "kind": "logits",
            "pack": str(int8),
            "reference": str(qref),
            "llm_kwargs": QWEN_LLM_KWARGS,
            "dtype": "float16",
            "eager": True,
        }
    # speculative decoding: the EAGLE draft (no embedding / lm_head of its own) takes the target's, the head an EXL3
    # one served by the CUDA kernels; four 32-token slices of the reference prompt, 32 greedy tokens each
    ids = torch.load(fixtures_dir / MAIN_PACK / "reference_logits.pt")["input_ids"][0].tolist()
    jobs["spec"] = {
        "kind": "spec",
        "pack": str(fixtures_dir / MAIN_PACK),
        "draft": str(fixtures_dir / DRAFT),
        "llm_kwargs": LLM_KWARGS,
        "dtype": "float16",
        "prompts": [ids[i : i + 32] for i in range(0, 128, 32)],
        "tokens": 32,
    }
    # EXL3 expert banks: eager with the routers' picks recorded, and compile + CUDA graphs
    for name in MOE_PACKS:
        base = {"kind": "logits", "pack": str(fixtures_dir / name), "llm_kwargs": LLM_KWARGS, "dtype": "float16"}
        jobs[f"moe/{name}/eager"] = dict(base, eager=True, routing=True, save=str(tmp / f"{name}-eager.lp.pt"))
        jobs[f"moe/{name}/graphs"] = dict(base, eager=False, save=str(tmp / f"{name}-graphs.lp.pt"))
    # the MoE engines in a runner process of their own: after the dense packs' compiled engines, one process could no
    # longer fit two of them in GPU memory (17 of 19 passed in full runs on 2026-12-01 and 2026-12-02; alone, all did)
    results = {"_unsupported": unsupported}
    for part, keep in (("dense", lambda k: not k.startswith("moe/")), ("moe", lambda k: k.startswith("moe/"))):
        part_jobs = {k: v for k, v in jobs.items() if selected(k) and keep(k)}
        if part_jobs:
            (tmp / part).mkdir()
            got = run_runner(part_jobs, tmp / part, timeout=1800)
            results["_log"] = results.get("_log", "") + got.pop("_log")
            results.update(got)
    return results


def vocab_module(res: dict, suffix: str) -> dict:
    """The embedding (``embed_tokens``) or head (``lm_head``) entry of a job's ``vocab_modules``."""
    found = [v for k, v in res["vocab_modules"].items() if k.endswith(suffix)]
    assert len(found) == 1, res["vocab_modules"]
    return found[0]


#: the bounds per dtype (tests/e2e_bounds.py: measured worst beside each)
KL = {"float16": bounds.F16_KL, "bfloat16": bounds.BF16_KL}
TOP1 = {"float16": bounds.F16_TOP1, "bfloat16": bounds.BF16_TOP1}


@pytest.mark.parametrize("name", [*LLAMA_PACKS, QWEN_PACK])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_prompt_logprobs_match_reference(gpu_e2e, figures, gpu_record, name, dtype):
    res, rec = measured(gpu_e2e, f"{name}/{dtype}/eager", gpu_record)
    rss = res["rss_mib"]
    figures.append(
        f"GPU {name} {dtype} eager: KL {res['kl']:.3g}, top-1 {100 * res['top1']:.2f}%, load {res['load_s']:.1f} s, "
        f"host RSS {rss[0]:.0f} -> {rss[1]:.0f} MiB"
    )
    rec.figures.update(load_s=res["load_s"], rss_mib=rss)
    rec.check("kl", res["kl"], KL[dtype])
    rec.check("top1", res["top1"], TOP1[dtype])
    rec.assert_passed()
    assert vocab_module(res, "lm_head")["method"] == "Exl3LinearMethod"


@pytest.mark.parametrize("name", [*LLAMA_PACKS, QWEN_PACK])
def test_graphs_match_eager(gpu_e2e, figures, gpu_record, name):
    eager = result(gpu_e2e, f"{name}/float16/eager")
    graphs, rec = measured(gpu_e2e, f"{name}/float16/graphs", gpu_record)
    figures.append(f"GPU {name} float16 compile+graphs: KL {graphs['kl']:.3g}, load {graphs['load_s']:.1f} s")
    rec.figures["load_s"] = graphs["load_s"]
    rec.check("kl", graphs["kl"], bounds.F16_KL)
    rec.check("top1", graphs["top1"], bounds.F16_TOP1)
    greedy_check(rec, eager, graphs)
    figures.append(f"GPU {name} greedy, compile+graphs vs eager: {rec.figures.get('greedy_vs_eager')}")
    rec.assert_passed()


def greedy_check(rec, eager: dict, other: dict, **tie) -> None:
    """``e2e_runner.greedy_agreement`` of two runs into the record: its description as a figure, or its failure as
    the record's error."""
    try:
        rec.figures["greedy_vs_eager"] = greedy_agreement(eager, other, **tie)
    except AssertionError as e:
        rec.error = f"greedy tokens: {e}"


def test_qwen3_5_int8_embedding_on_cuda(gpu_e2e, figures, gpu_record):
    """Qwen3.5's vLLM model builds its embedding without a quant config; the int8 rows must be what it serves (a
    table silently left dense, or never loaded, fails here) and cost almost nothing against the reference."""
    res, rec = measured(gpu_e2e, "qwen-int8", gpu_record)
    dense = result(gpu_e2e, f"{QWEN_PACK}/float16/eager")
    emb = vocab_module(res, "embed_tokens")
    figures.append(f"GPU {QWEN_PACK} int8 embedding float16: KL {res['kl']:.3g} (bf16 table: {dense['kl']:.3g}), {emb}")
    rec.check("kl", res["kl"], bounds.INT8_KL)
    rec.check("top1", res["top1"], bounds.F16_TOP1)
    rec.assert_passed()
    assert emb["method"] == "Int8RowsEmbeddingMethod"
    assert emb["params"].get("qweight") == "int8" and emb["params"].get("weight") is None
    assert vocab_module(res, "lm_head")["method"] == "Exl3LinearMethod"


def test_eagle_draft_shares_the_exl3_target_s_vocabulary_on_cuda(gpu_e2e, figures):
    """An EAGLE draft without embed_tokens / lm_head served beside the 4.0 bpw llama pack (float16, eager): the
    draft's embedding and head are the target's own modules (the head an EXL3 one), draft tokens are accepted, and
    each prompt's greedy tokens with the draft are those without it - or part first where the run without it had its
    top-2 within the float16 near tie (``e2e_runner.greedy_agreement``: the verify step runs several rows per
    sequence through the kernels, which may round otherwise than one row)."""
    res = result(gpu_e2e, "spec")
    check_draft_vocab(res)
    parts = [
        greedy_agreement({"greedy": plain, "greedy_top2": top2}, {"greedy": spec})
        for plain, top2, spec in zip(res["plain"], res["plain_top2"], res["spec"], strict=True)
    ]
    figures.append(
        f"GPU EAGLE draft, {MAIN_PACK} float16: {res['accepted']:.0f} of {res['drafted']:.0f} draft tokens accepted; "
        f"greedy with the draft vs without, per prompt: {'; '.join(parts)}"
    )


@pytest.mark.parametrize("job", [*(f"{n}/float16/eager" for n in LLAMA_PACKS), *(f"moe/{n}/eager" for n in MOE_PACKS)])
def test_forced_settings_reach_the_kernels(gpu_e2e, job):
    """Where this process forces trellis_mma's settings (the e2e-*-tc / -dense jobs), the engine read the same ones,
    and gave every linear row bucket above 16 rows the forced kernel and, with ``delegate_rows`` 0, every bucket the
    project's own kernels (the prompt's 128-row calls run in such a bucket): otherwise those jobs would pass on the
    kernels the default jobs already cover. The MoE banks' path depends on a call's token count alone
    (ci/gpu/jobs.toml's comment on these jobs)."""
    from gpu_records import FORCED_SETTINGS, forced_values

    from quantpack_core.trellis_mma.ops import FUSED_ROWS
    from quantpack_core.trellis_mma.selection import KERNEL_NAMES
    from quantpack_core.trellis_mma.settings import Settings

    if not forced_values():
        pytest.skip("no trellis_mma setting forced (the e2e-*-tc / -dense jobs of ci/gpu/jobs.toml force them)")
    read = Settings.from_env()
    got = result(gpu_e2e, job)["trellis_buckets"]
    wanted = {name: getattr(read, name) for name in FORCED_SETTINGS}
    assert got["settings"] == wanted, "the engine did not read the settings this job forces"
    buckets = {int(rows): names for rows, names in got["buckets"].items()}
    wide = {rows: names for rows, names in buckets.items() if rows > FUSED_ROWS}
    if read.wide_kernel is not None:
        assert wide, f"no row bucket above {FUSED_ROWS} rows was reached: {got}"
        off = {rows: n for rows, n in wide.items() if not all(k.startswith(read.wide_kernel) for k in n)}
        assert not off, f"buckets not served by the forced {read.wide_kernel!r} kernel: {off}"
    if read.delegate_rows == 0:
        own = set(KERNEL_NAMES.values())
        delegated = {rows: n for rows, n in buckets.items() if not own.issuperset(n)}
        assert not delegated, f"buckets delegated with delegate_rows 0: {delegated}"


@pytest.mark.parametrize("name", MOE_PACKS)
def test_moe_packs_on_cuda(gpu_e2e, figures, fixtures_dir, gpu_record, name):
    """Qwen3-MoE packs (uniform K; four (K gate/up, K down) groups) through the expert kernels, eager and with compile
    + CUDA graphs, against the pack's reference logits; greedy tokens of both runs; the experts each router picked
    on the prompt (eager) against the exact reference (core codec + transformers, float32).

    Where a token's k-th and (k+1)-th router scores nearly tie (``quantpack_core.compare.ROUTER_NEAR_TIE``), any
    float16 forward may pick either expert (the compiled one rounds the fused norms differently), which moves that
    token's logits by up to ~0.6 nats (measured: the mixed-K pack, layer 1, token 46, margin 6.7e-5, compiled). So:
    every routing difference must be at a near-tie, a position leaves the KL mean only at a near-tie that departed
    (``compare.outside_router_ties``: each recorded with its margin), and the mean over the rest is bounded."""
    pack = fixtures_dir / name
    eager, rec_eager = measured(gpu_e2e, f"moe/{name}/eager", gpu_record)
    graphs, rec_graphs = measured(gpu_e2e, f"moe/{name}/graphs", gpu_record)
    differ = routing_differences(pack, eager)
    for res, rec in ((eager, rec_eager), (graphs, rec_graphs)):
        split = router_split(pack, res, bounds.QWEN3MOE_KL.limit)
        rec.outside_router_ties(split)
        rec.check("kl_outside_router_ties", split.kl, bounds.QWEN3MOE_KL)
        # the 3.0 bpw pack's reference is exllamav3's float16 forward, whose router takes another pair at one
        # near-tie token (see test_exl3_moe_e2e.py); that moves two argmaxes of 127
        rec.check("top1", res["top1"], bounds.QWEN3MOE_TOP1)
    rec_eager.figures["routing_differences"] = [list(d) for d in differ]
    far = [d for d in differ if not d[2] < ROUTER_NEAR_TIE]
    if far:
        rec_eager.error = f"routing differs from the exact reference away from router near-ties: {far}"
    greedy_check(rec_graphs, eager, graphs)
    figures.append(
        f"GPU {name} float16: KL (all / outside the departed router near-ties) eager {eager['kl']:.3g} / "
        f"{rec_eager.figures['kl_outside_router_ties']:.3g} {rec_eager.excluded}, graphs {graphs['kl']:.3g} / "
        f"{rec_graphs.figures['kl_outside_router_ties']:.3g} {rec_graphs.excluded}; top-1 eager "
        f"{100 * eager['top1']:.2f}%; greedy graphs vs eager: {rec_graphs.figures.get('greedy_vs_eager')}; routing "
        f"differs from the exact reference at (layer, token, margin) {rec_eager.figures['routing_differences']}"
    )
    rec_eager.write()
    rec_graphs.write()
    assert rec_eager.passed and rec_graphs.passed, "\n".join(rec_eager.failures() + rec_graphs.failures())
