"""An OpenAI-compatible vLLM server started as a child process group, for the end-to-end serve test
(``test_exl3_serve.py``) and the documented-install session (``noxfile.py``): a free port, a wait for ``/health``
that notices the server's exit, a JSON POST, and a stop of the whole group. Plain standard library (the noxfile
imports it outside any test environment)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request


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
