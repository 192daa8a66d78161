"""The vLLM server of ``quantpack serve`` run as a child process: its start-up shown in phases with a progress bar, its
whole log kept in a file, and a stop in one line.

* Phases, from vLLM's log lines and the plugins' progress file (:mod:`quantpack_core.progress`): starting vLLM,
  reading shards (vLLM's shard counter), decoding layers on CPU (the plugins' module counter), compiling and warming
  up (torch.compile, or loading its cached result), starting the server, then ready at the URL once ``/health``
  answers.
  A terminal gets tqdm bars; other output one line per phase.
* While it starts, only vLLM's warnings and errors are shown (all of it with ``verbose``); once ready, everything but
  the access-log lines of ``/health``.
  vLLM's "No available shared memory broadcast block found" warning during compilation gets one line saying what it
  means. If the server exits before it is ready, the end of its log is shown.
* Ctrl-C (or SIGTERM) sends SIGTERM to vLLM's API server alone (it runs in a session of its own, so the terminal's
  signal does not reach its engine processes, which it stops in order); what it prints while stopping goes to the log
  file only; a second Ctrl-C, or :data:`STOP_TIMEOUT_S` seconds, kills the whole process group.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from .progress import PROGRESS_ENV, read_progress

PREFIX = "quantpack serve: "
#: seconds vLLM gets to stop after SIGTERM before its process group is killed
STOP_TIMEOUT_S = 30
#: vLLM's log lines that start a phase (checked in order)
PHASE_LINES = (
    (re.compile(r"Loading safetensors checkpoint shards:\s*\d+% Completed \| (\d+)/(\d+)"), "reading shards"),
    (re.compile(r"Directly load AOT compilation"), "loading the compiled model from vLLM's compile cache"),
    (
        re.compile(r"Warming up model for the compilation|Starting torch\.compile|Dynamo bytecode transform time"),
        "compiling (torch.compile) and warming up",
    ),
    (re.compile(r"Warming up done|init engine \(profile, create kv cache, warmup model\) took"), "starting the server"),
)
#: vLLM's lines after which its HTTP server may answer (before them, /health is not asked: another program may hold
#: the port until vLLM, failing to bind it, exits)
SERVING = re.compile(r"init engine \(profile|Starting vLLM (API )?server on|Application startup complete")
#: uvicorn's access-log line of a request (``INFO:     127.0.0.1:36736 - "POST /v1/completions HTTP/1.1" 200 OK``;
#: a prefix such as vLLM's ``(APIServer pid=1) `` or a progress bar's end allowed, colour codes removed first): its
#: method, path and status. A download's debug line (``huggingface.co:443 "HEAD /... HTTP/1.1" 200``) is none
ACCESS_LOG = re.compile(
    r'(?:^|[\s)|])INFO:\s+\S* - "(?P<method>[A-Z]+) (?P<path>/\S*) HTTP/[\d.]+" (?P<status>\d{3})\b'
)
#: terminal colour codes (vLLM colours its lines where FORCE_COLOR or VLLM_LOGGING_COLOR asks)
COLOUR = re.compile(r"\x1b\[[0-9;]*m")
SHM_WARNING = "No available shared memory broadcast block found"
SHM_NOTE = (
    "vLLM's shared-memory warning above means one of its processes waited over a minute for another that is "
    "compiling; nothing hangs, start-up goes on"
)
LEVEL = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b")


class Display:
    """Phases and lines on ``stream``: a tqdm bar per phase on a terminal, one line per phase elsewhere."""

    def __init__(self, stream=sys.stderr):
        self.stream = stream
        self.tty = stream.isatty()
        self.name: str | None = None
        self.bar = None
        self.shown = (None, None)

    def phase(self, name: str, done: int | None = None, total: int | None = None) -> None:
        """Enter phase ``name`` (or update its count ``done`` of ``total``)."""
        entered = name != self.name
        if entered:
            self._close()
            self.name = name
            if self.tty:
                from tqdm import tqdm

                fmt = "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} [{elapsed}]" if total else "{desc} [{elapsed}]"
                size = shutil.get_terminal_size()  # 80 x 24 where the terminal reports none (tqdm would draw nothing)
                self.bar = tqdm(
                    total=total, desc=f"{PREFIX}{name}", bar_format=fmt, file=self.stream, ncols=size.columns,
                    nrows=size.lines,
                )  # fmt: skip
        if self.bar is not None:
            if total is not None:
                self.bar.total, self.bar.n = total, done or 0
            self.bar.refresh()
        elif entered or (total and done == total and self.shown != (done, total)):
            self.stream.write(f"{PREFIX}{name}{f' {done}/{total}' if total else ''}\n")
            self.stream.flush()
        self.shown = (done, total)

    def line(self, text: str) -> None:
        """Print a line of vLLM's (above the bar)."""
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def tick(self) -> None:
        if self.bar is not None:
            self.bar.refresh()

    def _close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar, self.shown = None, (None, None)

    def close(self) -> None:
        self._close()
        self.name = None


