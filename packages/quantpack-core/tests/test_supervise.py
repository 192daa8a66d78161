"""``quantpack serve``'s supervision of vLLM's server (quantpack_core.supervise) on a child that prints what vLLM
0.32's CPU server prints at start and at stop (its lines copied from a real log) and answers /health like it (or,
busy, answers a client's request only): what the user sees while it starts, once ready and after Ctrl-C, and a server
that dies before it is ready. The real server: quantpack-exl3's test_exl3_serve.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

#: vLLM 0.32's lines, the plugins' progress and vLLM's shutdown noise, then /health; SIGTERM ends it
SERVER = textwrap.dedent("""
    import http.server, os, signal, sys, threading, time
    from quantpack_core.progress import report_modules

    def say(line):
        print(line, flush=True)

    port, mode = int(sys.argv[1]), sys.argv[2]
    say("(APIServer pid=1) INFO 12-06 04:03:16 [api_utils.py:286] non-default args: {}")
    say("(APIServer pid=1) WARNING 12-06 04:04:07 [cpu.py:224] Triton is not installed.")
    if mode == "lie":  # lines that look like an answered request before vLLM serves, then a failed start
        say('urllib3.connectionpool DEBUG https://huggingface.co:443 "HEAD /org/model/resolve/main/config.json '
            'HTTP/1.1" 200 0')
        say("(EngineCore pid=3) INFO 12-06 04:00:19 [core.py:402] init engine (profile, create kv cache, warmup model) "
            "took 90.63 s")
        say('(APIServer pid=1) Traceback: "GET /health HTTP/1.1" 200 quoted in an error')
        sys.exit(3)
    if mode == "fail":
        say("Traceback (most recent call last):")
        say("RuntimeError: Engine core initialization failed. See root cause above.")
        sys.exit(3)
    sys.stdout.write("Loading safetensors checkpoint shards:   0% Completed | 0/2 [00:00<?, ?it/s]\\r")
    sys.stdout.write("Loading safetensors checkpoint shards: 100% Completed | 2/2 [00:00<00:00, 140.44it/s]\\n")
    for done in range(1, 6):
        report_modules(done, 5)
        time.sleep(0.6)
    say("(Worker pid=2) INFO 12-06 03:58:48 [cpu_model_runner.py:87] Warming up model for the compilation...")
    say("(EngineCore pid=3) INFO 12-06 03:59:49 [shm_broadcast.py:871] No available shared memory broadcast block "
        "found in 60 seconds. This typically happens when some processes are hanging or doing some time-consuming work")
    say("(EngineCore pid=3) INFO 12-06 03:59:50 [shm_broadcast.py:871] No available shared memory broadcast block "
        "found in 60 seconds.")
    say("(Worker pid=2) INFO 12-06 04:00:16 [cpu_model_runner.py:91] Warming up done.")
    say("(EngineCore pid=3) INFO 12-06 04:00:19 [core.py:402] init engine (profile, create kv cache, warmup model) "
        "took 90.63 s")

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            say('INFO:     127.0.0.1:1 - "GET /health HTTP/1.1" 200 OK')

        def log_message(self, *args):
            pass

    class Busy(Health):  # busy with a client's request: /health does not answer in time
        def do_GET(self):
            time.sleep(30)

    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Busy if mode == "busy" else Health)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    if mode == "busy":
        say('\\x1b[0;36m(APIServer pid=1)\\x1b[0;0m INFO:     ::1:2 - "POST /v1/completions?x=1 HTTP/1.1" 200 OK')
    stopped.wait()
    say("(APIServer pid=1) INFO 12-06 04:08:27 [launcher.py:282] [shutdown] API server: signalling HTTP server")
    print("nanobind: leaked 4 instances!", file=sys.stderr, flush=True)
    print("Traceback (most recent call last):\\nvllm.v1.engine.exceptions.EngineDeadError: dead", file=sys.stderr)
""")
RUN = textwrap.dedent("""
    import sys
    from pathlib import Path
    from quantpack_core.supervise import Supervisor
    port, mode, log = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    argv = [sys.executable, sys.argv[4], port, mode]
    sys.exit(Supervisor(argv, {}, f"http://127.0.0.1:{port}", log, cpu=True, verbose=False).run())
