"""ci/gpu/matrix_table.py on records the GPU tier's writer itself writes (tests/gpu_records.py): per-release cells of
test outcomes and job figures, "not run" for a test of the tree no record ran, a failure standing until a later
record on the same card passes, the generated blocks, and a run's records taken from ci/gpu/run.py --collect's
archive."""

from __future__ import annotations

import importlib.util
import json
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def load_tool():
    """ci/gpu/matrix_table.py as a module (registered, as its dataclasses need)."""
    spec = importlib.util.spec_from_file_location("matrix_table", ROOT / "ci" / "gpu" / "matrix_table.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"


def write_run(
    monkeypatch,
    records: Path,
    stamp: str,
    card: str,
    commit: str,
    tests: dict,
    jobs: dict,
    vllm: str = "0.25.1",
    step: str = "matrix",
) -> None:
    """One GPU run's records through the writer: ``tests`` ``{node id: outcome}``, ``jobs`` ``{job: KL}`` (each a
    job of test_gpu_demo.py checked against a 1e-3 ceiling), as vLLM ``vllm`` (``none``: no vLLM installed) on
    ``card`` at ``commit``, in the run's ``step`` (ci/gpu/run.py's job)."""
    import gpu_records
    from e2e_bounds import Bound

    monkeypatch.setenv("QUANTPACK_GPU_RECORDS", str(records))
    monkeypatch.setattr(gpu_records, "_STARTED", stamp)
    where = {"card": card, "vllm": vllm, "torch": "2.11.0+cu130", "commit": commit, "step": step}
    monkeypatch.setattr(gpu_records, "environment", lambda: where)
    gpu_records.write_outcomes(tests)
    for job, kl in jobs.items():
        rec = gpu_records.job_of("pkg/tests/test_gpu_demo.py::test_job", job, {"kl": kl, "top1": 1.0})
        rec.check("kl", kl, Bound(1e-3, "<=", 5e-5, "measured"))
        rec.write()


A, B = "pkg/tests/test_gpu_demo.py", "pkg/tests/test_gpu_other.py"
#: the tree's GPU tests now: test_new never ran, test_gpu_never.py has no record at all
TREE = [
    *(f"test_gpu_demo.py::{t}" for t in ("test_a", "test_b", "test_c", "test_new")),
    "test_gpu_other.py::test_d",
    "test_gpu_never.py::test_e",
]


@pytest.fixture
def records(tmp_path, monkeypatch):
    """Two runs: on the H200 test_b and the job fail; then on the H100 both pass, test_a not selected (skipped)."""
    root = tmp_path / "records"
    first = {f"{A}::test_a": "passed", f"{A}::test_b": "failed", f"{A}::test_c": "skipped", f"{B}::test_d": "passed"}
    write_run(monkeypatch, root, "20261206-100000", H200, "a" * 40, first, {"moe/pack/eager": 0.5})
    second = {f"{A}::test_a": "skipped", f"{A}::test_b": "passed", f"{A}::test_c": "skipped"}
    write_run(monkeypatch, root, "20261206-110000", H100, "b" * 40, second, {"moe/pack/eager": 1e-5})
    return root


def test_a_failure_stands_until_the_same_card_passes_and_untested_tests_are_not_run(records, monkeypatch):
    tool = load_tool()
    loaded = tool.load(records)
    made = tool.blocks(loaded, ["0.25.1", "0.26.0"], TREE)
    rows = {line.split("|")[1].strip(): line for line in made["files-brief"].splitlines()[2:]}
    assert rows["`test_gpu_demo.py`"] == "| `test_gpu_demo.py` | 1 failed, 1 passed, 1 skipped, 1 not run | not run |"
    assert rows["`test_gpu_other.py`"] == "| `test_gpu_other.py` | 1 passed | not run |"
    assert rows["`test_gpu_never.py`"] == "| `test_gpu_never.py` | not run | not run |"
    assert "aaaaaaa" in made["files"] and "bbbbbbb" in made["files"] and H100 in made["files"]
    assert "`test_gpu_demo.py::test_b`: failed on aaaaaaa" in made["files"] and H200 in made["files"]
    job = next(line for line in made["jobs"].splitlines() if "moe/pack/eager" in line)
    assert "**failed**: kl 0.5 (<= 0.001)" in job and "aaaaaaa" in job and job.endswith("| not run |"), job
    assert tool.main(["--records", str(records), "--tests", str(write_tree(records.parent))]) == 1
    # a later pass on the H200 clears the failure; the job's newest record is then a pass on each card
    write_run(
        monkeypatch, records, "20261206-120000", H200, "c" * 40, {f"{A}::test_b": "passed"}, {"moe/pack/eager": 2e-5}
    )
    made = tool.blocks(tool.load(records), ["0.25.1"], TREE)
    assert "| `test_gpu_demo.py` | 2 passed, 1 skipped, 1 not run |" in made["files-brief"]
    assert "Failed" not in made["files"]
    job = next(line for line in made["jobs"].splitlines() if "moe/pack/eager" in line)
    assert job.startswith("| `test_gpu_demo.py::moe/pack/eager` | passed: kl 2e-05 (<= 0.001)") and "ccccccc" in job
    assert tool.main(["--records", str(records), "--tests", str(write_tree(records.parent))]) == 0


def two_commits() -> tuple[str, str]:
    """This checkout's HEAD and its parent (the history a pass's commit is judged by)."""
    import subprocess

    done = subprocess.run(["git", "rev-parse", "HEAD", "HEAD~1"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip("the checkout holds no parent of HEAD (a shallow clone): no history to judge commits by")
    new, old = done.stdout.split()
    return new, old


def test_a_failure_stands_until_its_own_job_passes_it_at_its_code_or_newer(tmp_path, monkeypatch):
    """A test that failed in one job (the tier's ``families``) stands after another job passes the same test id with
    its own selection (``families-converter``: other packs), and after a later run of older code (the failing
    commit's parent) passes it; the job's own pass at that commit clears it, the first runner's ``tier-<job>`` steps
    counting as the job."""
    tool = load_tool()
    new, old = two_commits()
    root = tmp_path / "records"
    test, tree = f"{A}::test_a", ["test_gpu_demo.py::test_a"]

    def cell(stamp, commit, step, outcome):
        write_run(monkeypatch, root, stamp, H100, commit, {test: outcome}, {}, step=step)
        return tool.blocks(tool.load(root), ["0.25.1"], tree)["files-brief"]

    assert "1 failed" in cell("20261206-100000", new, "tier-families", "failed")
    assert "1 failed" in cell("20261206-101000", new, "families-converter", "passed")
    assert "1 failed" in cell("20261206-102000", old, "families", "passed")
    assert "1 passed" in cell("20261206-103000", new, "families", "passed")


def test_an_expected_failure_after_a_failure_does_not_clear_it(records, monkeypatch):
    """test_b failed on the H200: a later run there where it is an expected failure keeps the failure in the cells
    and the failure list; only a pass on the H200 clears it."""
    tool = load_tool()
    write_run(monkeypatch, records, "20261206-120000", H200, "c" * 40, {f"{A}::test_b": "xfailed"}, {})
    made = tool.blocks(tool.load(records), ["0.25.1"], TREE)
    assert "| `test_gpu_demo.py` | 1 failed, 1 passed, 1 skipped, 1 not run |" in made["files-brief"]
    assert "`test_gpu_demo.py::test_b`: failed on aaaaaaa" in made["files"]
    write_run(monkeypatch, records, "20261206-130000", H200, "d" * 40, {f"{A}::test_b": "passed"}, {})
    made = tool.blocks(tool.load(records), ["0.25.1"], TREE)
    assert "| `test_gpu_demo.py` | 2 passed, 1 skipped, 1 not run |" in made["files-brief"]


def test_a_file_that_imports_again_clears_its_import_failure(records, monkeypatch):
    """test_gpu_other.py failed to import on the H100 (its ``(collection)`` id failed); a later H100 run where its
    test ran clears the failure from the failure list."""
    tool = load_tool()
    write_run(monkeypatch, records, "20261206-120000", H100, "c" * 40, {f"{B}::(collection)": "failed"}, {})
    made = tool.blocks(tool.load(records), ["0.25.1"], TREE)
    assert "`test_gpu_other.py::(collection)`: failed on ccccccc" in made["files"]
    write_run(monkeypatch, records, "20261206-130000", H100, "d" * 40, {f"{B}::test_d": "passed"}, {})
    made = tool.blocks(tool.load(records), ["0.25.1"], TREE)
    assert "(collection)" not in made["files"] and "| `test_gpu_other.py` | 1 passed |" in made["files-brief"]


def write_tree(folder: Path) -> Path:
    path = folder / "tests.txt"
    path.write_text("\n".join(TREE) + "\n")
    return path


def test_a_run_without_vllm_gets_a_column_of_its_own(records, monkeypatch, capsys):
    """A file whose tests import no vLLM (kernels, codecs) run where none is installed: its records are release
    ``none``, shown in a "without vLLM" column after the releases, never in a release's."""
    tool = load_tool()
    write_run(monkeypatch, records, "20261206-130000", H100, "d" * 40, {f"{B}::test_d": "passed"}, {}, vllm="none")
    assert (
        tool.main(["--records", str(records), "--tests", str(write_tree(records.parent)), "--versions", "0.26.0"]) == 0
    )
    header, _, *rows = capsys.readouterr().out.split("\n\n")[0].splitlines()
    assert header == "| test file | vLLM 0.26.0 | without vLLM |", header
    assert "| `test_gpu_other.py` | not run | 1 passed (ddddddd NVIDIA H100 80GB HBM3) |" in rows, rows
    assert "| `test_gpu_never.py` | not run | not run |" in rows, rows


def test_without_a_test_list_the_records_name_the_tests(records):
    tool = load_tool()
    made = tool.blocks(tool.load(records), ["0.25.1"], None)
    assert "| `test_gpu_demo.py` | 1 failed, 1 passed, 1 skipped |" in made["files-brief"]
    assert "test_gpu_never.py" not in made["files-brief"]


def test_no_record_is_not_run_everywhere(tmp_path):
    tool = load_tool()
    (tmp_path / "records").mkdir()
    made = tool.blocks(tool.load(tmp_path / "records"), ["0.25.1"], TREE)
    assert "| `test_gpu_demo.py` | not run |" in made["files-brief"] and made["jobs"] == "No job has a record yet."


def test_blocks_are_written_between_their_markers(tmp_path):
    tool = load_tool()
    text = "intro\n<!-- matrix_table.py files-brief -->\nold table\n<!-- matrix_table.py end -->\nafter\n"
    assert tool.markdown_blocks.rewrite(text, tool.TOOL, "files-brief", "| new |") == (
        "intro\n<!-- matrix_table.py files-brief -->\n| new |\n<!-- matrix_table.py end -->\nafter\n"
    )
    with pytest.raises(SystemExit, match=r"no single '<!-- matrix_table\.py jobs -->'"):
        tool.markdown_blocks.rewrite(text, tool.TOOL, "jobs", "x")


def test_a_run_s_records_are_taken_from_the_collected_archive(records, tmp_path, capsys):
    tool = load_tool()
    archive = tmp_path / "gpu-run.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(records, arcname="gpu-matrix/records")
        tar.add(ROOT / "README.md", arcname="gpu-run/e2e-llama.log")  # the logs beside them are no records
    dest = tmp_path / "kept"
    copied = tool.take(archive, dest)
    assert sorted(p.relative_to(dest).as_posix() for p in copied) == sorted(
        p.relative_to(records).as_posix() for p in records.rglob("*.json")
    )
    assert tool.take(archive, dest)  # the same records again: left as they are
    stray = dest / "vllm-0.25.1" / "notes.json"
    stray.write_text(json.dumps({"kind": "job"}))
    assert len(tool.load(dest)) == len(copied)
    assert "notes.json: not a record" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no record"):
        tool.take(tmp_path / "empty", dest)


SUPPORT = """
[[row]]
what = "demo packs"
cpu = "served (`test_demo`)"
gpu = ["test_gpu_demo.py::test_a", "test_gpu_demo.py::test_b", "test_gpu_other.py"]

[[row]]
what = "never run"
cpu = "yes"
gpu = ["test_gpu_never.py"]

[[row]]
what = "no GPU test"
cpu = "yes"
gpu_note = "not in these releases"
"""


def test_the_support_table_counts_the_named_tests_per_release_and_card(records, tmp_path):
    tool = load_tool()
    support = tmp_path / "support.toml"
    support.write_text(SUPPORT)
    made = tool.blocks(tool.load(records), ["0.25.1", "0.26.0"], TREE, support)
    rows = made["support"].splitlines()[2:]
    # test_a passed on the H200 (skipped later on the H100), test_b failed on the H200, test_d passed there
    assert rows[0] == "| demo packs | served (`test_demo`) | 0.25.1, H100 / H200: 1 failed, 2 passed |"
    assert rows[1] == "| never run | yes | not run |"
    assert rows[2] == "| no GPU test | yes | not in these releases |"


def test_check_regenerates_every_table_from_the_kept_test_list():
    """The committed tables equal what the committed records and test list give (README, docs/testing.md,
    docs/results.md)."""
    tool = load_tool()
    assert tool.main(["--check"]) == 0
