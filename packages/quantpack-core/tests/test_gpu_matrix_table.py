"""ci/gpu/matrix_table.py on reports pytest itself writes: per-release cells, the newest report winning but for the
tests it skipped (a job selection), "not run"."""

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


def report(tmp: Path, out: Path, body: str, name: str = "test_gpu_demo.py", *args: str) -> None:
    """Run pytest on a module ``name`` holding ``body`` (alone in its folder) and write its JUnit XML to ``out``; the
    test ids (``pkg.tests.<module>``) are the same for every report, as a checkout's are. The folder has its own
    ini file so that pytest's rootdir is that folder even when ``tmp`` lies inside a checkout (CI's basetemp under
    ``.nox/``), whose pyproject.toml would otherwise make the ids carry the temporary path. ``args`` go to pytest
    (``-o junit_suite_name=gpu <card>``, as ci/gpu/env.sh's ``gpu_card_opt``)."""
    root = tmp / out.stem
    mod = root / "pkg" / "tests"
    mod.mkdir(parents=True, exist_ok=True)
    (mod / name).write_text(body)
    (root / "pytest.ini").write_text("[pytest]\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-c",
            str(root / "pytest.ini"),
            f"--rootdir={root}",
            f"--junitxml={out}",
            *args,
            str(mod),
        ],
        cwd=root,
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
@pytest.mark.xfail(reason="known")
def test_d(): assert False
class TestOne:
    def test_same(self): pass
class TestTwo:
    def test_same(self): pass
"""
#: test_b fixed, test_c removed
SKIPPED_C = '@pytest.mark.skip(reason="no GPU of that kind")\ndef test_c(): pass\n'
LATER = FIRST.replace("assert False", "pass", 1).replace(SKIPPED_C, "")
#: a step that selects other jobs: test_a and test_b skipped (as QUANTPACK_GPU_JOBS skips the jobs it leaves out)
SELECTED = LATER.replace("def test_a", '@pytest.mark.skip(reason="not selected")\ndef test_a').replace(
    "def test_b", '@pytest.mark.skip(reason="not selected")\ndef test_b'
)


def test_cells_count_outcomes_per_release_and_newest_report_wins_but_for_its_skips(tmp_path):
    tool = load_tool()
    reports = tmp_path / "reports"
    reports.mkdir()
    report(tmp_path, reports / "vllm-0.22.1-20261203-100000.xml", FIRST)
    report(tmp_path, reports / "vllm-0.25.1-20261203-100000.xml", FIRST)
    # run again by a pending.sh step (its name after the time), test_b fixed and test_c removed since
    report(tmp_path, reports / "vllm-0.25.1-20261203-120000-e2e-dense.xml", LATER)
    # then a step that selected the other tests: test_a and test_b keep e2e-dense's outcomes
    report(tmp_path, reports / "vllm-0.25.1-20261203-130000-e2e-moe.xml", SELECTED)
    # a module that does not import on 0.26.0
    report(tmp_path, reports / "vllm-0.26.0-20261203-100000.xml", "import no_such_module_here\n", "test_gpu_other.py")
    results = tool.collect([reports])
    text = tool.table(results, ["0.22.1", "0.25.1", "0.26.0"])
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()]
    rows = {row[0]: row[1:] for row in cells}
    # the two classes' test_same count twice; test_d is an expected failure
    assert rows["`test_gpu_demo.py`"] == [
        "3 passed, 1 failed, 1 xfailed, 1 skipped",
        "4 passed, 1 xfailed (step e2e-dense, e2e-moe)",
        "not run",
    ]
    assert rows["`test_gpu_other.py`"] == ["not run", "not run", "1 failed"]
    assert tool.main([str(reports)]) == 1  # 0.22.1 still has a failure
    brief = tool.table(results, ["0.25.1"], steps=False)  # the README's copy: no step names
    assert "| `test_gpu_demo.py` | 4 passed, 1 xfailed |" in brief.splitlines()


def test_a_cell_names_the_cards_its_outcomes_ran_on(tmp_path):
    """The card a report names (pytest's suite name ``gpu <card>``) follows each test's counted outcome: a test a
    later step skipped keeps the card of the run that selected it; a report that names no card (those from before
    cards were recorded) adds none, and a test it re-ran drops the older report's card."""
    tool = load_tool()
    reports = tmp_path / "reports"
    reports.mkdir()
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    report(tmp_path, reports / "vllm-0.25.1-20261203-120000-e2e-dense.xml", LATER, "test_gpu_demo.py",
           "-o", f"junit_suite_name=gpu {h100}")  # fmt: skip
    report(tmp_path, reports / "vllm-0.25.1-20261203-130000-e2e-moe.xml", SELECTED, "test_gpu_demo.py",
           "-o", f"junit_suite_name=gpu {h200}")  # fmt: skip
    report(tmp_path, reports / "vllm-0.26.0-20261203-100000.xml", LATER, "test_gpu_demo.py",
           "-o", f"junit_suite_name=gpu {h100}")  # fmt: skip
    report(tmp_path, reports / "vllm-0.26.0-20261203-110000.xml", LATER)  # names no card, re-runs every test
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")[1:]]
        for line in tool.table(tool.collect([reports]), ["0.25.1", "0.26.0"], steps=False).splitlines()
    }
    # test_a and test_b from e2e-dense (H100), the rest from e2e-moe (H200); 0.26.0's newest run names no card
    assert rows["`test_gpu_demo.py`"] == [f"4 passed, 1 xfailed on {h100}, {h200}", "4 passed, 1 xfailed"]


