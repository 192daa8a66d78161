"""GPU tier: ``vllm serve`` as users run it, its engine in a process of its own (vLLM's default:
``VLLM_ENABLE_V1_MULTIPROCESSING`` left unset; every other GPU test runs the engine in the test's runner process),
answering a completion request with prompt logprobs over the whole vocabulary for a dense pack, an MoE pack and the
Qwen3.5 pack (float16, eager). The logprobs are compared with each pack's reference as the in-process jobs of
``test_exl3_gpu_vllm.py`` compare theirs, within the same bounds (tests/e2e_bounds.py), and each server's record is
written (tests/gpu_records.py).

A server that does not answer ``/health`` within ``QUANTPACK_SERVE_START_S`` seconds (default 360), or a request
within 180 s, is a failure that leaves its own evidence: the server runs with ``PYTHONFAULTHANDLER=1`` (which its
engine process inherits), so a SIGABRT to its process group makes every process print each thread's Python stack
into the server's log, which the failure message carries whole. The suite never waits on a hung server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import e2e_bounds as bounds
import pytest
import torch
from e2e_runner import router_split
from http_server import ServerError, free_port, post_json, stop_group, wait_healthy

from quantpack_core.compare import agreement, kl_per_position

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU tier: nox -s gpu-tests)"),
]

DENSE, MOE, QWEN = "llama-tiny-exl3-4.0bpw-mul1", "qwen3moe-tiny-exl3-4.0bpw-mul1", "qwen3_5-tiny-exl3-4.0bpw-mul1"
#: seconds a server may take to answer /health (engine start with the pack's load; Qwen3.5's Triton kernels compile
#: on first use), and a request to return
START_S = float(os.environ.get("QUANTPACK_SERVE_START_S") or 360)
REQUEST_S = 180.0


def serve_args(llm_kwargs: dict) -> list[str]:
    """``vllm.LLM`` keyword arguments as ``vllm serve`` flags (``attention_backend`` -> ``--attention-backend``;
    a dict or list as JSON; True as the bare flag)."""
    out = []
    for key, value in llm_kwargs.items():
        flag = f"--{key.replace('_', '-')}"
        if value is True:
            out.append(flag)
        elif value is not False:
            out += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return out


def server_env() -> dict[str, str]:
    """This process's environment for the server: vLLM's default engine process (``VLLM_ENABLE_V1_MULTIPROCESSING``
    removed) and Python's fault handler on in every process (a SIGABRT prints each thread's stack)."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["PYTHONFAULTHANDLER"] = "1"
    return env


def dump_and_stop(proc: subprocess.Popen, log: Path) -> str:
    """SIGABRT the server's process group (every process prints its threads' stacks), give them 20 s, stop what is
    left; returns the server's whole log."""
    try:
        os.killpg(proc.pid, signal.SIGABRT)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    stop_group(proc, wait_s=5)
    time.sleep(1)  # the engine process's dump may end after the front end's
    return log.read_text(errors="replace")


def served_logprobs(
    pack: Path, name: str, llm_kwargs: dict, ids: list[int], vocab: int, log: Path, rec
) -> torch.Tensor:
    """Start ``vllm serve`` for ``pack``, ask one completion with prompt logprobs over ``vocab`` tokens for ``ids``,
    stop it; returns the ``(len(ids) - 1, vocab)`` log-probabilities. A server that does not start or answer in time
    fails the test with its stacks (:func:`dump_and_stop`), the record written with that error first."""
    from vllm_e2e import env_llm_kwargs

    port = free_port()
    kwargs = {**llm_kwargs, **env_llm_kwargs()}
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(pack), "--host", "127.0.0.1", "--port",
           str(port), "--served-model-name", name, "--dtype", "float16", "--enforce-eager", "--max-model-len", "512",
           "--max-logprobs", str(vocab), "--seed", "0", *serve_args(kwargs)]  # fmt: skip
    base, t0 = f"http://127.0.0.1:{port}", time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=server_env(), start_new_session=True)
    try:
        wait_healthy(proc, base, START_S, poll_s=2)
        rec.figures["start_s"] = time.time() - t0
        body = {"model": name, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": vocab}
        reply = post_json(f"{base}/v1/completions", body, timeout_s=REQUEST_S)
    except (ServerError, OSError) as e:
        rec.error = f"vllm serve: {e} ({time.time() - t0:.0f} s after its start)"
        rec.write()
        pytest.fail(
            f"{rec.error}; every process's threads (SIGABRT, faulthandler) in its log:\n{dump_and_stop(proc, log)}"
        )
    stop_group(proc, wait_s=60)
    rows = reply["choices"][0]["prompt_logprobs"][1:]
    lp = torch.full((len(rows), vocab), float("-inf"), dtype=torch.float64)
    for i, row in enumerate(rows):
        for tok, v in row.items():
            if int(tok) < vocab:
                lp[i, int(tok)] = v["logprob"]
    return lp


@pytest.mark.parametrize("name", [DENSE, MOE, QWEN])
def test_vllm_serve_answers_prompt_logprobs_like_the_reference(fixtures_dir, tmp_path, figures, gpu_record, name):
    from e2e_runner import unsupported_architecture
    from test_exl3_gpu_vllm import LLM_KWARGS, QWEN_LLM_KWARGS, qwen_reference

    pack = fixtures_dir / name
    why = unsupported_architecture(pack)
    if why:  # an older vLLM of the GPU matrix without the model
        pytest.skip(why)
    ref = torch.load(
        qwen_reference(fixtures_dir, tmp_path / "ref.pt") if name == QWEN else pack / "reference_logits.pt"
    )
    ids, vocab = ref["input_ids"][0].tolist(), ref["logits"].shape[-1]
    rec = gpu_record(f"serve/{name}/float16/eager", {})
    log = tmp_path / "serve.log"
    lp = served_logprobs(pack, name, QWEN_LLM_KWARGS if name == QWEN else LLM_KWARGS, ids, vocab, log, rec)
    want = ref["logits"][0, : lp.shape[0]]
    res = {**asdict(agreement(want, lp)), "kl_positions": kl_per_position(want, lp).tolist()}
    rec.agreement(res)
    if name == MOE:
        split = router_split(pack, res, bounds.QWEN3MOE_KL.limit)
        rec.outside_router_ties(split)
        rec.check("kl_outside_router_ties", split.kl, bounds.QWEN3MOE_KL)
        rec.check("top1", res["top1"], bounds.QWEN3MOE_TOP1)
    else:
        rec.check("kl", res["kl"], bounds.F16_KL)
        rec.check("top1", res["top1"], bounds.F16_TOP1)
    text = log.read_text(errors="replace")
    # vLLM prefixes its engine process's log lines "(EngineCore pid=N)": the engine ran in a process of its own
    rec.figures["engine_process"] = "EngineCore pid=" in text
    figures.append(
        f"GPU vllm serve {name} float16 eager (engine in its own process): KL {res['kl']:.3g}, top-1 "
        f"{100 * res['top1']:.2f}%, /health after {rec.figures['start_s']:.0f} s"
    )
    rec.assert_passed()
    assert rec.figures["engine_process"], f"no log line of an engine process of its own:\n{text[-5000:]}"
    assert "quantpack" in text, "the plugins did not announce themselves in vLLM's log"
