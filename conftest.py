import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
FIXTURES = ROOT / "fixtures"
# the end-to-end job runner every package's tests share (tests/e2e_runner.py, tests/vllm_e2e.py)
sys.path.insert(0, str(ROOT / "tests"))


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """The packs bundled with the repository (see fixtures/README.md)."""
    return FIXTURES


FIGURES: list[str] = []


@pytest.fixture(scope="session")
def figures():
    """Tests append the figures they measured; they are printed at the end of the run."""
    return FIGURES


def pytest_terminal_summary(terminalreporter):
    if FIGURES:
        try:
            import vllm

            title = f"measured (vllm {vllm.__version__})"
        except ImportError:
            title = "measured"
        terminalreporter.section(title)
        for line in FIGURES:
            terminalreporter.write_line(line)


@pytest.fixture
def gpu_record(request):
    """This test's job records (tests/gpu_records.py): ``gpu_record(job, result)`` -> a ``JobRecord`` of the runner
    result ``result`` (None or with ``failed``: a job that did not run, recorded as such at once)."""
    from gpu_records import job_of

    return lambda job, result: job_of(request.node.nodeid, job, result)


#: each test's outcome in this run, by node id, where records are kept (QUANTPACK_GPU_RECORDS, the GPU tier)
OUTCOMES: dict[str, str] = {}


def pytest_sessionstart(session):
    """Where records are kept: fix the run's start and what it runs (vLLM release, torch, commit, step) now, before any
    test runs (tests/gpu_records.py: no GPU is read, CUDA stays uninitialized), so that a record written at the end
    names the run's start and what was installed when its tests began, not what a step beside it installed
    meanwhile."""
    if os.environ.get("QUANTPACK_GPU_RECORDS"):
        import gpu_records

        gpu_records.begun()


def pytest_runtest_logreport(report):
    """Keep the test's outcome: the call's, or a failed / skipped setup's, or a failed teardown's; an expected
    failure as ``xfailed``."""
    if not os.environ.get("QUANTPACK_GPU_RECORDS"):
        return
    if report.when == "call" or report.outcome != "passed":
        outcome = "xfailed" if report.skipped and hasattr(report, "wasxfail") else report.outcome
        if OUTCOMES.get(report.nodeid) != "failed":  # a failed teardown after a call stays a failure
            OUTCOMES[report.nodeid] = outcome


def pytest_collectreport(report):
    """A test module that does not import counts as one failed test of its file, ``<file>::(collection)``."""
    if os.environ.get("QUANTPACK_GPU_RECORDS") and report.failed and report.nodeid.endswith(".py"):
        OUTCOMES[f"{report.nodeid}::(collection)"] = "failed"


def pytest_sessionfinish(session):
    """Write one tests record per test file that ran (tests/gpu_records.py)."""
    if OUTCOMES:
        from gpu_records import write_outcomes

        write_outcomes(OUTCOMES)
