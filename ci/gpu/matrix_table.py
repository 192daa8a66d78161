"""The GPU tier's vLLM matrix as a Markdown table: test file x vLLM release -> passed / failed / xfailed / skipped.

Reads the JUnit XML reports ``nox -s gpu-tests`` and ``ci/gpu/pending.sh``'s steps write
(``vllm-<release>-<time>[-<step>].xml``, in ``$QUANTPACK_GPU_RESULTS``, default ``/tmp/gpu-matrix``, or the folders
given). For each release and test file the newest report that ran the file counts, except that a test it skipped
keeps an older report's outcome (a step that selects jobs by ``QUANTPACK_GPU_JOBS`` skips the others: ``e2e-moe``
after ``e2e-dense`` gives both halves of ``test_exl3_gpu_vllm.py``); a release with no report of a file is "not run"
there; a module that failed to import counts as one failed test of its file. A cell names the ``pending.sh`` steps
its outcomes came from (``(step linear-kernels)``) and, where its reports name it (``junit_suite_name=gpu <card>``, set
by ``ci/gpu/env.sh``'s ``gpu_card_opt`` and the nox session; the reports from before 2026-12-05 name none: all of
them ran on an H200), the card (``on NVIDIA H100 80GB HBM3``): a step may run a selection of the file (``-k``,
``QUANTPACK_GPU_JOBS``), which ci/gpu/pending.sh states per step; ``--no-steps`` leaves the step names out (the
README's copy). Usage (the reports kept in ``ci/gpu/results/``): ``python3 ci/gpu/matrix_table.py ci/gpu/results
[--versions 0.22.1,0.25.1,0.26.0] [--no-steps]``.
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


def test_id(case: ET.Element) -> str:
    """A ``testcase``'s id from its test module on (``test_x.TestClass::test_y``): the folders above the module in
    ``classname`` depend on where pytest's rootdir was, so reports of one test from two checkouts (or from a
    temporary folder inside one) name it alike. A module that failed to import (an empty ``classname``, the module's
    path as ``name``) is ``test_x::(collection)``, named alike from any rootdir too."""
    classname = case.get("classname")
    if not classname:
        return f"{test_file(case).removesuffix('.py')}::(collection)"
    parts = classname.split(".")
    mods = [i for i, p in enumerate(parts) if p.startswith("test_")]
    return f"{'.'.join(parts[mods[-1] :] if mods else parts)}::{case.get('name')}"


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
    the test id ``STEP`` (:data:`STEP`); the cards they ran on, where the reports name them, under :data:`CARD`;
    where the newest report of a file skipped every test of it (a run that could not select any, e.g. without a
    visible GPU), that report under :data:`RAN_NONE`. A file named ``vllm-*.xml`` that is not named as a report is
    reported on stderr and left out.

    Raises:
        SystemExit: a folder that does not exist, or a report that is not JUnit XML (its path named).
    """
    for d in folders:
        if not d.is_dir():
            raise SystemExit(f"{d}: no such folder of GPU test reports")
    found = [f for d in folders for f in d.glob("vllm-*.xml") if f.is_file()]
    for f in found:
        if not REPORT.search(f.name):
            print(f"{f}: not named vllm-<release>-<YYYYMMDD-HHMMSS>[-<step>].xml, left out", file=sys.stderr)
    reports = sorted((m["version"], m["stamp"], m["step"], f) for f in found if (m := REPORT.search(f.name)))
    ran_none: dict[str, dict[str, str]] = {}  # release -> file -> the newest report that skipped all of it
    # release -> file -> test id -> (outcome, step, card)
    sources: dict[str, dict[str, dict[str, tuple[str, str | None, str | None]]]] = {}
    for version, _, step, path in reports:  # oldest first: a newer report's files replace the older ones'
        try:
            root = ET.parse(path).getroot()
        except ET.ParseError as e:
            raise SystemExit(f"{path}: not a JUnit XML report ({e})") from e
        ran: dict[str, dict[str, tuple[str, str | None, str | None]]] = {}
        for suite in root.iter("testsuite"):
            name = suite.get("name", "")
            card = name.removeprefix("gpu ") if name.startswith("gpu ") else None
            for case in suite.iter("testcase"):
                ran.setdefault(test_file(case), {})[test_id(case)] = (outcome(case), step, card)
        files = sources.setdefault(version, {})
        for name, cases in ran.items():
            before = files.get(name, {})
            if all(result == "skipped" for result, *_ in cases.values()):
                ran_none.setdefault(version, {})[name] = step or path.name
            else:
                ran_none.get(version, {}).pop(name, None)
            for key, (result, *_) in cases.items():
                if result == "skipped" and before.get(key, ("skipped",))[0] != "skipped":
                    cases[key] = before[key]  # not selected this time: the run that selected it counts
            files[name] = cases
    out: dict[str, dict[str, dict[str, str]]] = {}
    for version, files in sources.items():
        for name, cases in files.items():
            cell = out.setdefault(version, {})[name] = {k: o for k, (o, *_) in cases.items()}
            steps = list(dict.fromkeys(s for _, s, _ in cases.values() if s))
            if steps:
                cell[STEP] = ", ".join(steps)
            used = list(dict.fromkeys(c for _, _, c in cases.values() if c))
            if used:
                cell[CARD] = ", ".join(used)
            if name in ran_none.get(version, {}):
                cell[RAN_NONE] = ran_none[version][name]
    return out


