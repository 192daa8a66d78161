"""Run end-to-end vLLM jobs described as JSON, in one process, and write their results as JSON.

vLLM takes ~13 s to import on a 2-core machine and ~3 s per model after that when its engine runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, uni-process executor), so the tests hand every job to one run of this script.
The plugin is picked up through its ``vllm.general_plugins`` entry point, as in any vLLM process.

Usage: ``python vllm_e2e.py JOBS.json RESULTS.json``. Each job is a dict with ``kind``:

* ``logits``: ``pack``, ``dtype``, ``eager``, optional ``reference`` (a ``.pt`` with ``input_ids`` and
  ``logits``; default the pack's ``reference_logits.pt``); full-vocabulary prompt logprobs of the reference input
  ids, compared with its logits (KL, top-1), plus 16 greedy tokens from the first 32 ids; with ``save``, the
  log-probability matrix is also written there (``torch.save``). Also reported: the quant method and parameter
  dtypes of every vocabulary module (embedding, lm_head) as vLLM built them, and the process's host RSS before
  building the engine and after loading, each position's KL (``kl_positions``) and the quantpack plugins this
  process imported (``plugins``: none where ``VLLM_PLUGINS`` leaves them out), and the trellis_mma kernels each row
  bucket was given so far in this process with the settings they read (``trellis_buckets``, without worker
  processes). With ``routing``, also the expert ids
  each MoE layer's router picked during the prompt pass (needs ``eager``).
* ``nll``: ``pack``, ``dtype``, ``tokens`` (list of token-id lists); mean next-token NLL from prompt logprobs.
* ``load_error``: ``pack``; building the engine must fail; the error type and message are returned.
* ``seeded``: ``pack``, ``dtype``, ``prompts`` (token-id lists), ``tokens``; sampled continuations (temperature 1)
  of every prompt with ``seed`` set, all at once (prompts longer than a step's budget are prefilled in chunks) and
  then each alone (one step each): ``batch`` and ``alone``, a list of token lists each.
* ``spec``: ``pack``, ``draft`` (a draft model folder), ``dtype``, ``prompts`` (token-id lists), ``tokens``; greedy
  continuations with speculative decoding (``method``, default ``"eagle"``, ``num_speculative_tokens``, default 3)
  and without (``plain_top2``: the run without the draft's two most likely tokens at each step, with their
  logprobs), the draft's acceptance counts, and the quant methods of the draft's vocabulary modules after vLLM
  shared them with the target.

Every job may add ``llm_kwargs`` (extra ``vllm.LLM`` arguments, e.g. the attention backend on a GPU; the JSON object
in ``QUANTPACK_GPU_LLM_KWARGS``, when set, goes over every job's, e.g. a fixed KV cache size where several engines
share one GPU, see :func:`make_llm`),
``register`` (architecture -> ``module:Class`` to register with vLLM first, when vLLM lacks that name), ``tp``
(tensor-parallel size: worker processes through vLLM's multiprocessing executor; the model is then not inspected
in this process, so ``vocab_modules`` and ``routing`` are left out) and ``env`` (environment variables set while the
job runs).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
import traceback

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def make_llm(job: dict, dtype: str, eager: bool, max_logprobs: int = 1024, **extra):
    """A ``vllm.LLM`` for ``job["pack"]`` (in-process engine, uni-process executor; with ``tp`` > 1, that many
    worker processes); ``extra``, the job's ``llm_kwargs`` and :func:`env_llm_kwargs` go to ``vllm.LLM`` too, in
    that order (a later one's key replaces an earlier one's whole)."""
    from vllm import LLM, ModelRegistry

    for arch, target in (job.get("register") or {}).items():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, target)
    kwargs = dict(
        model=job["pack"],
        dtype=dtype,
        enforce_eager=eager,
        max_model_len=512,
        max_logprobs=max_logprobs,
        distributed_executor_backend="uni",
        seed=0,
    )
    if job.get("tp", 1) > 1:
        kwargs.update(tensor_parallel_size=job["tp"], distributed_executor_backend="mp")
    kwargs.update(extra)
    kwargs.update(job.get("llm_kwargs") or {})
    kwargs.update(env_llm_kwargs())
    return LLM(**kwargs)


def env_llm_kwargs() -> dict:
    """The ``vllm.LLM`` arguments of ``QUANTPACK_GPU_LLM_KWARGS`` (a JSON object; none when unset or empty), which
    go over every job's: a diagnostic run's settings (``{"compilation_config": {"cudagraph_mode": "PIECEWISE"}}``),
    or ``{"kv_cache_memory_bytes": N}`` where engines share a GPU with other processes (ci/gpu/jobs.toml's
    ``tier`` group): with a fixed KV cache size vLLM skips its memory profiling, whose check fails when another
    process frees GPU memory while an engine loads (vLLM's ``gpu_worker.determine_available_memory``).

    Raises:
        ValueError: the variable holds no JSON object (its text named).
    """
    text = os.environ.get("QUANTPACK_GPU_LLM_KWARGS") or "{}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"QUANTPACK_GPU_LLM_KWARGS={text!r} is not JSON ({e}); give a JSON object") from e
    if not isinstance(value, dict):
        raise ValueError(f"QUANTPACK_GPU_LLM_KWARGS={text!r} is not a JSON object of vllm.LLM arguments")
    return value


@contextlib.contextmanager
def job_env(job: dict):
    """The job's ``env`` variables while it runs (e.g. vLLM's CPU thread binding for two CPU workers)."""
    saved = {k: os.environ.get(k) for k in job.get("env") or {}}
    os.environ.update(job.get("env") or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def release(llm) -> None:
    """Drop an in-process engine and what it holds (distributed state, device memory) before the next one.

    With worker processes (``tp`` > 1) the engine is shut down first (``EngineCore.shutdown``: the executor stops
    its workers): otherwise they live until the engine is garbage-collected, holding their GPU memory, and the next
    engine fails vLLM's free-memory check at start."""
    from vllm.distributed import cleanup_dist_env_and_memory

    if llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size > 1:
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    # torch's inductor keeps the example inputs of every pattern vLLM's compile passes register, one set per compiled
    # engine (torch._inductor.pattern_matcher._known_precompiled_patterns), so in one process of many engines they
    # pile up: on CPU 318 MB per compiled Qwen3-MoE-tiny engine, on an H200 < 13 GiB of 140 were left free after six
    # compiled engines. Dropped with the engine (a later engine registers its own again).
    import torch._inductor.pattern_matcher as pattern_matcher

    getattr(pattern_matcher, "_known_precompiled_patterns", []).clear()


