"""The GPU tier's records: what each run measured and decided, as JSON files that ``ci/gpu/matrix_table.py`` turns into
the README's and docs/results.md's GPU tables (ci/gpu/records/README.md).

Three kinds, all written only where ``QUANTPACK_GPU_RECORDS`` names a folder (ci/gpu/env.sh sets it on the GPU
machine; elsewhere nothing is written), under ``<folder>/vllm-<release>/<run>/``, ``<run>`` being the test session's
start (``YYYYMMDD-HHMMSS``) and ``QUANTPACK_GPU_STEP`` (ci/gpu/run.py's job, else ``run``); the repository's
conftest.py fixes both, and what :func:`environment` names, as the session starts:

* a job record (``job-<job>.json``) per measured job: its KL (mean, median, worst position), top-1, the positions
  left out of the mean with their router margins (``quantpack_core.compare.outside_router_ties``), each check with
  the bound applied and the measurement behind that bound (``e2e_bounds.Bound``), and whether every check held;
* a tests record (``tests-<file>.json``) per test file: every test's outcome (passed / failed / xfailed / skipped),
  written by the repository's conftest.py at the end of the run;
* a measure record (``measure-<what>.json``): a test's own measurement behind one of its bounds (:func:`write`).

All carry where and what ran: the card, the vLLM release, torch, the commit (``QUANTPACK_COMMIT``, which
ci/gpu/snapshot.sh's copy sets, else ``git rev-parse HEAD``) and the date (UTC).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the records' folder on the GPU machine (unset: no record is written)
RECORDS = "QUANTPACK_GPU_RECORDS"
#: the process's start, the run folder's name (with the step)
_STARTED = time.strftime("%Y%m%d-%H%M%S")


def environment() -> dict:
    """Where and what runs: ``card`` (torch's name of GPU 0, ``none`` without one) and :func:`begun`'s fields."""
    return {"card": card(), **begun()}


@functools.cache
def begun() -> dict:
    """What runs, fixed when first asked (the repository's conftest.py asks as the session starts): ``vllm`` (the
    release installed, ``none`` without it), ``torch`` (``none`` without it), ``commit`` and ``step``
    (``QUANTPACK_GPU_STEP``, else ``run``). Reads no GPU: CUDA stays uninitialized in the test process."""
    try:
        import torch

        version = torch.__version__
    except ImportError:
        version = "none"
    step = os.environ.get("QUANTPACK_GPU_STEP") or "run"
    return {"vllm": vllm_release(), "torch": version, "commit": commit(), "step": step}


@functools.cache
def card() -> str:
    """torch's name of GPU 0 (``none`` without one), read once, when the first record is written (reading it
    initializes CUDA in this process)."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"


def vllm_release() -> str:
    """The vLLM release installed (``0.25.1``; a local version's ``+...`` dropped), ``none`` without vLLM."""
    from importlib import metadata

    try:
        return metadata.version("vllm").split("+")[0]
    except metadata.PackageNotFoundError:
        return "none"


def commit() -> str:
    """``QUANTPACK_COMMIT``, else this checkout's HEAD (``-dirty`` appended where tracked files differ), else
    ``unknown`` (a copy without git)."""
    if os.environ.get("QUANTPACK_COMMIT"):
        return os.environ["QUANTPACK_COMMIT"]
    try:
        run = functools.partial(subprocess.run, cwd=ROOT, capture_output=True, text=True, check=True, timeout=30)
        head = run(["git", "rev-parse", "HEAD"]).stdout.strip()
        dirty = run(["git", "status", "--porcelain", "--untracked-files=no"]).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}-dirty" if dirty else head


def run_dir() -> Path | None:
    """This run's folder of records (made on first use), or None where ``QUANTPACK_GPU_RECORDS`` is unset."""
    root = os.environ.get(RECORDS)
    if not root:
        return None
    env = environment()
    out = Path(root) / f"vllm-{env['vllm']}" / f"{_STARTED}-{slug(env['step'])}"
    out.mkdir(parents=True, exist_ok=True)
    return out


