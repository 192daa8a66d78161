"""The ``vl`` job kind of the GPU end-to-end runner (``tests/vllm_e2e.py``) for vision-language packs, and the check
of greedy tokens against a reference's: one engine per job serves a text-only prompt (its prompt logprobs against
the reference's logits) and an image + text request (its greedy tokens). This file is the runner script of such
jobs (``e2e_runner.RUNNER`` set to it): run as a script it registers the kind and runs ``vllm_e2e.main``. Used by
``test_qwen_vl_gpu.py`` and ``test_nemotron_vl_gpu.py``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

#: the logger of the family's layout line (quantpack_families.families.qwen_vision)
FAMILY_LOGGER = "vllm.quantpack.families"
#: what the family logs when it serves a block from the EXL3 parts and drops the dense fused copy
DROPPED = "dense fused attn.qkv"


class _Lines(logging.Handler):
    """Keeps the messages of the records it is handed."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run_vl(job: dict) -> dict:
    """The ``vl`` job of the runner: one engine for the pack, then the text-only prompt's logprobs and the image +
    text prompt's greedy tokens.

    Job keys: ``pack``, ``dtype``, ``eager``, ``llm_kwargs`` (as every runner job); ``reference`` (a ``.pt`` of
    ``qwen_vl_pack.reference``), ``image`` (a PNG), ``prompt`` (the image + text prompt), ``tokens`` (greedy
    tokens), ``tie`` (nats, for the text prompt's top-1 count).

    Returns:
        ``kl``, ``top1``, ``positions``, ``ties``, ``top1_decided`` of the text prompt against the reference
        (``quantpack_core.compare.agreement``); ``prompt_ids`` (the image prompt as vLLM expanded it), ``greedy``
        and ``greedy_top2`` (per step ``{str(id): logprob}``: the layout of the runner's ``logits`` jobs);
        ``quant_methods`` of the modules whose names start with the job's ``methods_prefix`` (default
        ``"visual."``, Qwen's tower); ``family_log`` (the family's log lines while the engine was built that contain
        the job's ``log_match``, default :data:`DROPPED`, from the job's ``logger``, default :data:`FAMILY_LOGGER`);
        ``load_s``; with a reference that records its routers, ``router_tie_rows`` (:func:`router_tie_rows`).
    """
    import time

    import vllm_e2e as e2e
    from PIL import Image
    from vllm import SamplingParams

    ref = torch.load(job["reference"])
    vocab = ref["logits"].shape[-1]
    lines = _Lines()
    logger = logging.getLogger(job.get("logger", FAMILY_LOGGER))
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)  # the layout line is INFO, whatever VLLM_LOGGING_LEVEL says
    t0 = time.time()
    try:
        llm = e2e.make_llm(job, job["dtype"], job["eager"], vocab)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    load_s = time.time() - t0
    methods = llm.apply_model(e2e.quant_methods)[0]
    lp = e2e.prompt_logprob_matrix(llm, ref["input_ids"][0].tolist(), vocab)
    scores = {**e2e.logit_agreement(ref, lp, job.get("tie", 0.0)), **router_tie_rows(ref, lp)}
    image = Image.open(job["image"]).convert("RGB")
    params = SamplingParams(max_tokens=job["tokens"], temperature=0, ignore_eos=True, logprobs=2)
    out = llm.generate([{"prompt": job["prompt"], "multi_modal_data": {"image": image}}], params, use_tqdm=False)[0]
    seq = out.outputs[0]
    top2 = [
        {str(tok): v.logprob for tok, v in step.items() if v.rank is not None and v.rank <= 2} for step in seq.logprobs
    ]
    e2e.release(llm)
    return {
        **scores,
        "prompt_ids": list(out.prompt_token_ids),
        "greedy": list(seq.token_ids),
        "greedy_top2": top2,
        "quant_methods": {k: v for k, v in methods.items() if k.startswith(job.get("methods_prefix", "visual."))},
        "family_log": [line for line in lines.lines if job.get("log_match", DROPPED) in line],
        "load_s": load_s,
    }


def router_tie_rows(ref: dict, lp: torch.Tensor) -> dict:
    """Where the reference records its routers (``router_margin`` ``(layers, T)``, ``router_swaps``:
    ``nemotron_vl_pack.router_near_ties``), ``router_tie_rows``: for each router near-tie (a token whose margin at
    some layer is below ``quantpack_core.compare.ROUTER_NEAR_TIE``) among vLLM's prompt logprob rows ``lp``
    ``(positions, vocab)`` (row i: after token i), the KL of vLLM's row to the nearest of the reference's row and its
    rows with the token routed to the other expert, by token (a string, as JSON keys go). An empty dict for a
    reference without routers."""
    from quantpack_core.compare import ROUTER_NEAR_TIE, agreement

    if "router_margin" not in ref:
        return {}
    n = lp.shape[0]
    ties = (ref["router_margin"][:, :n] < ROUTER_NEAR_TIE).any(0).nonzero().flatten().tolist()
    rows = ref["logits"][0, :n]
    nearest = {
        str(t): min(agreement(row[None], lp[t][None]).kl for row in (rows[t], *ref["router_swaps"][t])) for t in ties
    }
    return {"router_tie_rows": nearest}