def rss_mib() -> float:
    """This process's resident host memory in MiB (Linux ``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def vocab_modules(model) -> dict:
    """``{module name: {"class", "method", "params": {name: dtype}}}`` for every vocabulary-parallel module (the
    embedding, lm_head) of a built vLLM model."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, VocabParallelEmbedding):
            out[name] = {
                "class": type(m).__name__,
                "method": type(getattr(m, "quant_method", None)).__name__,
                "params": {n: str(p.dtype).removeprefix("torch.") for n, p in m.named_parameters(recurse=False)},
            }
    return out


def quant_methods(model) -> dict:
    """``{module name: quant method class}`` for every module of a built vLLM model that holds a ``quant_method``
    (linear layers, embeddings and heads, expert layers)."""
    return {
        name: type(m.quant_method).__name__ for name, m in model.named_modules() if getattr(m, "quant_method", None)
    }


def shard_kernels(model) -> dict:
    """``{kernel name: runs}`` over the runs of every quantpack linear layer of a built model (its ``quant_state``),
    i.e. which kernel served how many shards or fused shard groups."""
    counts: dict[str, int] = {}
    for _, m in model.named_modules():
        for run in getattr(getattr(m, "quant_state", None), "runs", None) or ():
            counts[run.kernel] = counts.get(run.kernel, 0) + 1
    return counts


