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
        ``load_s``; with a reference that records its routers, :func:`router_decided`'s fields.
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
    scores = {**e2e.logit_agreement(ref, lp, job.get("tie", 0.0)), **router_decided(ref, lp)}
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


#: one position's KL may reach this many times a run's mean bound (the Nemotron VL packs' worst single positions,
#: 2026-12-04: 0.93x and 0.54x the 3e-3 bound); a row of the wrong expert lies at tenths of a nat to nats
TIE_ROW_FACTOR = 10


def router_decided(ref: dict, lp: torch.Tensor) -> dict:
    """Where the reference records its router near-ties (``router_margin`` ``(layers, T)``, ``router_noise``
    ``(layers,)``, ``router_swaps``: ``nemotron_vl_pack.router_near_ties``), vLLM's prompt logprobs ``lp``
    ``(positions, vocab)`` (row i: after token i) against it: ``kl_router_decided``, the mean KL over the positions
    that are no router near-tie at any layer; ``router_ties``, the others (a token there may take another expert in
    a forward that rounds as bfloat16 does); ``kl_router_tie_max``, over those, the largest KL of vLLM's row to the
    nearest of the reference's row and its rows with the token routed to the other expert (0.0 with none). An empty
    dict for a reference without routers."""
    from quantpack_core.compare import agreement

    if "router_margin" not in ref:
        return {}
    n = lp.shape[0]
    tie = (ref["router_margin"][:, :n] < ref["router_noise"][:, None]).any(0)
    ties = tie.nonzero().flatten().tolist()
    ref_rows = ref["logits"][0, :n]
    nearest = [
        min(agreement(row[None], lp[t][None]).kl for row in (ref_rows[t], *ref["router_swaps"][t])) for t in ties
    ]
    return {
        "kl_router_decided": agreement(ref_rows[~tie], lp[~tie]).kl,
        "router_ties": ties,
        "kl_router_tie_max": max(nearest, default=0.0),
    }


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
    name: str, key: str, res: dict, ref: dict, kl_bound: float, top1_bound: float = 0.0, tie: float | None = None
) -> list[str]:
    """The checks every ``vl`` job shares, its figures printed (``name``: the model, for the lines): the text
    prompt's KL (outside the router near-ties where the result has :func:`router_decided`'s fields; each of those
    within :data:`TIE_ROW_FACTOR` times the bound of the reference's row with either expert) and top-1 over
    the positions not within ``tie`` nats of a tie (the job's own ``tie``) within the bounds, the image prompt
    expanded as the reference's, the greedy tokens the reference's or parting at a tie within ``tie``
    (:func:`reference_agreement`; default ``e2e_runner.NEAR_TIE``). Returns the failures; a job with no result is
    one."""
    from e2e_runner import NEAR_TIE

    tie = NEAR_TIE if tie is None else tie
    if "kl" not in res:
        return [f"{key}: {res.get('failed', 'no result')}"]
    worst = f" (worst position {res['kl_worst']}: {res['kl_max']:.2e})" if "kl_max" in res else ""
    kl, where = res["kl"], ""
    failures = []
    if "kl_router_decided" in res:  # a reference with routers: the bound holds outside the router near-ties
        kl, where = res["kl_router_decided"], f" outside the router near-ties at {res['router_ties']}"
        worst += f", {kl:.2e}{where}, at most {res['kl_router_tie_max']:.2e} at one of them"
        if not res["kl_router_tie_max"] <= TIE_ROW_FACTOR * kl_bound:
            failures.append(
                f"{key}: at a router near-tie vLLM's row is {res['kl_router_tie_max']:.3g} nats from the reference's "
                f"with either expert (bound {TIE_ROW_FACTOR} x {kl_bound})"
            )
    print(
        f"GPU {name} {key}: text KL {res['kl']:.2e}{worst}, top-1 {res['top1_decided']:.3f} over the "
        f"{res['positions'] - res['ties']} positions not within {tie:.3g} nats of a tie; load {res['load_s']:.0f} s"
    )
    if not (kl <= kl_bound and res["top1_decided"] >= top1_bound):
        failures.append(f"{key}: text prompt KL {kl:.3g}{where} (bound {kl_bound}), top-1 {res['top1_decided']:.3f}")
    if res["prompt_ids"] != ref["image_ids"]:
        failures.append(f"{key}: vLLM's image prompt {res['prompt_ids']} != the reference's {ref['image_ids']}")
    try:
        print(f"GPU {name} {key} image greedy vs reference: {reference_agreement(ref, res['greedy'], tie)}")
    except AssertionError as e:
        failures.append(f"{key}: {e}")
    return failures


def graphs_vs_eager(name: str, jobs: dict, results: dict, tie: float | None = None) -> None:
    """For every ``.../graphs`` job whose ``.../eager`` twin ran: compile + CUDA graphs give eager's greedy tokens on
    the image prompt, or part only at an eager near-tie within ``tie`` nats (``e2e_runner.greedy_agreement``, which
    raises otherwise; default ``e2e_runner.NEAR_TIE``); each pair's line printed. Skips the test where no pair was
    selected."""
    import pytest
    from e2e_runner import NEAR_TIE, get, greedy_agreement

    pairs = [k for k in jobs if k.endswith("/graphs") and k.replace("/graphs", "/eager") in jobs]
    if not pairs:
        pytest.skip("eager and graphs of one pack not both selected")
    for key in pairs:
        eager, graphs = get(results, key.replace("/graphs", "/eager")), get(results, key)
        agreement = greedy_agreement(eager, graphs, NEAR_TIE if tie is None else tie)
        print(f"GPU {name} {key} image greedy vs eager: {agreement}")


if __name__ == "__main__":  # the runner script: vllm_e2e.py with the "vl" kind
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
    import vllm_e2e  # sets the runner's environment (in-process engine) before vLLM is imported

    vllm_e2e.RUNNERS["vl"] = run_vl
    vllm_e2e.main(sys.argv[1], sys.argv[2])
