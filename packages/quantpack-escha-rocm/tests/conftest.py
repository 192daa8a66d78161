"""Fixtures of the escha tests: the measured figures printed at the end of a run."""

import pytest

FIGURES: list[str] = []


@pytest.fixture(scope="session")
def figures():
    """Tests append the figures they measured; they are printed at the end of the run."""
    return FIGURES


def pytest_terminal_summary(terminalreporter):
    if FIGURES:
        terminalreporter.section("measured (escha)")
        for line in FIGURES:
            terminalreporter.write_line(line)