def trellis_buckets() -> dict:
    """``{a row bucket's largest row count: the kernels serving it}`` over every trellis_mma run shape measured in
    this process so far (``selection_records``), and the settings the kernels read (``settings``): what a job forced
    onto one kernel must show it served with."""
    from gpu_records import FORCED_SETTINGS  # this folder's

    from quantpack_core.trellis_mma.ops import kernel_of
    from quantpack_core.trellis_mma.selection import selection_records
    from quantpack_core.trellis_mma.settings import current

    served: dict[int, set[str]] = {}
    for record in selection_records():
        for rows in record.rows:
            served.setdefault(rows, set()).add(record.name(kernel_of(record.bucket_kernels, rows)))
    settings = {name: getattr(current(), name) for name in FORCED_SETTINGS}
    return {"buckets": {str(r): sorted(names) for r, names in sorted(served.items())}, "settings": settings}


def install_routing_probe(model) -> int:
    """Wrap the router of every vLLM MoE layer (``MoERunner.router.select_experts``, vLLM 0.25+) so that the expert
    ids it picks are recorded, call by call; returns how many layers were wrapped."""
    record: dict[str, list] = {}
    for name, m in model.named_modules():
        router = getattr(m, "router", None)
        if router is None or not hasattr(m, "routed_experts") or not hasattr(router, "select_experts"):
            continue
        method = m.routed_experts.quant_method
        # where the method routes itself (Exl3MoEMethod on CPU with vLLM 0.29), its own route() picks the experts
        own = method.is_monolithic and hasattr(method, "route")
        owner, attr = (method, "route") if own else (router, "select_experts")
        select = getattr(owner, attr)

        def probe(*args, _select=select, _name=name, **kwargs):
            weights, ids = _select(*args, **kwargs)
            record.setdefault(_name, []).append(ids.detach().to("cpu", copy=True))
            return weights, ids

        setattr(owner, attr, probe)
        record[name] = []
    model._quantpack_routing = record
    return len(record)


def routing_record(model) -> dict:
    """``{layer index: [call -> (T, top_k) expert ids as lists]}`` of the probes of :func:`install_routing_probe`."""
    import re

    out = {}
    for name, calls in model._quantpack_routing.items():
        layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
        out[layer] = [c.tolist() for c in calls]
        calls.clear()
    return out


def prompt_logprob_matrix(llm, ids: list[int], vocab: int):
    """Full-vocabulary log-probabilities of positions 1..len-1 (row i predicts ids[i + 1])."""
    import torch
    from vllm import SamplingParams

    out = llm.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=vocab, temperature=0), use_tqdm=False
    )
    rows = out[0].prompt_logprobs[1:]
    lp = torch.full((len(rows), vocab), float("-inf"), dtype=torch.float64)
    for i, row in enumerate(rows):
        for tok, v in row.items():
            if tok < vocab:
                lp[i, tok] = v.logprob
    return lp


def greedy(llm, ids: list[int], n: int) -> tuple[list[int], list[dict[int, float]]]:
    """``n`` greedy tokens after ``ids``, and at each step the two most likely tokens with their logprobs."""
    from vllm import SamplingParams

    out = llm.generate(
        [{"prompt_token_ids": ids}],
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2),
        use_tqdm=False,
    )
    seq = out[0].outputs[0]
    return list(seq.token_ids), top2_steps(seq)


def top2_steps(seq) -> list[dict[int, float]]:
    """The two most likely tokens with their logprobs at each step of a vLLM ``CompletionOutput`` generated with
    ``logprobs=2`` (its ``logprobs`` also hold the sampled token where it ranked lower)."""
    return [{tok: v.logprob for tok, v in step.items() if v.rank is not None and v.rank <= 2} for step in seq.logprobs]