def test_a_broken_report_is_named(tmp_path):
    tool = load_tool()
    (tmp_path / "vllm-0.26.0-20261203-100000.xml").write_text("<testsuites><testcase")
    try:
        tool.collect([tmp_path])
    except SystemExit as e:
        assert "vllm-0.26.0-20261203-100000.xml" in str(e) and "not a JUnit XML report" in str(e)
    else:
        raise AssertionError("a truncated report was accepted")


def test_a_run_that_skipped_everything_is_flagged_and_odd_files_named(tmp_path, capsys):
    """A newest report that skipped all of a file's tests (no GPU visible, say) keeps the older outcomes but says so;
    a folder or a misnamed file among the reports is left out with a line on stderr (not a traceback); failures of
    a release outside ``--versions`` set the exit code and are named; a missing folder is named."""
    tool = load_tool()
    reports = tmp_path / "reports"
    reports.mkdir()
    report(tmp_path, reports / "vllm-0.25.1-20261203-100000.xml", LATER)
    every = 'import pytest\npytestmark = pytest.mark.skip(reason="no CUDA")\n' + LATER
    report(tmp_path, reports / "vllm-0.25.1-20261203-110000-e2e-dense.xml", every)
    report(tmp_path, reports / "vllm-0.24.0-20261203-100000.xml", FIRST)  # test_b fails there
    (reports / "vllm-0.25.1-20261203-120000.xml.d").mkdir()
    (reports / "vllm-0.25.1-20261203-130000-x.xml").mkdir()  # a folder named as a report
    (reports / "vllm-0.26.0rc1-20261203-100000.xml").write_text("<testsuites/>")
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")[1:]]
        for line in tool.table(tool.collect([reports]), ["0.25.1"]).splitlines()
    }
    assert rows["`test_gpu_demo.py`"] == ["4 passed, 1 xfailed; the newest run (e2e-dense) skipped all"]
    assert "vllm-0.26.0rc1-20261203-100000.xml: not named" in capsys.readouterr().err
    assert tool.main([str(reports), "--versions", "0.25.1"]) == 1
    assert "failures in releases not in --versions: 0.24.0" in capsys.readouterr().err
    try:
        tool.collect([tmp_path / "absent"])
    except SystemExit as e:
        assert "absent: no such folder" in str(e)
    else:
        raise AssertionError("a missing folder was read as an empty one")


def test_a_test_is_named_alike_from_any_rootdir():
    """The folders above the test module in a report's classname depend on pytest's rootdir (a checkout, or a
    temporary folder inside one): the test id starts at the module."""
    import xml.etree.ElementTree as ET

    tool = load_tool()
    ids = {
        tool.test_id(ET.fromstring(f'<testcase classname="{c}" name="test_y[a.b]"/>'))
        for c in (
            "packages.quantpack-exl3.tests.test_x.TestC",
            "tmp.test_run0.packages.quantpack-exl3.tests.test_x.TestC",
        )
    }
    assert ids == {"test_x.TestC::test_y[a.b]"}
    # a module that failed to import: empty classname, the module as the name, dotted or as a path
    ids = {
        tool.test_id(ET.fromstring(f'<testcase classname="" name="{n}"/>'))
        for n in ("packages.tests.test_x", "tmp.test_run0.packages.tests.test_x", "packages/tests/test_x.py")
    }
    assert ids == {"test_x::(collection)"}
