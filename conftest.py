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