def logit_agreement(ref: dict, lp, tie: float) -> dict:
    """vLLM's prompt logprobs ``lp`` ``(positions, vocab)`` against the reference's ``logits`` ``(1, T, vocab)``
    (``quantpack_core.compare.agreement``, near-ties within ``tie`` nats set apart) as a result record:
    the fields of ``quantpack_core.compare.Agreement`` (``kl``, ``kl_median``, ``top1``, ``positions``, ``ties``,
    ``top1_decided``, ``kl_max`` and ``kl_worst``, the worst position) and ``kl_positions``, each position's KL
    (``compare.outside_router_ties`` takes them)."""
    from dataclasses import asdict

    from quantpack_core.compare import agreement, kl_per_position

    want = ref["logits"][0, : lp.shape[0]]
    return {**asdict(agreement(want, lp, tie=tie)), "kl_positions": kl_per_position(want, lp).tolist()}


def run_logits(job: dict) -> dict:
    import torch

    ref = torch.load(job.get("reference") or os.path.join(job["pack"], "reference_logits.pt"))
    ids = ref["input_ids"][0].tolist()
    vocab = ref["logits"].shape[-1]
    rss_before = rss_mib()
    t0 = time.time()
    llm = make_llm(job, job["dtype"], job["eager"], vocab)
    load_s = time.time() - t0
    rss_after = rss_mib()
    in_process = job.get("tp", 1) == 1  # the model is inspected in this process only without worker processes
    modules = llm.apply_model(vocab_modules)[0] if in_process else None
    methods = llm.apply_model(quant_methods)[0] if in_process else None
    kernels = llm.apply_model(shard_kernels)[0] if in_process else None
    if job.get("routing") and in_process:
        llm.apply_model(install_routing_probe)
    lp = prompt_logprob_matrix(llm, ids, vocab)
    routing = llm.apply_model(routing_record)[0] if job.get("routing") and in_process else None
    scores = logit_agreement(ref, lp, job.get("tie", 0.0))
    if job.get("save"):
        torch.save(lp, job["save"])
    tokens, top2 = greedy(llm, ids[:32], 16)
    release(llm)
    return {
        "plugins": plugin_modules(),
        **scores,
        "greedy": tokens,
        "greedy_top2": [{str(k): v for k, v in step.items()} for step in top2],
        "load_s": load_s,
        "vocab_modules": modules,
        "quant_methods": methods,
        "shard_kernels": kernels,
        "trellis_buckets": trellis_buckets() if in_process else None,
        "rss_mib": [rss_before, rss_after],
        "routing": routing,
        "save": job.get("save"),
    }


def plugin_modules() -> list[str]:
    """The quantpack plugins' packages this process imported (vLLM loads them through its ``vllm.general_plugins``
    entry points; none where ``VLLM_PLUGINS`` names none of them). quantpack-core, which this runner imports itself,
    is no plugin."""
    plugins = ("quantpack_exl3", "quantpack_escha", "quantpack_families")
    return sorted(name for name in sys.modules if name in plugins)


def run_nll(job: dict) -> dict:
    from vllm import SamplingParams

    llm = make_llm(job, job["dtype"], True, 1)
    prompts = [{"prompt_token_ids": ids} for ids in job["tokens"]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False)
    nll, count = 0.0, 0
    for ids, out in zip(job["tokens"], outs, strict=True):
        for tok, row in zip(ids[1:], out.prompt_logprobs[1:], strict=True):
            nll -= row[tok].logprob
            count += 1
    release(llm)
    return {"nll": nll / count, "tokens": count}


def counter(llm, name: str) -> float:
    """Sum of a vLLM counter metric (``LLM.get_metrics``) over its label sets; 0 when absent."""
    return float(sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name))