def _read_lines(pipe, log, out: queue.Queue) -> None:
    """Copy the child's output into ``log`` and its lines (split at \\r and \\n: tqdm's updates) into ``out``;
    None at the end."""
    pending = b""
    for chunk in iter(lambda: pipe.read1(1 << 16), b""):
        log.write(chunk)
        log.flush()
        pending += chunk
        *lines, pending = re.split(rb"\r\n|\r|\n", pending)
        for raw in lines:
            out.put(raw.decode("utf-8", "replace"))
    if pending:
        out.put(pending.decode("utf-8", "replace"))
    out.put(None)


def _drain(lines: queue.Queue) -> list[str | None]:
    """The lines queued now, after waiting up to half a second for the first."""
    try:
        got = [lines.get(timeout=0.5)]
    except queue.Empty:
        return []
    while got[-1] is not None:
        try:
            got.append(lines.get_nowait())
        except queue.Empty:
            break
    return got


def _die_with_parent() -> None:
    """In the child before it runs vLLM (Linux): SIGTERM when quantpack serve dies, even by SIGKILL, so that no
    server is left running without it; elsewhere nothing."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class Supervisor:
    """Runs ``argv`` (vLLM's server) until it exits or is stopped; see the module.

    Args:
        argv, env: the server's command and environment.
        url: where ``/health`` answers once it is ready (``http://host:port``).
        log_path: the file that receives all of vLLM's output.
        cpu: whether the layers are decoded on CPU (the phase's name).
        verbose: show all of vLLM's output while it starts.
    """

    def __init__(self, argv: list[str], env: dict[str, str], url: str, log_path: Path, cpu: bool, verbose: bool):
        self.argv, self.env, self.url, self.log_path = argv, env, url, log_path
        self.cpu, self.verbose = cpu, verbose
        self.display = Display()
        self.ready = self.serving = self.answered = False
        self.stops = 0
        self.shm_noted = False
        self.tail: list[str] = []

    def run(self) -> int:
        """The exit status: 0 after a stop the user asked for, else the server's (1 if it gave 0 before ready)."""
        progress = self.log_path.with_suffix(".progress")
        progress.unlink(missing_ok=True)
        env = {**self.env, PROGRESS_ENV: str(progress), "PYTHONUNBUFFERED": "1"}
        lines: queue.Queue = queue.Queue()
        started = time.monotonic()
        # the handlers come before the server starts: a Ctrl-C while Popen returns is a stop, not a KeyboardInterrupt
        # that would leave vLLM running
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            with self.log_path.open("ab") as log:
                proc = subprocess.Popen(
                    self.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                    preexec_fn=_die_with_parent,
                )  # fmt: skip
                reader = threading.Thread(target=_read_lines, args=(proc.stdout, log, lines), daemon=True)
                reader.start()
                try:
                    self.display.phase("starting vLLM")
                    self._loop(proc, lines, progress, started)
                finally:
                    self._kill_group(proc, signal.SIGKILL)
                    reader.join(timeout=5)
                    progress.unlink(missing_ok=True)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        return self._outcome(proc)

    def _on_signal(self, _signum, _frame) -> None:
        self.stops += 1

    def _loop(self, proc: subprocess.Popen, lines: queue.Queue, progress: Path, started: float) -> None:
        stop_sent, last_health, ended, decoded = None, 0.0, False, None
        while not ended or proc.poll() is None:
            if self.stops and stop_sent is None:
                stop_sent = time.monotonic()
                self.display.close()
                if not self.ready:  # vLLM may take a while to stop mid-start: say so
                    self.display.line(f"{PREFIX}stopping vLLM before it is ready (Ctrl-C again kills it)")
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
            if stop_sent is not None and (self.stops > 1 or time.monotonic() - stop_sent > STOP_TIMEOUT_S):
                self._kill_group(proc, signal.SIGKILL)
            for line in _drain(lines):  # every line already read, before the progress file is looked at
                if line is None:
                    ended = True
                    proc.wait()
                else:
                    self._on_line(line, stopping=stop_sent is not None)
            if not self.ready and stop_sent is None and not ended:
                if (found := read_progress(progress)) is not None and found != decoded:
                    decoded = found
                    self.display.phase("decoding layers on CPU" if self.cpu else "preparing layers", *found)
                if self.serving and self.answered:
                    self._on_ready(started)
                elif self.serving and time.monotonic() - last_health > 1:
                    last_health = time.monotonic()
                    if healthy(self.url):
                        self._on_ready(started)
                self.display.tick()

    def _on_line(self, line: str, stopping: bool) -> None:
        self.tail = [*self.tail[-59:], line]
        self.serving = self.serving or bool(SERVING.search(line))
        # uvicorn's access log: once vLLM serves, a request answered (any status below 500) says it is ready even
        # where quantpack serve's own /health request timed out (few cores busy with the first clients' requests);
        # that /health request's own line is not shown
        access = ACCESS_LOG.search(COLOUR.sub("", line))
        self.answered = self.answered or (self.serving and access is not None and int(access["status"]) < 500)
        own_health = access is not None and access.group("method", "path", "status") == ("GET", "/health", "200")
        if stopping or own_health:
            return
        if self.ready or self.verbose:
            self.display.line(line)
            return
        if SHM_WARNING in line:  # logged at INFO by vLLM 0.32, WARNING by others
            self.display.line(line)
            if not self.shm_noted:
                self.shm_noted = True
                self.display.line(PREFIX + SHM_NOTE)
            return
        for pattern, name in PHASE_LINES:
            if m := pattern.search(line):
                counts = (int(m.group(1)), int(m.group(2))) if m.groups() else ()
                self.display.phase(name, *counts)
                return
        if LEVEL.search(line):
            self.display.line(line)

    def _on_ready(self, started: float) -> None:
        self.ready = True
        self.display.close()
        self.display.line(f"{PREFIX}ready at {self.url}/v1 after {time.monotonic() - started:.0f} s (Ctrl-C stops it)")

    def _outcome(self, proc: subprocess.Popen) -> int:
        self.display.close()
        if self.stops:
            self.display.line(f"{PREFIX}stopped (vLLM's log: {self.log_path})")
            return 0
        if not self.ready:
            shown = "\n".join(self.tail[-40:])
            self.display.line(f"{shown}\n{PREFIX}vLLM exited with status {proc.returncode} before it was ready; its "
                              f"whole log: {self.log_path}")  # fmt: skip
            return proc.returncode or 1
        self.display.line(f"{PREFIX}vLLM exited with status {proc.returncode} (its log: {self.log_path})")
        return proc.returncode

    @staticmethod
    def _kill_group(proc: subprocess.Popen, sig: int) -> None:
        """Signal the server's whole process group (its engine and worker processes) unless it is gone."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
