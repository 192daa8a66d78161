"""The GPU tier's vLLM matrix as a Markdown table: test file x vLLM release -> passed / failed / skipped.

Reads the JUnit XML reports ``nox -s gpu-tests`` and ``ci/gpu/pending.sh``'s steps write
(``vllm-<release>-<time>[-<step>].xml``, in ``$QUANTPACK_GPU_RESULTS``, default ``/tmp/gpu-matrix``, or the folders
given); where a test ran in several reports of one release, the newest
report's outcome counts. A release with no report is "not run". Usage (after copying the reports back from the GPU
machine): ``python3 ci/gpu/matrix_table.py DIR... [--versions 0.22.1,0.25.1,0.26.0]``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

REPORT = re.compile(r"vllm-(?P<version>\d+\.\d+\.\d+)-(?P<stamp>\d{8}-\d{6})(-[\w.-]+)?\.xml$")


def test_file(case: ET.Element) -> str:
    """The test file of one JUnit ``testcase`` (pytest writes the module path, dotted, as its ``classname``)."""
    parts = case.get("classname", "").split(".")
    mods = [p for p in parts if p.startswith("test_")]
    return f"{mods[0]}.py" if mods else case.get("classname", "?")


def outcome(case: ET.Element) -> str:
    """``passed``, ``failed`` (a failure or an error) or ``skipped``."""
    if case.find("failure") is not None or case.find("error") is not None:
        return "failed"
    if case.find("skipped") is not None:
        return "skipped"
    return "passed"


def collect(folders: list[Path]) -> dict[str, dict[str, str]]:
    """``{release: {test id: outcome}}`` over every report in ``folders``, newer reports overriding older ones.

    Raises:
        SystemExit: a report that is not JUnit XML (its path named).
    """
    reports = sorted(
        (m["version"], m["stamp"], f) for d in folders for f in d.glob("vllm-*.xml") if (m := REPORT.search(f.name))
    )
    out: dict[str, dict[str, str]] = {}
    for version, _, path in reports:
        try:
            root = ET.parse(path).getroot()
        except ET.ParseError as e:
            raise SystemExit(f"{path}: not a JUnit XML report ({e})") from e
        for case in root.iter("testcase"):
            key = f"{test_file(case)}::{case.get('name')}"
            out.setdefault(version, {})[key] = outcome(case)
    return out


def table(results: dict[str, dict[str, str]], versions: list[str]) -> str:
    """The Markdown table: one row per test file seen in any release, one column per release."""
    files = sorted({k.split("::")[0] for r in results.values() for k in r})
    lines = ["| test file | " + " | ".join(f"vLLM {v}" for v in versions) + " |", "|---" * (len(versions) + 1) + "|"]
    for f in files:
        cells = []
        for v in versions:
            counts = Counter(o for k, o in results.get(v, {}).items() if k.split("::")[0] == f)
            cells.append(
                ", ".join(f"{counts[o]} {o}" for o in ("passed", "failed", "skipped") if counts[o]) or "not run"
            )
        lines.append(f"| `{f}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the table; exit 1 when any test failed in any release."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="*", type=Path)
    ap.add_argument("--versions", default="0.22.1,0.25.1,0.26.0")
    args = ap.parse_args(argv)
    folders = args.folders or [Path(os.environ.get("QUANTPACK_GPU_RESULTS", "/tmp/gpu-matrix"))]
    results = collect(folders)
    print(table(results, args.versions.split(",")))
    return int(any(o == "failed" for r in results.values() for o in r.values()))


if __name__ == "__main__":
    sys.exit(main())
