"""The GPU tier's records (tests/gpu_records.py and the repository conftest's hooks) as a GPU run writes them: a pytest
run of a small module, the records folder set, writes a job record with every field the tables and a reader need and
a tests record with every test's outcome; without the folder set it writes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

MODULE = """
import pytest
import torch
from e2e_bounds import Bound
from quantpack_core.compare import outside_router_ties

KL = Bound(1e-3, "<=", 5e-5, "measured here")
TOP1 = Bound(0.9, ">=", 0.95, "measured here")


def test_moe_job(gpu_record):
    res = {"kl": 0.1, "kl_median": 1e-5, "kl_max": 0.4, "kl_worst": 1, "top1": 0.95, "top1_decided": 1.0,
           "positions": 4, "ties": 1, "kl_positions": [1e-5, 0.4, 2e-5, 1e-5]}
    rec = gpu_record("moe/pack/eager", res)
    kl = torch.tensor(res["kl_positions"], dtype=torch.float64)
    margins = torch.tensor([[0.2, 1e-3, 0.3, 0.2]], dtype=torch.float64)
    split = outside_router_ties(kl, margins, KL.limit)
    rec.outside_router_ties(split)
    rec.check("kl_outside_router_ties", split.kl, KL)
    rec.check("top1", res["top1"], TOP1)
    rec.assert_passed()


def test_failing_job(gpu_record):
    rec = gpu_record("dense/pack/eager", {"kl": 0.5, "top1": 0.5})
    rec.check("kl", 0.5, KL)
    rec.assert_passed()


def test_job_that_did_not_run(gpu_record):
    gpu_record("dense/other/eager", {"failed": "RuntimeError: engine core died"})


@pytest.mark.skip(reason="not selected")
def test_skipped():
    pass


@pytest.mark.xfail(reason="known", strict=True)
def test_expected_failure():
    assert False
"""


#: a test that changes, while it runs, what a record names (the commit and step variables, as an install beside it
#: changes the vLLM release)
LATE = """
import os
import time
from pathlib import Path


def test_changes_what_runs():
    Path("began.txt").write_text(time.strftime("%Y%m%d-%H%M%S"))
    os.environ.update(QUANTPACK_GPU_STEP="late", QUANTPACK_COMMIT="late")
    time.sleep(1.5)
