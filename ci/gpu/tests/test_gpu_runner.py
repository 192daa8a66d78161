"""ci/gpu/run.py over ci/gpu/jobs.toml, on CPU: the job list fits the tree (every GPU test file in the tier group),
a misfit is named, and the runner itself on small command jobs: lanes side by side, a pack made once for the jobs
that share it, a job past its timeout killed with its children (status 124), a group's variables under the
caller's, left-out jobs and packs, and the archive of a run."""

from __future__ import annotations

import importlib.util
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def load_tool():
    spec = importlib.util.spec_from_file_location("gpu_run", ROOT / "ci" / "gpu" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses need the module registered
    spec.loader.exec_module(mod)
    return mod


run = load_tool()
PY = sys.executable


def test_the_job_list_fits_the_tree():
    plan = run.load()
    assert run.check(plan) == []
    tier = plan.groups["tier"]
    assert all(j in plan.jobs for lane in tier.lanes for j in lane)
    kernels = plan.jobs["kernels-exllamav3"]
    assert kernels.pytest and kernels.argv[-3:] == ("-k", "not trellis_mma", kernels.argv[-1])
    assert "-m" in kernels.argv and "gpu" in kernels.argv


def test_a_misfit_is_named(tmp_path):
    tests = tmp_path / "packages" / "quantpack-x" / "tests"
    tests.mkdir(parents=True)
    (tests / "test_x_gpu.py").write_text("import pytest\npytestmark = pytest.mark.gpu\n")
    (tests / "test_cpu.py").write_text("def test_cpu(): pass\n")
    plan = run.Plan(
        jobs={"a": run.Job("a", (PY, "benchmarks/missing.py"), False, 10, packs=("no-such-pack",))},
        packs={},
        groups={"tier": run.Group("tier", (("a", "b"),))},
    )
    assert sorted(run.check(plan, tmp_path)) == [
        "group tier never runs packages/quantpack-x/tests/test_x_gpu.py",
        "group tier: no job b",
        "job a: no benchmarks/missing.py in the tree",
        "job a: pack no-such-pack is neither a [packs] entry nor a path in the tree",
    ]


def test_a_job_table_needs_one_command_and_a_timeout():
    with pytest.raises(SystemExit, match=r"\[jobs.bad\] needs one of pytest / benchmark"):
        run.job_of("bad", {"pytest": ["x.py"], "benchmark": ["y"], "timeout": 5})
    with pytest.raises(SystemExit, match="a timeout in seconds"):
        run.job_of("bad", {"benchmark": ["y"]})


def command(code: str, timeout: int = 60, **kw) -> tuple:
    return (PY, "-c", code), timeout, kw


def make_runner(tmp_path, jobs: dict, packs=None, groups=None, skip=(), no_packs=()):
    plan = run.Plan(
        jobs={name: run.Job(name, argv, False, timeout, **kw) for name, (argv, timeout, kw) in jobs.items()},
        packs=packs or {},
        groups=groups or {},
    )
    out = tmp_path / "out"
    out.mkdir(parents=True)
    return run.Runner(plan, out, set(skip), set(no_packs))


def test_lanes_run_side_by_side_and_a_pack_is_made_once(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTPACK_GPU_RESULTS", str(tmp_path / "results"))
    made, marks = tmp_path / "made", tmp_path / "marks"
    marks.mkdir()
    step = (
        "import os, pathlib, time; m = pathlib.Path(os.environ['MARKS']); n = os.environ['QUANTPACK_GPU_STEP'];"
        "(m / (n + '.start')).write_text(str(time.time())); time.sleep(1.0);"
        "(m / (n + '.end')).write_text(os.environ['PACK_DIR'] + ' ' + os.environ['LLM'])"
    )
    pack = run.Pack(
        "p", (PY, "-c", f"import pathlib; p = pathlib.Path({str(made)!r}); p.mkdir(); (p / 'n').write_text('x')"),
        (str(made / "n"),), {"PACK_DIR": str(made)},
    )  # fmt: skip
    runner = make_runner(
        tmp_path,
        {"one": command(step, packs=("p",)), "two": command(step, packs=("p",))},
        packs={"p": pack},
        groups={"g": run.Group("g", (("one",), ("two",)), env={"LLM": "group", "MARKS": str(marks)})},
    )
    monkeypatch.setenv("LLM", "caller")
    assert runner.run(["g"]) == 0
    assert runner.status == {"one": 0, "two": 0}
    starts = [float((marks / f"{n}.start").read_text()) for n in ("one", "two")]
    ends = [(marks / f"{n}.end").stat().st_mtime for n in ("one", "two")]
    assert max(starts) < min(ends), "the lanes ran one after the other"
    assert (marks / "one.end").read_text() == f"{made} caller"  # the pack's variable; the caller's over the group's
    assert (tmp_path / "out" / "pack-p.log").exists() and not (tmp_path / "out" / "pack-p-2.log").exists()
    assert (made / "n").read_text() == "x"  # made once: a second make would have failed on mkdir


def test_a_job_past_its_timeout_is_killed_with_its_children(tmp_path):
    child = tmp_path / "child-alive"
    grandchild = f"import time, pathlib; time.sleep(3); pathlib.Path({str(child)!r}).write_text('x')"
    code = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {grandchild!r}]); time.sleep(30)"
    runner = make_runner(tmp_path, {"slow": command(code, timeout=1), "fails": command("raise SystemExit(3)")})
    started = time.monotonic()
    assert runner.run(["slow", "fails"]) == 1
    assert runner.status == {"slow": 124, "fails": 3}
    assert time.monotonic() - started < 10
    time.sleep(3.5)
    assert not child.exists(), "the job's child outlived the timeout"


def test_left_out_jobs_and_packs(tmp_path):
    pack = run.Pack("p", (PY, "-c", "raise SystemExit(1)"), (str(tmp_path / "never"),), {"PACK_DIR": "x"})
    code = "import os; raise SystemExit(7 if 'PACK_DIR' in os.environ else 0)"
    runner = make_runner(
        tmp_path, {"a": command(code, packs=("p",)), "b": command("raise SystemExit(1)")},
        packs={"p": pack}, skip=("b",), no_packs=("p",),
    )  # fmt: skip
    assert runner.run(["a", "b"]) == 0 and runner.status == {"a": 0}
    failing = make_runner(tmp_path / "again", {"a": command(code, packs=("p",))}, packs={"p": pack})
    assert failing.run(["a"]) == 1 and failing.status == {"a": 2}  # its pack could not be made


def test_the_archive_holds_the_logs_and_records(tmp_path, monkeypatch):
    results = tmp_path / "results"
    (results / "records" / "vllm-0.25.1" / "20260101-000000-a").mkdir(parents=True)
    (results / "records" / "vllm-0.25.1" / "20260101-000000-a" / "tests-x.json").write_text("{}")
    monkeypatch.setenv("QUANTPACK_GPU_RESULTS", str(results))
    runner = make_runner(tmp_path, {"a": command("print('hello')")})
    runner.run(["a"])
    archive = run.collect(runner.out, tmp_path)
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert "out/a.log" in names and "results/records/vllm-0.25.1/20260101-000000-a/tests-x.json" in names