OUTCOMES = ("passed", "failed", "xfailed", "skipped")
#: the key under which :func:`collect` keeps the pending step a file's report came from (not a test id: no ``::``)
STEP = "step"
#: the key under which :func:`collect` keeps the cards a file's outcomes ran on, where their reports name them
CARD = "card"
#: the key under which :func:`collect` names a file's newest report when that report skipped all of the file's tests
RAN_NONE = "ran none"


def table(results: dict[str, dict[str, dict[str, str]]], versions: list[str], steps: bool = True) -> str:
    """The Markdown table: one row per test file seen in any release, one column per release; ``steps=False`` leaves
    the cells' ``(step ...)`` out (the README's copy)."""
    files = sorted({f for r in results.values() for f in r})
    lines = ["| test file | " + " | ".join(f"vLLM {v}" for v in versions) + " |", "|---" * (len(versions) + 1) + "|"]
    for f in files:
        cells = []
        for v in versions:
            cases = dict(results.get(v, {}).get(f, {}))
            step, none, card = cases.pop(STEP, None), cases.pop(RAN_NONE, None), cases.pop(CARD, None)
            counts = Counter(cases.values())
            cell = ", ".join(f"{counts[o]} {o}" for o in OUTCOMES if counts[o])
            cell = f"{cell} (step {step})" if cell and step and steps else cell or "not run"
            cell = f"{cell} on {card}" if card and counts else cell
            cells.append(f"{cell}; the newest run ({none}) skipped all" if none else cell)
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
    ap.add_argument("--no-steps", action="store_true", help="leave out which pending.sh step each cell came from")
    args = ap.parse_args(argv)
    if args.release:
        print(installed_release())
        return 0
    folders = args.folders or [Path(os.environ.get("QUANTPACK_GPU_RESULTS", "/tmp/gpu-matrix"))]
    results = collect(folders)
    versions = args.versions.split(",")
    print(table(results, versions, steps=not args.no_steps))
    failed = sorted({v for v, r in results.items() for f in r.values() for k, o in f.items() if _is_failure(k, o)})
    hidden = [v for v in failed if v not in versions]
    if hidden:
        print(f"failures in releases not in --versions: {', '.join(hidden)}", file=sys.stderr)
    return int(bool(failed))


def _is_failure(key: str, result: str) -> bool:
    """Whether a :func:`collect` entry is a failed test (not the step or ran-none note)."""
    return key not in (STEP, RAN_NONE, CARD) and result == "failed"


if __name__ == "__main__":
    sys.exit(main())