def reference_agreement(ref: dict, got: list[int], tie: float) -> str:
    """Check vLLM's greedy tokens ``got`` against the reference's (``ref["greedy"]``, ``ref["greedy_top2"]``);
    returns a description. They must be identical, or part first at a step where vLLM took the reference's
    runner-up and the reference's top-2 lie within ``tie`` nats (a float16 rounding can flip such a step and
    nothing after it is comparable).

    Raises:
        AssertionError: they part elsewhere.
    """
    want = ref["greedy"]
    if got == want:
        return f"identical ({len(want)} tokens)"
    i = next((i for i, (x, y) in enumerate(zip(want, got, strict=False)) if x != y), min(len(want), len(got)))
    assert i < min(len(want), len(got)), f"{len(got)} tokens for the reference's {len(want)}: {got} vs {want}"
    top2 = {int(k): v for k, v in ref["greedy_top2"][i].items()}
    gap = max(top2.values()) - min(top2.values())
    assert got[i] in top2 and gap <= tie, (
        f"greedy tokens part from the reference at step {i} ({got[i]} for {want[i]}; the reference's top-2 "
        f"{top2}, {gap:.3g} nats apart): {got} vs {want}"
    )
    return f"identical up to step {i} of {len(want)}, where the reference's top-2 tie within {gap:.2g} nats"


def vl_failures(
    name: str, key: str, res: dict, ref: dict, rec, kl_bound, top1_bound, tie: float, tie_row=None
) -> list[str]:
    """The checks every ``vl`` job shares, into its record ``rec`` (a ``gpu_records.JobRecord``, written here) and
    its figures printed (``name``: the model, for the lines): the text prompt's KL within ``kl_bound`` - where the
    reference records its routers, outside the router near-ties that departed (``quantpack_core.compare
    .outside_router_ties``), each of those within ``tie_row`` of the reference's row with either expert
    (:func:`router_tie_rows`) -; top-1 over the positions not within ``tie`` nats of a tie (the job's own ``tie``)
    within ``top1_bound``; the image prompt expanded as the reference's; the greedy tokens the reference's or parting
    at a tie within ``tie`` (:func:`reference_agreement`). Bounds: ``e2e_bounds.Bound``. Returns the failures; a
    job with no result is one."""
    if "kl" not in res:
        return rec.write().failures()
    if "router_tie_rows" in res:  # a reference with routers: the bound holds outside the router near-ties
        from quantpack_core.compare import outside_router_ties

        kl = torch.tensor(res["kl_positions"], dtype=torch.float64)
        split = outside_router_ties(kl, ref["router_margin"], kl_bound.limit)
        rec.outside_router_ties(split)
        rec.check("kl_outside_router_ties", split.kl, kl_bound)
        for e in split.excluded:
            rec.check(f"router_tie_row[{e['position']}]", res["router_tie_rows"][str(e["position"])], tie_row)
    else:
        rec.check("kl", res["kl"], kl_bound)
    rec.check("top1_decided", res["top1_decided"], top1_bound)
    rec.figures["load_s"] = res["load_s"]
    if res["prompt_ids"] != ref["image_ids"]:
        rec.error = f"vLLM's image prompt {res['prompt_ids']} != the reference's {ref['image_ids']}"
    try:
        rec.figures["image_greedy_vs_reference"] = reference_agreement(ref, res["greedy"], tie)
    except AssertionError as e:
        rec.error = f"{rec.error or ''} {e}".strip()
    print(
        f"GPU {name} {key}: text KL {res['kl']:.2e} (worst position {res['kl_worst']}: {res['kl_max']:.2e}; outside "
        f"the departed router near-ties {rec.figures.get('kl_outside_router_ties', res['kl']):.2e}, left out "
        f"{rec.excluded}), top-1 {res['top1_decided']:.3f} over the {res['positions'] - res['ties']} positions not "
        f"within {tie:.3g} nats of a tie; image greedy vs reference: {rec.figures.get('image_greedy_vs_reference')}; "
        f"load {res['load_s']:.0f} s"
    )
    return rec.write().failures()


def graphs_vs_eager(name: str, jobs: dict, results: dict, tie: float | None = None) -> None:
    """For every ``.../graphs`` job whose ``.../eager`` twin ran: compile + CUDA graphs give eager's greedy tokens on
    the image prompt, or part only at an eager near-tie within ``tie`` nats (``e2e_runner.greedy_agreement``, which
    raises otherwise; default ``e2e_runner.GREEDY_TIE``); each pair's line printed. Skips the test where no pair was
    selected."""
    import pytest
    from e2e_runner import GREEDY_TIE, get, greedy_agreement

    pairs = [k for k in jobs if k.endswith("/graphs") and k.replace("/graphs", "/eager") in jobs]
    if not pairs:
        pytest.skip("eager and graphs of one pack not both selected")
    for key in pairs:
        eager, graphs = get(results, key.replace("/graphs", "/eager")), get(results, key)
        agreement = greedy_agreement(eager, graphs, GREEDY_TIE if tie is None else tie)
        print(f"GPU {name} {key} image greedy vs eager: {agreement}")


if __name__ == "__main__":  # the runner script: vllm_e2e.py with the "vl" kind
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
    import vllm_e2e  # sets the runner's environment (in-process engine) before vLLM is imported

    vllm_e2e.RUNNERS["vl"] = run_vl
    vllm_e2e.main(sys.argv[1], sys.argv[2])
