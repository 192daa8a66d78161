"""The GPU tier's vLLM matrix as a Markdown table: test file x vLLM release -> passed / failed / xfailed / skipped.

Reads the JUnit XML reports ``nox -s gpu-tests`` and ``ci/gpu/pending.sh``'s steps write
(``vllm-<release>-<time>[-<step>].xml``, in ``$QUANTPACK_GPU_RESULTS``, default ``/tmp/gpu-matrix``, or the folders
given). For each release and test file the newest report that ran the file counts, except that a test it skipped
keeps an older report's outcome (a step that selects jobs by ``QUANTPACK_GPU_JOBS`` skips the others: ``e2e-moe``
after ``e2e-dense`` gives both halves of ``test_exl3_gpu_vllm.py``); a release with no report of a file is "not run"
there; a module that failed to import counts as one failed test of its file. A cell names the ``pending.sh`` steps
its outcomes came from (``(step linear-kernels)``): a step may run a selection of the file (``-k``,
``QUANTPACK_GPU_JOBS``), which ci/gpu/pending.sh states per step. Usage (the reports
kept in ``ci/gpu/results/``): ``python3 ci/gpu/matrix_table.py ci/gpu/results [--versions 0.22.1,0.25.1,0.26.0]``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

REPORT = re.compile(r"vllm-(?P<version>\d+\.\d+\.\d+)-(?P<stamp>\d{8}-\d{6})(-(?P<step>[\w.-]+))?\.xml$")


def test_file(case: ET.Element) -> str:
    """The test file of one JUnit ``testcase``: pytest writes the module path, dotted, as its ``classname`` (with
    any class after it), and for a module that failed to import an empty ``classname`` and the module as ``name``.
    The module is the last ``test_`` part: folders above it may be named ``test_...`` too (pytest's own temporary
    folders are)."""
    where = case.get("classname") or case.get("name", "")
    mods = [p for p in re.split(r"[./]", where) if p.startswith("test_")]
    return f"{mods[-1]}.py" if mods else where or "?"


def outcome(case: ET.Element) -> str:
    """``passed``, ``failed`` (a failure or an error, a collection error included), ``xfailed`` or ``skipped``
    (a non-strict unexpected pass counts as passed)."""
    if case.find("failure") is not None or case.find("error") is not None:
        return "failed"
    skipped = case.find("skipped")
    if skipped is not None:
        return "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"
    return "passed"


def collect(folders: list[Path]) -> dict[str, dict[str, dict[str, str]]]:
    """``{release: {test file: {test id: outcome}}}``: for each release and test file, the outcomes of the newest
    report that ran that file (so a test renamed or removed since drops out), where it skipped a test that an older
    report ran, the older outcome; the pending steps those outcomes came from (comma-separated, in test order) under
    the test id ``STEP`` (:data:`STEP`).

    Raises:
        SystemExit: a report that is not JUnit XML (its path named).
    """
    reports = sorted(
        (m["version"], m["stamp"], m["step"], f)
        for d in folders
        for f in d.glob("vllm-*.xml")
        if (m := REPORT.search(f.name))
    )
    sources: dict[str, dict[str, dict[str, tuple[str, str | None]]]] = {}  # release -> file -> id -> (outcome, step)
    for version, _, step, path in reports:  # oldest first: a newer report's files replace the older ones'
        try:
            root = ET.parse(path).getroot()
        except ET.ParseError as e:
            raise SystemExit(f"{path}: not a JUnit XML report ({e})") from e
        ran: dict[str, dict[str, tuple[str, str | None]]] = {}
        for case in root.iter("testcase"):
            key = f"{case.get('classname', '')}::{case.get('name')}"
            ran.setdefault(test_file(case), {})[key] = (outcome(case), step)
        files = sources.setdefault(version, {})
        for name, cases in ran.items():
            before = files.get(name, {})
            for key, (result, _) in cases.items():
                if result == "skipped" and before.get(key, ("skipped",))[0] != "skipped":
                    cases[key] = before[key]  # not selected this time: the run that selected it counts
            files[name] = cases
    out: dict[str, dict[str, dict[str, str]]] = {}
    for version, files in sources.items():
        for name, cases in files.items():
            cell = out.setdefault(version, {}).setdefault(name, {k: o for k, (o, _) in cases.items()})
            steps = list(dict.fromkeys(s for _, s in cases.values() if s))
            if steps:
                cell[STEP] = ", ".join(steps)
    return out


OUTCOMES = ("passed", "failed", "xfailed", "skipped")
#: the key under which :func:`collect` keeps the pending step a file's report came from (not a test id: no ``::``)
STEP = "step"


def table(results: dict[str, dict[str, dict[str, str]]], versions: list[str]) -> str:
    """The Markdown table: one row per test file seen in any release, one column per release."""
    files = sorted({f for r in results.values() for f in r})
    lines = ["| test file | " + " | ".join(f"vLLM {v}" for v in versions) + " |", "|---" * (len(versions) + 1) + "|"]
    for f in files:
        cells = []
        for v in versions:
            cases = dict(results.get(v, {}).get(f, {}))
            step = cases.pop(STEP, None)
            counts = Counter(cases.values())
            cell = ", ".join(f"{counts[o]} {o}" for o in OUTCOMES if counts[o])
            cells.append(f"{cell} (step {step})" if cell and step else cell or "not run")
        lines.append(f"| `{f}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def installed_release() -> str:
    """The vLLM release this interpreter imports (``0.25.1``; a local version's ``+...`` dropped), ``none`` without
    vLLM: the release the GPU tier's reports are named by (``noxfile.py``'s ``gpu-tests``, ``ci/gpu/env.sh``)."""
    from importlib import metadata

    try:
        return metadata.version("vllm").split("+")[0]
    except metadata.PackageNotFoundError:
        return "none"


def main(argv: list[str] | None = None) -> int:
    """Print the table; exit 1 when any test failed in any release. ``--release`` prints :func:`installed_release`
    instead."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="*", type=Path)
    ap.add_argument("--versions", default="0.22.1,0.25.1,0.26.0")
    ap.add_argument("--release", action="store_true", help="print the vLLM release installed here and exit")
    args = ap.parse_args(argv)
    if args.release:
        print(installed_release())
        return 0
    folders = args.folders or [Path(os.environ.get("QUANTPACK_GPU_RESULTS", "/tmp/gpu-matrix"))]
    results = collect(folders)
    print(table(results, args.versions.split(",")))
    return int(any(o == "failed" for r in results.values() for f in r.values() for k, o in f.items() if k != STEP))


if __name__ == "__main__":
    sys.exit(main())
