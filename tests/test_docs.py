"""The README and docs describe what is: the README within 100 lines, 8 kB and 200 characters a line; every doc (the
README, docs/, the READMEs of ci/'s tools, the fixtures and the packages) within its size budget; no line of them
states a date (history goes to the packages' CHANGELOG.md, figures to records); nothing in the repository refers to
the folder beside it; and every table generated from the benchmark records equals what the records give (the GPU
tier's tables: ci/gpu/tests/test_gpu_matrix_table.py)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: bytes each doc may take; a doc without a budget fails (give it one here, in the commit that adds it)
BUDGETS = {
    "README.md": 8192,
    "docs/architecture.md": 17_000,
    "docs/escha-format.md": 10_500,
    "docs/exl3-format.md": 6_000,
    "docs/families.md": 35_000,
    "docs/install.md": 15_500,
    "docs/kernels.md": 26_000,
    "docs/moe-bank.md": 6_500,
    "docs/results.md": 40_000,
    "docs/testing.md": 11_500,
    "docs/troubleshooting.md": 32_000,
    "ci/gpu/README.md": 7_000,
    "ci/transfer/README.md": 2_000,
    "fixtures/README.md": 5_000,
    "packages/quantpack-core/README.md": 2_500,
    "packages/quantpack-escha-rocm/README.md": 2_500,
    "packages/quantpack-exl3/README.md": 3_000,
    "packages/quantpack-families/README.md": 1_200,
}
MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)[a-z]*\.?"
#: a calendar date: 2026-12-06, 2026/12/06, 20261206-054540, December 6, 6 December, Dec 2026, 2026-12
DATE = re.compile(
    rf"\b(?:19|20)\d\d[-/][01]\d(?:[-/][0-3]\d)?\b|\b20\d\d[01]\d[0-3]\d-\d{{6}}\b"
    rf"|\b{MONTH} \d{{1,4}}\b|\b\d{{1,2}} {MONTH}"
)
#: the folder beside a checkout, which a clone does not have
OUTSIDE = re.compile(r"\.\./shared|/work/shared|parent / \"shared\"")


def docs() -> list[Path]:
    """The README, docs/, and the READMEs of ci/'s tools, the fixtures and the packages."""
    readmes = [*(ROOT / "ci").glob("*/README.md"), *(ROOT / "packages").glob("*/README.md")]
    readmes.append(ROOT / "fixtures/README.md")
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(readmes)]


def tracked() -> list[Path]:
    """The repository's files (git's list where this is a clone, else every file outside build folders)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return [ROOT / name for name in out.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", ".nox", ".tools", ".stage", "__pycache__"}
        return [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 100, f"README.md: {len(lines)} lines (at most 100)"
    long = [f"line {i}: {len(line)} characters" for i, line in enumerate(lines, 1) if len(line) > 200]
    assert not long, f"README.md lines over 200 characters: {long}"


def test_every_doc_is_within_its_budget():
    sizes = {p.relative_to(ROOT).as_posix(): p.stat().st_size for p in docs()}
    missing = sorted(set(sizes) - set(BUDGETS))
    assert not missing, f"docs without a size budget in tests/test_docs.py: {missing}"
    over = {name: f"{size} > {BUDGETS[name]} bytes" for name, size in sizes.items() if size > BUDGETS[name]}
    assert not over, f"docs over their budget: {over}"


def test_no_doc_states_a_date():
    found = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()[:120]}"
        for p in docs()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if DATE.search(line)
    ]
    assert not found, "dates in the README or docs (history goes to a CHANGELOG.md):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    ["measured on 2026-12-02", "the run of December 5", "5 Dec, later", "records of 20261206-054540", "in 2026-12"],
)
def test_the_date_pattern_finds_dates(line):
    assert DATE.search(line)


@pytest.mark.parametrize("line", ["vLLM 0.22.1 - 0.26.0", "K 1-8, 128 x 2048", "torch 2.13.0+cpu", "may 2 rows"])
def test_the_date_pattern_leaves_versions_and_figures(line):
    assert not DATE.search(line)


def test_nothing_refers_to_the_folder_beside_the_checkout():
    me = Path(__file__).resolve()
    found = []
    for path in tracked():
        if path.resolve() == me or not path.is_file():
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        found += [
            f"{path.relative_to(ROOT)}:{i}" for i, line in enumerate(text.splitlines(), 1) if OUTSIDE.search(line)
        ]
    assert not found, f"references outside the repository (take such paths as arguments): {found}"


def test_the_benchmark_tables_are_what_the_records_give():
    spec = importlib.util.spec_from_file_location("results_page", ROOT / "benchmarks" / "results_page.py")
    page = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(page)
    assert page.stale() == [], "regenerate with: python3 benchmarks/results_page.py --write"


def test_a_kernel_the_run_skipped_has_no_line_in_the_stack_table():
    spec = importlib.util.spec_from_file_location("results_page", ROOT / "benchmarks" / "results_page.py")
    page = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(page)
    timed = {"stack_ms": {"1": 2.0, "64": 5.0}}
    record = {
        "kernels": {
            "trellis_mma": {**timed, "fused": timed},
            "trellis_mma_tc": {"skipped": "not a Hopper GPU"},
            "exllamav3": {"skipped": "its extension does not import"},
        },
        "dense_bf16": {"stack_ms": {"1": 3.0, "64": 3.5}},
        "dense_route_gemms": {"stack_ms": {"64": 3.6}, "default_sums_ms": {"64": 3.55}},
    }
    assert [label for label, _ in page.kernel_lines(record)] == [
        "`trellis_mma` fused",
        "`trellis_mma`",
        "dense bf16 (cuBLAS)",
        "the dense route's GEMMs alone (float16)",
        "the same, torch's default sums",
    ]


def test_the_kernel_benchmark_refuses_a_variant_named_as_a_kernel():
    """``trellis_mma_tc`` / ``trellis_mma_dense`` are lines of trellis_mma's own run: named in --kernels they would
    overwrite those lines with a skip."""
    import subprocess
    import sys

    script = ROOT / "benchmarks" / "kernel_8b.py"
    args = ["--kernels", "exllamav3,trellis_mma,trellis_mma_tc"]
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True)
    assert done.returncode == 2 and "trellis_mma_tc: timed within trellis_mma's run" in done.stderr, done.stderr