def run_spec(job: dict) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=job["tokens"], temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    llm = make_llm(job, job["dtype"], True)
    # the plain run's top-2 per step: where a 16-bit run with the draft parts from it, it must be at a near-tie
    plain_params = SamplingParams(max_tokens=job["tokens"], temperature=0, ignore_eos=True, logprobs=2)
    plain_out = [o.outputs[0] for o in llm.generate(prompts, plain_params, use_tqdm=False)]
    plain = [list(o.token_ids) for o in plain_out]
    plain_top2 = [[{str(t): v for t, v in step.items()} for step in top2_steps(o)] for o in plain_out]
    release(llm)
    # the engine must be gone before the next one is built: dropping it later would tear down the new engine's
    # distributed groups
    del llm
    gc.collect()
    spec = {
        "method": job.get("method", "eagle"),
        "model": job["draft"],
        "num_speculative_tokens": job.get("num_speculative_tokens", 3),
    }
    # vLLM's default max_logprobs (20); the acceptance counters need its stats on
    llm = make_llm(job, job["dtype"], True, 20, speculative_config=spec, disable_log_stats=False)

    outs = llm.generate(prompts, params, use_tqdm=False)
    with_spec = [list(o.outputs[0].token_ids) for o in outs]
    drafted = counter(llm, "vllm:spec_decode_num_draft_tokens")
    accepted = counter(llm, "vllm:spec_decode_num_accepted_tokens")
    draft_modules = llm.collective_rpc(_draft_vocab_modules)[0]
    release(llm)
    return {
        "plain": plain,
        "plain_top2": plain_top2,
        "spec": with_spec,
        "drafted": drafted,
        "accepted": accepted,
        "draft_vocab_modules": draft_modules,
    }


def _draft_vocab_modules(worker) -> dict:
    """On a worker: the vocabulary modules of the speculative-decoding draft model, with their ids, and whether each
    is the target's own module (shared after loading)."""
    runner = worker.model_runner
    # the draft's proposer: ``drafter`` on vLLM's first GPU model runner, ``speculator`` on its second (vllm/v1/worker/
    # gpu/model_runner.py, which vLLM 0.25 runs on CUDA)
    drafter = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)
    draft = getattr(drafter, "model", None)
    if draft is None:
        return {"error": f"no draft model on {type(runner).__name__}"}
    target_ids = {id(m) for m in runner.model.modules()}
    out = vocab_modules(draft)
    for name, m in draft.named_modules():
        if name in out:
            out[name]["shared_with_target"] = id(m) in target_ids
    return out


def run_load_error(job: dict) -> dict:
    try:
        llm = make_llm(job, "float32", True)
    except Exception as e:  # the point of the job
        return {"error_type": type(e).__name__, "message": str(e)}
    release(llm)
    return {"error_type": None, "message": ""}


def run_seeded(job: dict) -> dict:
    from vllm import SamplingParams

    llm = make_llm(job, job["dtype"], True, 1)
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    params = [SamplingParams(max_tokens=job["tokens"], temperature=1.0, seed=1000 + i) for i in range(len(prompts))]
    batch = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [
        list(llm.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids)
        for p, sp in zip(prompts, params, strict=True)
    ]
    release(llm)
    return {"batch": batch, "alone": alone}


RUNNERS = {"logits": run_logits, "nll": run_nll, "load_error": run_load_error, "spec": run_spec, "seeded": run_seeded}


def main(jobs_path: str, results_path: str) -> None:
    with open(jobs_path) as f:
        jobs = json.load(f)
    results = []
    for job in jobs:
        t0 = time.time()
        for attempt in range(2):
            try:
                with job_env(job):
                    res = RUNNERS[job["kind"]](job)
            except Exception as e:
                res = {"failed": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
                # vLLM's GPU memory profiling fails when another process on the same GPU frees memory meanwhile
                # (e.g. a parallel test run ending); that says nothing about the job, so it gets a second try
                if attempt == 0 and "Error in memory profiling" in str(e):
                    from vllm.distributed import cleanup_dist_env_and_memory

                    gc.collect()
                    cleanup_dist_env_and_memory()
                    continue
            break
        res["seconds"] = time.time() - t0
        results.append({"job": job, "result": res})
        gc.collect()
        with open(results_path, "w") as f:  # written after every job, so a crash keeps what finished
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
