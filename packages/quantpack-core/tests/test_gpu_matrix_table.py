"""ci/gpu/matrix_table.py on reports pytest itself writes: per-release cells, the newest report winning, "not run"."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def load_tool():
    spec = importlib.util.spec_from_file_location("matrix_table", ROOT / "ci" / "gpu" / "matrix_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def report(tmp: Path, out: Path, body: str) -> None:
    """Run pytest on a module ``test_gpu_demo.py`` holding ``body`` and write its JUnit XML to ``out``."""
    mod = tmp / "pkg" / "tests"
    mod.mkdir(parents=True, exist_ok=True)
    (mod / "test_gpu_demo.py").write_text(body)
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={out}", str(mod)],
        cwd=tmp,
        env={k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},
        capture_output=True,
        check=False,
    )
    assert out.is_file(), "pytest wrote no report"


FIRST = """
import pytest
def test_a(): pass
def test_b(): assert False
@pytest.mark.skip(reason="no GPU of that kind")
def test_c(): pass
"""
LATER = FIRST.replace("assert False", "pass")


def test_cells_count_outcomes_per_release_and_newest_report_wins(tmp_path):
    tool = load_tool()
    reports = tmp_path / "reports"
    reports.mkdir()
    report(tmp_path, reports / "vllm-0.22.1-20261203-100000.xml", FIRST)
    report(tmp_path, reports / "vllm-0.25.1-20261203-100000.xml", FIRST)
    # test_b fixed and run again by a pending.sh step (its name after the time)
    report(tmp_path, reports / "vllm-0.25.1-20261203-120000-e2e-dense.xml", LATER)
    results = tool.collect([reports])
    text = tool.table(results, ["0.22.1", "0.25.1", "0.26.0"])
    row = next(line for line in text.splitlines() if "test_gpu_demo.py" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["`test_gpu_demo.py`", "1 passed, 1 failed, 1 skipped", "2 passed, 1 skipped", "not run"]
    assert tool.main([str(reports)]) == 1  # 0.22.1 still has a failure


def test_a_broken_report_is_named(tmp_path):
    tool = load_tool()
    (tmp_path / "vllm-0.26.0-20261203-100000.xml").write_text("<testsuites><testcase")
    try:
        tool.collect([tmp_path])
    except SystemExit as e:
        assert "vllm-0.26.0-20261203-100000.xml" in str(e) and "not a JUnit XML report" in str(e)
    else:
        raise AssertionError("a truncated report was accepted")
