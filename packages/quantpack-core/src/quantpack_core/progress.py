"""How far a model's load has got, for ``quantpack serve``'s progress bar (:mod:`quantpack_core.supervise`).

Where the environment names a file (:data:`PROGRESS_ENV`, set by ``quantpack serve`` for vLLM's processes), each
module the plugins finish preparing appends a line ``modules DONE TOTAL PID`` to it; elsewhere nothing is written.
With tensor parallelism every worker writes its own lines; :func:`read_progress` adds them up.
"""

from __future__ import annotations

import os
from pathlib import Path

PROGRESS_ENV = "QUANTPACK_PROGRESS"


def report_modules(done: int, total: int) -> None:
    """Append this process's count of prepared modules to the progress file, if one is named (never raises)."""
    path = os.environ.get(PROGRESS_ENV)
    if not path:
        return
    try:
        with open(path, "a") as f:
            f.write(f"modules {done} {total} {os.getpid()}\n")
    except OSError:
        pass


def read_progress(path: Path) -> tuple[int, int] | None:
    """(done, total) summed over the processes' latest lines in ``path``; None before any line."""
    try:
        text = path.read_text()
    except OSError:
        return None
    latest: dict[str, tuple[int, int]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "modules" and parts[1].isdigit() and parts[2].isdigit():
            latest[parts[3]] = (int(parts[1]), int(parts[2]))
    if not latest:
        return None
    return sum(d for d, _ in latest.values()), sum(t for _, t in latest.values())