def slug(name: str) -> str:
    """``name`` as a file name: every run of characters other than letters, digits, ``.``, ``_``, ``-`` -> ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")


def write(name: str, record: dict) -> Path | None:
    """Write ``record`` with :func:`environment` and the date as ``<run>/<name>.json``; None where no folder is set."""
    folder = run_dir()
    if folder is None:
        return None
    path = folder / f"{slug(name)}.json"
    full = {**record, **environment(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path.write_text(json.dumps(full, indent=1, sort_keys=True) + "\n")
    return path


def test_file_and_id(nodeid: str) -> tuple[str, str]:
    """``(file, id)`` of a pytest node id with the folders above the test module dropped:
    ``packages/x/tests/test_a.py::test_b[c]`` -> ``("test_a.py", "test_a.py::test_b[c]")``."""
    path, _, rest = nodeid.partition("::")
    name = Path(path).name
    return name, f"{name}::{rest}" if rest else name


def write_outcomes(outcomes: dict[str, str]) -> list[Path]:
    """One tests record per test file of ``outcomes`` (``{node id: outcome}``): ``{"kind": "tests", "file",
    "tests": {id: outcome}}``."""
    files: dict[str, dict[str, str]] = {}
    for nodeid, outcome in outcomes.items():
        name, test = test_file_and_id(nodeid)
        files.setdefault(name, {})[test] = outcome
    written = [write(f"tests-{name}", {"kind": "tests", "file": name, "tests": tests}) for name, tests in files.items()]
    return [p for p in written if p is not None]


@dataclass
class JobRecord:
    """One measured job of a test: its figures (:meth:`agreement`, :meth:`outside_router_ties`), checks
    (:meth:`check`) and notes, written by :meth:`write` (test ``test``: its pytest node id)."""

    test: str
    job: str
    figures: dict = field(default_factory=dict)
    checks: list = field(default_factory=list)
    excluded: list = field(default_factory=list)
    error: str | None = None

    def agreement(self, res: dict) -> JobRecord:
        """The runner's agreement fields of ``res`` (``quantpack_core.compare.Agreement``'s, as
        ``vllm_e2e.logit_agreement`` returns them) as the record's KL and top-1 figures."""
        keys = ("kl", "kl_median", "kl_max", "kl_worst", "top1", "top1_decided", "positions", "ties")
        self.figures.update({k: res[k] for k in keys if k in res})
        return self

    def outside_router_ties(self, split) -> JobRecord:
        """A ``quantpack_core.compare.RouterSplit``: the mean outside the router near-ties that departed
        (``kl_outside_router_ties``) and the positions it left out, each with its margin and KL."""
        self.figures["kl_outside_router_ties"] = split.kl
        self.excluded = [dict(e) for e in split.excluded]
        return self

    def check(self, name: str, value: float, bound) -> bool:
        """Check ``value`` against ``bound`` (an ``e2e_bounds.Bound``), keep the check; returns whether it held."""
        ok = bound.holds(value)
        self.checks.append({"name": name, "value": value, "ok": ok, **bound.as_record()})
        return ok

    def failures(self) -> list[str]:
        """Each check that did not hold (and the error of a job that did not run), as a line."""
        lines = [f"{self.job}: {self.error}"] if self.error else []
        failed = [c for c in self.checks if not c["ok"]]
        return lines + [f"{self.job}: {c['name']} {c['value']:.4g} not {c['op']} {c['limit']:.4g}" for c in failed]

    @property
    def passed(self) -> bool:
        return not self.failures() and bool(self.checks)

    def write(self) -> JobRecord:
        """Write the record (where records are kept) and return it."""
        file, test = test_file_and_id(self.test)
        body = {"kind": "job", "job": self.job, "test": test, "file": file, "passed": self.passed}
        body.update(figures=self.figures, checks=self.checks, excluded=self.excluded, error=self.error)
        write(f"job-{file.removesuffix('.py')}-{self.job}", body)
        return self

    def assert_passed(self) -> None:
        """Write the record, then fail the test with every failed check where one did not hold."""
        self.write()
        assert self.passed, "\n".join(self.failures()) or f"{self.job}: no check made"


#: the trellis_mma settings (fields of ``quantpack_core.trellis_mma.settings.Settings``) a GPU job may force
#: (ci/gpu/jobs.toml's e2e-*-tc / -dense jobs)
FORCED_SETTINGS = ("wide_kernel", "delegate_rows", "moe_tc_picks")


def forced_values(environ=os.environ) -> dict:
    """``{setting: value}`` of the :data:`FORCED_SETTINGS` this process's kernels read from ``environ``
    (``Settings.from_env``) that differ from the measured choice's defaults: a variable they refuse, or a blank one,
    forces nothing, and ``TC`` forces what ``tc`` does."""
    from quantpack_core.trellis_mma.settings import Settings  # standard library only: no torch, no CUDA

    read, default = Settings.from_env(environ), Settings()
    return {f: getattr(read, f) for f in FORCED_SETTINGS if getattr(read, f) != getattr(default, f)}


def forced_settings(environ=os.environ) -> str:
    """The :func:`forced_values` as a job name's suffix (`` [wide_kernel=tc, delegate_rows=0]``), or "" where none is
    in force: a job's record under them is kept apart from the same job's under the default."""
    forced = [f"{name}={value}" for name, value in forced_values(environ).items()]
    return f" [{', '.join(forced)}]" if forced else ""


def job_of(test: str, job: str, res: dict | None) -> JobRecord:
    """A :class:`JobRecord` of runner result ``res`` (None: the job did not run; with ``failed``: it raised, the
    record then carries that error and is written at once, before the test fails on it), named ``job`` with the
    settings it was forced to run under (:func:`forced_settings`)."""
    record = JobRecord(test, job + forced_settings())
    if res is None or "failed" in res:
        record.error = "did not run" if res is None else res["failed"]
        record.write()
        return record
    return record.agreement(res)