""")


def _start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, Path, Path]:
    from http_server import free_port

    (tmp_path / "server.py").write_text(SERVER)
    out, log = tmp_path / "out.txt", tmp_path / "vllm.log"
    argv = [sys.executable, "-c", RUN, str(free_port()), mode, str(log), str(tmp_path / "server.py")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with out.open("w") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, out, log


def _wait_for(path: Path, text: str, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no {text!r} (exit {proc.poll()}):\n{path.read_text()}")
        time.sleep(0.2)


def test_phases_warnings_ready_and_a_one_line_stop(tmp_path):
    proc, out, log = _start(tmp_path, "serve")
    try:
        _wait_for(out, "ready at", proc)
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the foreground group, the supervisor's
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = out.read_text().splitlines()
    # the decoding phase's counts come from a file the supervisor polls beside the child's output, so how many of them
    # it shows and where its first one falls among the lines before it depend on the machine's load: the phase must
    # show, end at 5/5 and come before the compile phase; every other line in this order
    decoding = "quantpack serve: decoding layers on CPU"
    counts = [line for line in lines if line.startswith(decoding)]
    assert counts and counts[-1] == f"{decoding} 5/5", lines
    assert lines.index(counts[-1]) < lines.index("quantpack serve: compiling (torch.compile) and warming up"), lines
    others = [line for line in lines if not line.startswith(decoding)]
    want = [
        "quantpack serve: starting vLLM",
        "(APIServer pid=1) WARNING 12-06 04:04:07 [cpu.py:224] Triton is not installed.",
        "quantpack serve: reading shards 0/2",
        "quantpack serve: reading shards 2/2",
        "quantpack serve: compiling (torch.compile) and warming up",
        "(EngineCore pid=3) INFO 12-06 03:59:49 [shm_broadcast.py:871] No available shared memory broadcast block",
        "quantpack serve: vLLM's shared-memory warning above means",
        "(EngineCore pid=3) INFO 12-06 03:59:50 [shm_broadcast.py:871] No available shared memory broadcast block",
        "quantpack serve: starting the server",
        "quantpack serve: ready at http://127.0.0.1:",
        f"quantpack serve: stopped (vLLM's log: {log})",
    ]
    assert len(others) == len(want) and all(a.startswith(b) for a, b in zip(others, want, strict=True)), lines
    whole = log.read_text()
    for kept in ("non-default args", "nanobind: leaked", "EngineDeadError", "GET /health", "signalling HTTP server"):
        assert kept in whole and (kept == "non-default args" or kept not in out.read_text()), kept


def test_a_request_answered_while_health_waits_is_ready(tmp_path):
    """A machine of few cores busy with the first clients' requests: quantpack serve's own /health request times out,
    but the access log shows a request answered, so the user is told it is ready (the failure this guards: "ready at"
    printed long after clients were served)."""
    proc, out, log = _start(tmp_path, "busy")
    try:
        _wait_for(out, "ready at", proc, timeout_s=20)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "GET /health" not in log.read_text() and "POST /v1/completions" in log.read_text()


def test_a_line_that_only_looks_like_an_answer_is_no_ready_server(tmp_path):
    """A download's debug line before the engine starts, and an error quoting a request after it, are not uvicorn's
    access log: a server that exits then is still one that died before it was ready."""
    proc, out, log = _start(tmp_path, "lie")
    assert proc.wait(timeout=60) == 3
    text = out.read_text()
    assert "ready at" not in text, text
    assert text.rstrip().endswith(
        f"quantpack serve: vLLM exited with status 3 before it was ready; its whole log: {log}"
    )


def test_a_server_that_dies_before_it_is_ready(tmp_path):
    """Its exit status, and the end of its log with the error, then where the whole log is."""
    proc, out, log = _start(tmp_path, "fail")
    assert proc.wait(timeout=60) == 3
    text = out.read_text()
    assert "RuntimeError: Engine core initialization failed" in text
    assert text.rstrip().endswith(
        f"quantpack serve: vLLM exited with status 3 before it was ready; its whole log: {log}"
    )


def test_a_stop_before_ready_says_it_is_stopping(tmp_path):
    """Ctrl-C while vLLM still starts: a line says the stop is under way (vLLM can take many seconds to stop there),
    then the one line of a stop."""
    proc, out, log = _start(tmp_path, "serve")
    try:
        _wait_for(out, "decoding layers on CPU", proc)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = out.read_text().splitlines()
    assert "ready at" not in out.read_text(), lines
    assert lines[-2:] == [
        "quantpack serve: stopping vLLM before it is ready (Ctrl-C again kills it)",
        f"quantpack serve: stopped (vLLM's log: {log})",
    ], lines


def test_a_stop_as_the_server_starts(tmp_path, monkeypatch):
    """A Ctrl-C that arrives as Popen returns (before the loop runs) is a stop like any other: the server is stopped
    and the status is 0. The handlers were installed after Popen, so it raised KeyboardInterrupt and left the server
    running."""
    from quantpack_core import supervise

    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen_then_ctrl_c(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        signal.raise_signal(signal.SIGINT)
        return started[-1]

    monkeypatch.setattr(supervise.subprocess, "Popen", popen_then_ctrl_c)
    # handlers of the caller's own, which the supervisor must put back (not Python's defaults)
    before = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    mine = {s: signal.getsignal(s) for s in before}
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    sup = supervise.Supervisor(argv, {}, "http://127.0.0.1:9", tmp_path / "vllm.log", cpu=True, verbose=False)
    try:
        try:
            status = sup.run()
        except KeyboardInterrupt:
            pytest.fail("a Ctrl-C as the server started raised KeyboardInterrupt, the server left running")
        assert status == 0
        assert started[0].wait(timeout=10) is not None  # the server was stopped
        assert {s: signal.getsignal(s) for s in mine} == mine  # the caller's handlers are back
    finally:
        if started and started[0].poll() is None:
            os.killpg(started[0].pid, signal.SIGKILL)
        for s, handler in before.items():
            signal.signal(s, handler)