"""


def run_module(tmp: Path, records: Path | None, module: str = MODULE) -> subprocess.CompletedProcess:
    """pytest on :data:`MODULE` (``test_gpu_demo.py``) with the repository's conftest.py as a plugin, records kept in
    ``records`` (none when None), as GPU step ``demo`` of commit ``abc123``."""
    mod = tmp / "pkg" / "tests"
    mod.mkdir(parents=True, exist_ok=True)
    (mod / "test_gpu_demo.py").write_text(module)
    (tmp / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "QUANTPACK_GPU_RECORDS")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), QUANTPACK_GPU_STEP="demo")
    env["QUANTPACK_COMMIT"] = "abc123"
    if records is not None:
        env["QUANTPACK_GPU_RECORDS"] = str(records)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
         "-c", str(tmp / "pytest.ini"), f"--rootdir={tmp}", str(mod)],
        cwd=tmp, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip


def test_a_run_writes_every_field_of_its_records(tmp_path):
    proc = run_module(tmp_path / "run", tmp_path / "records")
    assert "1 failed, 2 passed, 1 skipped, 1 xfailed" in proc.stdout, proc.stdout + proc.stderr
    runs = list((tmp_path / "records").glob("vllm-*/*-demo"))
    assert len(runs) == 1, runs
    files = {p.name: json.loads(p.read_text()) for p in runs[0].glob("*.json")}
    assert sorted(files) == [
        "job-test_gpu_demo-dense_other_eager.json",
        "job-test_gpu_demo-dense_pack_eager.json",
        "job-test_gpu_demo-moe_pack_eager.json",
        "tests-test_gpu_demo.py.json",
    ]
    where = {"card", "vllm", "torch", "commit", "date", "step"}
    for record in files.values():
        assert where <= set(record), record
        assert record["commit"] == "abc123" and record["step"] == "demo" and record["date"].endswith("Z")
    moe = files["job-test_gpu_demo-moe_pack_eager.json"]
    assert moe["kind"] == "job" and moe["job"] == "moe/pack/eager" and moe["passed"] is True
    assert moe["test"] == "test_gpu_demo.py::test_moe_job" and moe["file"] == "test_gpu_demo.py"
    for key in ("kl", "kl_median", "kl_max", "kl_worst", "top1", "kl_outside_router_ties"):
        assert key in moe["figures"], key
    assert moe["excluded"] == [{"position": 1, "margin": 1e-3, "kl": 0.4}]
    check = moe["checks"][0]
    assert check["name"] == "kl_outside_router_ties" and check["ok"] is True
    assert {check["limit"], check["op"], check["measured"], check["basis"]} == {1e-3, "<=", 5e-5, "measured here"}
    failed = files["job-test_gpu_demo-dense_pack_eager.json"]
    assert failed["passed"] is False and failed["checks"][0]["ok"] is False
    lost = files["job-test_gpu_demo-dense_other_eager.json"]
    assert lost["passed"] is False and lost["error"] == "RuntimeError: engine core died"
    tests = files["tests-test_gpu_demo.py.json"]
    assert tests["kind"] == "tests" and tests["file"] == "test_gpu_demo.py"
    assert tests["tests"] == {
        "test_gpu_demo.py::test_moe_job": "passed",
        "test_gpu_demo.py::test_failing_job": "failed",
        "test_gpu_demo.py::test_job_that_did_not_run": "passed",
        "test_gpu_demo.py::test_skipped": "skipped",
        "test_gpu_demo.py::test_expected_failure": "xfailed",
    }


def test_a_record_names_the_run_as_it_began(tmp_path):
    """The run's folder (start and step) and each record's commit and release are those of the session's start: a
    record written at the end after the environment changed still names what its tests began on."""
    proc = run_module(tmp_path / "run", tmp_path / "records", LATE)
    assert "1 passed" in proc.stdout, proc.stdout + proc.stderr
    (run,) = (tmp_path / "records").glob("vllm-*/*")
    record = json.loads((run / "tests-test_gpu_demo.py.json").read_text())
    assert run.name.endswith("-demo") and record["step"] == "demo" and record["commit"] == "abc123", (run, record)
    # the folder's stamp (local time, to the second) is no later than the test's start, 1.5 s before the record
    assert run.name[:15] <= (tmp_path / "run" / "began.txt").read_text(), run.name


def test_nothing_is_written_without_the_records_folder(tmp_path):
    proc = run_module(tmp_path / "run", None)
    assert "1 failed, 2 passed" in proc.stdout, proc.stdout + proc.stderr
    assert not list(tmp_path.rglob("*.json"))


def test_a_job_forced_onto_one_kernel_is_named_with_its_settings(monkeypatch):
    """ci/gpu/jobs.toml's e2e-*-tc / -dense jobs run the same jobs with trellis_mma's kernel forced: their records
    carry the settings in the job's name, so the tables keep them apart from the measured choice's; a blank variable
    counts as unset, a refused value too."""
    import gpu_records

    assert gpu_records.forced_settings({}) == ""
    assert gpu_records.forced_settings({"QUANTPACK_TRELLIS_MMA_WIDE_KERNEL": " "}) == ""
    environ = {
        "QUANTPACK_TRELLIS_MMA_MOE_TC_PICKS": "1", "QUANTPACK_TRELLIS_MMA_WIDE_KERNEL": "tc",
        "QUANTPACK_TRELLIS_MMA_DELEGATE_ROWS": "0", "QUANTPACK_TRELLIS_MMA_CTAS_PER_SM": "4",
    }  # fmt: skip
    assert gpu_records.forced_settings(environ) == " [wide_kernel=tc, delegate_rows=0, moe_tc_picks=1]"
    # the values the kernels read: a spelling in another case names the same record, a refused one none
    assert gpu_records.forced_settings({"QUANTPACK_TRELLIS_MMA_WIDE_KERNEL": "TC"}) == " [wide_kernel=tc]"
    assert gpu_records.forced_settings({"QUANTPACK_TRELLIS_MMA_WIDE_KERNEL": "tensorcore"}) == ""
    monkeypatch.delenv("QUANTPACK_GPU_RECORDS", raising=False)  # nothing written
    monkeypatch.setenv("QUANTPACK_TRELLIS_MMA_WIDE_KERNEL", "dense")
    record = gpu_records.job_of("t.py::test_job", "llama/float16/eager", {"kl": 1e-6})
    assert record.job == "llama/float16/eager [wide_kernel=dense]"


#: bounds no committed record measures, and why (each other bound's figures are checked against the records)
WITHOUT_RECORDS = {
    "QWEN3NEXT_KL": "Qwen3-Next is served at TP 2: two GPUs, which no committed run had",
    "QWEN3NEXT_TOP1": "Qwen3-Next is served at TP 2: two GPUs, which no committed run had",
}


def committed_checks() -> dict[str, list[dict]]:
    """Every check of the committed job records (ci/gpu/records), by the basis of its bound."""
    checks: dict[str, list[dict]] = {}
    for path in (ROOT / "ci" / "gpu" / "records").rglob("job-*.json"):
        for check in json.loads(path.read_text()).get("checks", []):
            checks.setdefault(check["basis"], []).append(check)
    return checks


def worst_held(bound, checks: list[dict]) -> float | None:
    """The worst value of the checks that held under ``bound`` (a ceiling's highest, a floor's lowest)."""
    held = [c["value"] for c in checks if c["ok"]]
    return (max(held) if bound.op == "<=" else min(held)) if held else None


def test_every_gpu_bound_sits_within_20x_of_its_measurement():
    """tests/e2e_bounds.py: a ceiling lies between the worst value measured for its kind and 20x that (a kernel an
    order of magnitude worse fails), both for its stated measurement and for the worst its committed records hold; a
    floor at or below the lowest measured (or no run kept one)."""
    import e2e_bounds

    assert len(e2e_bounds.ALL) >= 10
    checks = committed_checks()
    for name, bound in e2e_bounds.ALL.items():
        worst = worst_held(bound, checks.get(bound.basis, []))
        if bound.op == "<=":
            assert bound.measured is not None and bound.measured <= bound.limit <= 20 * bound.measured, name
            assert worst is None or bound.limit <= 20 * worst, (name, bound.limit, worst)
        else:
            assert bound.op == ">=" and (bound.measured is None or bound.limit <= bound.measured), name


def test_each_bound_states_the_worst_value_its_committed_records_hold():
    """A bound's ``measured`` is the worst value of the checks that held under it in ci/gpu/records/ (matched by
    the bound's ``basis``, as each record writes it), to the figures it is stated with (5% either way): a run that
    measured worse and still passed moves the stated figure (and with it the 20x room above), in a commit of its
    own. A bound no record measures is named in ``WITHOUT_RECORDS`` with the reason (a reworded basis would leave
    its records behind)."""
    import e2e_bounds

    checks = committed_checks()
    unmeasured = {
        name for name, bound in e2e_bounds.ALL.items() if worst_held(bound, checks.get(bound.basis, [])) is None
    }
    assert unmeasured == set(WITHOUT_RECORDS), "bounds without committed records: name them in WITHOUT_RECORDS"
    stale = {}
    for name, bound in e2e_bounds.ALL.items():
        worst = worst_held(bound, checks.get(bound.basis, []))
        if worst is None:
            continue
        if bound.op == "<=":  # stated to two or three figures
            off = bound.measured is None or not worst / 1.05 <= bound.measured <= worst * 1.05
        else:  # a top-1 stated to three figures
            off = bound.measured is None or abs(worst - bound.measured) > 1e-3
        if off:
            stale[name] = (bound.measured, worst)
    assert not stale, f"bounds whose stated measurement is not their records' worst (stated, records): {stale}"


def test_every_committed_check_is_its_bound_applied_to_its_value():
    """A record's ``ok`` is what its own value, op and limit give (a record whose flag disagrees would count a
    failure as a measurement, or hide one)."""
    from e2e_bounds import Bound

    for basis, checks in committed_checks().items():
        for check in checks:
            bound = Bound(check["limit"], check["op"], check.get("measured"), basis)
            assert check["ok"] == bound.holds(check["value"]), (basis, check)
