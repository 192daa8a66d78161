"""An OpenAI-compatible vLLM server started as a child process group, for the end-to-end serve tests
(``test_exl3_serve.py``, ``test_escha_serve.py``) and the documented-install session (``noxfile.py``): a free port, a
wait for ``/health`` that notices the server's exit, a JSON POST, a stop of the whole group, and ``quantpack serve``
started with its output and vLLM's log in files. Plain standard library (the noxfile imports it outside any test
environment)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path


class ServerError(RuntimeError):
    """The server exited, or did not answer ``/health`` in time (the message says which)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, poll_s: float) -> None:
    """Return once ``url/health`` answers 200, polling every ``poll_s`` seconds.

    Raises:
        ServerError: ``proc`` exited first, or ``timeout_s`` seconds passed.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise ServerError(f"the server exited ({proc.returncode})")
        if time.monotonic() > deadline:
            raise ServerError(f"no /health after {timeout_s:g} s")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(poll_s)


def post_json(url: str, body: dict, timeout_s: float = 120) -> dict:
    """POST ``body`` as JSON to ``url`` and return the decoded JSON answer."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as r:
        return json.loads(r.read())


def stop_group(proc: subprocess.Popen, wait_s: float) -> None:
    """SIGTERM ``proc``'s process group (started with ``start_new_session=True``), SIGKILL it after ``wait_s``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=wait_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@dataclass
class Served:
    """A ``quantpack serve`` process: its group leader, base URL, what it printed (stdout and stderr) and vLLM's log."""

    proc: subprocess.Popen
    base: str
    out: Path
    log: Path


def start_served(argv: list[str], env: dict[str, str], folder: Path, timeout_s: float) -> Served:
    """Start ``argv`` (a ``quantpack serve`` command line, or a script that runs one; ``--port``, ``--host
    127.0.0.1`` and ``--log-file`` are added) in a process group of its own, as a terminal's foreground job, with its
    output in ``folder/out.txt`` and vLLM's log in ``folder/vllm.log``; returned once ``/health`` answers.

    Raises:
        ServerError: it exited or did not answer in time; the message holds the ends of both files.
    """
    port = free_port()
    out, log = folder / "out.txt", folder / "vllm.log"
    full = [*argv, "--port", str(port), "--host", "127.0.0.1", "--log-file", str(log)]
    with open(out, "w") as sink:
        proc = subprocess.Popen(full, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    served = Served(proc, f"http://127.0.0.1:{port}", out, log)
    try:
        wait_healthy(proc, served.base, timeout_s, poll_s=2)
    except ServerError as e:
        stop_group(proc, wait_s=60)
        tail = log.read_text()[-5000:] if log.exists() else ""
        raise ServerError(f"{e}:\n{out.read_text()[-3000:]}\n{tail}") from None
    return served
