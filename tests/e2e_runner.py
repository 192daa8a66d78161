"""Running end-to-end vLLM jobs from tests: every package's e2e tests hand their jobs to one run of
``vllm_e2e.py`` (this folder) and read its results (the repository's conftest.py puts this folder on the path)."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_bounds import F16_KL

RUNNER = Path(__file__).with_name("vllm_e2e.py")


def selected(key: str) -> bool:
    """Whether ``QUANTPACK_GPU_JOBS`` (comma-separated substrings of job ids; unset or empty: every job) selects the
    job ``key``."""
    only = [s for s in os.environ.get("QUANTPACK_GPU_JOBS", "").split(",") if s]
    return not only or any(s in key for s in only)


def unsupported_architecture(pack: Path) -> str | None:
    """Why the installed vLLM cannot build ``pack``'s model: none of its config's ``architectures`` is known to vLLM
    or to the installed plugins (loaded first, as vLLM does); None when one is. For the GPU tier's vLLM matrix, where
    an older release may lack a model: its jobs skip with this reason instead of failing."""
    import vllm
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    archs = json.loads((Path(pack) / "config.json").read_text()).get("architectures") or []
    known = set(ModelRegistry.get_supported_archs())
    if archs and not any(a in known for a in archs):
        return f"vLLM {vllm.__version__} has no {' / '.join(archs)}"
    return None


def run_runner(jobs: dict[str, dict], tmp: Path, timeout: float, env: dict[str, str] | None = None) -> dict:
    """Hand ``{job id: job}`` to one run of vllm_e2e.py (``env``: variables set for that process, over this one's);
    returns ``{job id: result}`` plus ``_log`` (its stderr tail). Fails the calling test when the runner produced
    nothing. With ``QUANTPACK_E2E_ONLY`` set (comma-separated), only the jobs whose id contains one of its strings run
    (select the tests with ``-k``)."""
    # re-runs on a GPU: just the jobs whose id contains one of these comma-separated strings
    only = [s for s in os.environ.get("QUANTPACK_E2E_ONLY", "").split(",") if s]
    ids = [i for i in jobs if not only or any(s in i for s in only)]
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "jobs.json").write_text(json.dumps([jobs[i] for i in ids]))
    proc = subprocess.run(
        [sys.executable, str(RUNNER), str(tmp / "jobs.json"), str(tmp / "results.json")],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    if not (tmp / "results.json").exists():
        pytest.fail(f"the vLLM runner produced nothing (rc {proc.returncode}):\n{proc.stderr[-8000:]}")
    results = json.loads((tmp / "results.json").read_text())
    out = {i: r["result"] for i, r in zip(ids, results, strict=False)}
    out["_log"] = proc.stderr[-8000:]
    return out


def recorded(gpu_record, results: dict, key: str) -> tuple[dict, object]:
    """One job's result (:func:`get`'s checks) and its record (the ``gpu_record`` fixture's ``JobRecord``, written
    at once with the job's error where it did not run or raised)."""
    record = gpu_record(key, results.get(key))
    return get(results, key), record


def get(results: dict, key: str) -> dict:
    """One job's result; fails the test when the job did not run or raised."""
    res = results.get(key)
    if res is None:
        pytest.fail(f"job {key} did not run; runner log tail:\n{results['_log']}")
    if "failed" in res:
        pytest.fail(f"job {key} failed: {res['failed']}\n{res['traceback']}")
    return res


#: the reference top-2 gap (nats) within which a float16 family or VL job's top-1 is not counted (``top1_decided``):
#: the tiny models' logits are flat enough that some positions lie within the float16 noise their KL implies. Kept
#: with its distribution: Spark's packs measured 99.2-100% top-1 over the decided positions (96-97% over all for the
#: SiLU-gate pack) in four runs (0.25.1 on 2026-12-03 twice, 0.25.1 and 0.26.0 on 2026-12-05), the other families'
#: and the Qwen3.5 VL packs 100%
NEAR_TIE = 0.05


def near_tie(kl_bound: float) -> float:
    """The reference's top-2 gap (nats) within which a run admitted by a mean-KL bound may take the runner-up:
    ``2 * sqrt(kl_bound)``. Noise of mean KL ``k`` moves a token's log-probability by at least about ``sqrt(2 k)``
    RMS and the gap between two by ``sqrt(2)`` times that, one standard deviation (more where the distribution is
    peaked; test_compare.py measures it): float16's bound of 1.5e-4 gives 0.024, bfloat16's 3e-3 0.11 (bfloat16
    keeps 8 significant bits to float16's 11, so a top-2 pair a float16 run keeps in order can swap in bfloat16
    without anything being wrong)."""
    return 2.0 * kl_bound**0.5


#: greedy tokens of two float16 runs (eager and compile + CUDA graphs; with and without a draft) may part only where
#: the first run's two best tokens lie closer than this: :func:`near_tie` of the float16 KL bound (0.024 nats; it was
#: 0.05). Inductor fuses the norms and activations around our ops and rounds them once instead of per op, which can
#: flip an exact near-tie and nothing else. Measured: compile + graphs parted from eager once, at an exact tie of a
#: Llama pack's two best tokens (0.25.1, 2026-12-01); identical in every job on 0.25.1 (2026-12-04), 0.22.1 and
#: 0.26.0 (2026-12-05)
GREEDY_TIE = near_tie(F16_KL.limit)


def greedy_agreement(eager: dict, other: dict, tie: float = GREEDY_TIE) -> str:
    """Check two greedy runs of the same prompt; returns a description. They must be identical, or part first at a
    step where the eager run's top-2 tokens are the two chosen ones and lie within ``tie`` nats (:data:`GREEDY_TIE`,
    or :func:`near_tie` of another run's bound)."""
    a, b = eager["greedy"], other["greedy"]
    if a == b:
        return f"identical ({len(a)} tokens)"
    i = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    top2 = {int(k): v for k, v in eager["greedy_top2"][i].items()}
    assert a[i] in top2 and b[i] in top2, (i, a, b, top2)
    gap = abs(top2[a[i]] - top2[b[i]])
    assert gap <= tie, f"greedy tokens part at step {i} ({a[i]} vs {b[i]}) with a {gap:.3g}-nat gap: {a} vs {b}"
    return f"identical up to step {i} of {len(a)}, where the eager top-2 tie within {gap:.2g} nats"


@functools.cache
def exact_router(pack: Path) -> tuple[dict, dict]:
    """``(picks, margins)`` of the MoE pack's decoded weights in transformers (float32, CPU) on its reference ids:
    ``{layer: (T, top_k) experts}`` and ``{layer: (T,) router margins}`` (``quantpack_core.reference
    .router_record``), the reference forward of every router near-tie (``quantpack_core.compare.ROUTER_NEAR_TIE``)."""
    import torch

    from quantpack_core.reference import dense_transformers_model, router_record

    model = dense_transformers_model(Path(pack))
    return router_record(model, torch.load(Path(pack) / "reference_logits.pt")["input_ids"])


def router_split(pack: Path, res: dict, departs: float):
    """``quantpack_core.compare.outside_router_ties`` of a logits job ``res`` (its ``kl_positions``) over MoE pack
    ``pack``'s router margins (:func:`exact_router`); ``departs``: the job's mean KL bound."""
    import torch

    from quantpack_core.compare import outside_router_ties

    kl = torch.tensor(res["kl_positions"], dtype=torch.float64)
    return outside_router_ties(kl, router_margins(pack), departs)


def router_margins(pack: Path):
    """``(MoE layers, T)``: :func:`exact_router`'s margins, stacked in layer order."""
    import torch

    margins = exact_router(Path(pack))[1]
    return torch.stack([margins[layer] for layer in sorted(margins)])


def routing_differences(pack: Path, res: dict) -> list[tuple[int, int, float]]:
    """``(layer, token, router margin)`` wherever the experts a logits job's routers picked on the prompt
    (``res["routing"]``, the call over the whole prompt) differ from :func:`exact_router`'s."""
    import torch

    picks, margins = exact_router(Path(pack))
    differ = []
    for layer, calls in res["routing"].items():
        want = picks[int(layer)].sort(-1).values
        got = torch.tensor(next(c for c in calls if len(c) == want.shape[0])).sort(-1).values
        tokens = (got != want).any(-1).nonzero().flatten().tolist()
        differ += [(int(layer), t, float(margins[int(layer)][t])) for t in tokens]
    return differ
