"""The GPU tier's runner: the jobs and groups of ``ci/gpu/jobs.toml`` on a CUDA machine set up by ``ci/gpu/setup.sh``
(standard library only). Each job's log goes to ``<out>/<job>.log`` (``--out``, default ``/tmp/gpu-run``); a pytest
job's JUnit report and its tests' records go under ``$QUANTPACK_GPU_RESULTS`` (``ci/gpu/env.sh``), named by the vLLM
release installed and the job.

Usage (repository root, ``source ci/gpu/env.sh`` first; ``ci/gpu/bg.sh start`` does that)::

    python3 ci/gpu/run.py tier                         # a group: lanes side by side, then its `then` jobs
    python3 ci/gpu/run.py e2e-llama kernel-8b          # jobs, one after the other
    python3 ci/gpu/run.py tier --skip escha-gpu,escha-vllm --no-packs family-nemotron-vl --release 0.25.1
    python3 ci/gpu/run.py --list                       # the jobs and groups
    python3 ci/gpu/run.py --check                      # jobs.toml against the tree (no GPU needed)
    python3 ci/gpu/run.py --collect                    # logs, benchmark output and records -> $OUT/gpu-run.tgz

Exits 1 when a job failed (its pytest or command exited non-zero, or ran past its timeout: status 124).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import threading
import time
import tomllib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from gpu_records import vllm_release  # noqa: E402  (the release the reports and records are named by)

JOBS = Path(__file__).with_name("jobs.toml")
PYTEST = ("python3", "-m", "pytest", "-rA", "-p", "no:cacheprovider", "--durations=5", "-m", "gpu", "-q")
#: a GPU-marked test file: one whose tests carry pytest's ``gpu`` mark
GPU_MARK = re.compile(r"pytest\.mark\.gpu\b")


@dataclass(frozen=True)
class Pack:
    """A pack made on the machine before the jobs that need it: ``make`` unless every path of ``creates`` exists."""

    name: str
    make: tuple[str, ...]
    creates: tuple[str, ...]
    env: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Job:
    """One job: ``argv`` (pytest or a benchmark), its timeout, the packs it needs and its own variables."""

    name: str
    argv: tuple[str, ...]
    pytest: bool
    timeout: int
    packs: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Group:
    """Lanes of jobs run side by side, then ``then``; ``env`` where the caller has not set a variable."""

    name: str
    lanes: tuple[tuple[str, ...], ...]
    then: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    jobs: dict[str, Job]
    packs: dict[str, Pack]
    groups: dict[str, Group]


def job_of(name: str, spec: dict) -> Job:
    """A :class:`Job` from its ``[jobs.NAME]`` table.

    Raises:
        SystemExit: the table has not exactly one of ``pytest`` / ``benchmark``, or no ``timeout``.
    """
    if ("pytest" in spec) == ("benchmark" in spec) or not isinstance(spec.get("timeout"), int):
        raise SystemExit(f"{JOBS.name}: [jobs.{name}] needs one of pytest / benchmark, and a timeout in seconds")
    if "pytest" in spec:
        argv = (*PYTEST, *(("-k", spec["k"]) if "k" in spec else ()), *spec["pytest"])
    else:
        argv = tuple(spec["benchmark"])
    return Job(name, argv, "pytest" in spec, spec["timeout"], tuple(spec.get("packs", ())), dict(spec.get("env", {})))


def load(path: Path = JOBS) -> Plan:
    """The jobs, packs and groups of ``path`` (``jobs.toml``)."""
    data = tomllib.loads(path.read_text())
    jobs = {name: job_of(name, spec) for name, spec in data.get("jobs", {}).items()}
    packs = {
        name: Pack(name, tuple(spec["make"]), tuple(spec["creates"]), dict(spec.get("env", {})))
        for name, spec in data.get("packs", {}).items()
    }
    groups = {
        name: Group(name, tuple(map(tuple, spec["lanes"])), tuple(spec.get("then", ())), dict(spec.get("env", {})))
        for name, spec in data.get("groups", {}).items()
    }
    return Plan(jobs, packs, groups)


def gpu_test_files(root: Path = ROOT) -> set[str]:
    """The tree's GPU-marked test files, as paths from the repository root."""
    return {
        path.relative_to(root).as_posix()
        for path in root.glob("packages/*/tests/test_*.py")
        if GPU_MARK.search(path.read_text())
    }


def check(plan: Plan, root: Path = ROOT) -> list[str]:
    """What in ``plan`` does not fit the tree at ``root``: a job's test file or script missing, a pack neither defined
    nor a path there, a group naming an unknown job, a name both a job and a group, or a GPU test file the ``tier``
    group never runs. Empty when it fits."""
    problems = [f"{name}: both a job and a group" for name in sorted(set(plan.jobs) & set(plan.groups))]
    for job in plan.jobs.values():
        files = [a for a in job.argv if a.endswith(".py")]
        problems += [f"job {job.name}: no {f} in the tree" for f in files if not (root / f).is_file()]
        for pack in job.packs:
            if pack not in plan.packs and not (root / pack).exists():
                problems.append(f"job {job.name}: pack {pack} is neither a [packs] entry nor a path in the tree")
    for group in plan.groups.values():
        named = [j for lane in group.lanes for j in lane] + list(group.then)
        problems += [f"group {group.name}: no job {j}" for j in named if j not in plan.jobs]
    if "tier" in plan.groups:
        tier = plan.groups["tier"]
        ran = {a for lane in (*tier.lanes, tier.then) for j in lane if j in plan.jobs for a in plan.jobs[j].argv}
        problems += [f"group tier never runs {f}" for f in sorted(gpu_test_files(root) - ran)]
    return problems


@cache
def card() -> str:
    """The first GPU's name as nvidia-smi gives it; empty where it names none."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""
    return out.strip().splitlines()[0].strip() if out.strip() else ""


def results_dir() -> Path:
    """Where the JUnit reports go (``QUANTPACK_GPU_RESULTS``, default ``/tmp/gpu-matrix``), created."""
    path = Path(os.environ.get("QUANTPACK_GPU_RESULTS") or "/tmp/gpu-matrix").resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


class Runner:
    """Runs jobs into ``out``, making packs once (one lock per pack across lanes), printing a line per start / end."""

    def __init__(self, plan: Plan, out: Path, skip: set[str], no_packs: set[str]):
        self.plan, self.out, self.skip, self.no_packs = plan, out, skip, no_packs
        self.locks = {name: threading.Lock() for name in plan.packs}
        self.print_lock = threading.Lock()
        self.status: dict[str, int] = {}

    def say(self, line: str) -> None:
        with self.print_lock:
            print(line, flush=True)

    def execute(self, name: str, argv: tuple[str, ...], env: dict, timeout: int) -> int:
        """Run ``argv`` in its own process group, its output to ``<out>/<name>.log``; 124 past ``timeout`` (the
        group killed)."""
        log = self.out / f"{name}.log"
        self.say(f"=== {name} {time.strftime('%H:%M:%S')}: {shlex.join(argv)}")
        with log.open("w") as sink:
            proc = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = 124
        tail = log.read_text(errors="replace").splitlines()[-15:]
        self.say(f"=== {name} rc={rc} {time.strftime('%H:%M:%S')}\n" + "\n".join(tail))
        return rc

    def pack_env(self, name: str, base: dict) -> dict:
        """Make pack ``name`` unless it is there (or left out, or a path: nothing to make); the variables it gives."""
        pack = self.plan.packs.get(name)
        if pack is None or name in self.no_packs:
            return {}
        with self.locks[name]:
            if not all(Path(p).exists() for p in pack.creates):
                rc = self.execute(f"pack-{name}", tuple(a.format(out=self.out) for a in pack.make), base, 3600)
                if rc or not all(Path(p).exists() for p in pack.creates):
                    raise RuntimeError(f"pack {name} was not made (rc {rc}): {self.out}/pack-{name}.log")
        return pack.env

    def run_job(self, name: str, defaults: dict) -> int:
        """One job with ``defaults`` under the caller's environment; its exit status, kept in :attr:`status`."""
        if name in self.skip:
            self.say(f"=== {name}: left out (--skip)")
            return 0
        job = self.plan.jobs[name]
        env = {**defaults, **os.environ, "QUANTPACK_GPU_STEP": name}
        try:
            for pack in job.packs:
                env.update(self.pack_env(pack, env))
        except RuntimeError as e:
            self.say(f"=== {name} rc=2: {e}")
            self.status[name] = 2
            return 2
        env.update(job.env)
        if job.pytest:
            report = results_dir() / f"vllm-{vllm_release()}-{time.strftime('%Y%m%d-%H%M%S')}-{name}.xml"
            suite = f" -o {shlex.quote('junit_suite_name=gpu ' + card())}" if card() else ""
            env["PYTEST_ADDOPTS"] = f"{env.get('PYTEST_ADDOPTS', '')} --junitxml={report}{suite}".strip()
        argv = tuple(a.format(out=self.out) for a in job.argv)
        self.status[name] = self.execute(name, argv, env, job.timeout)
        return self.status[name]

    def run_group(self, group: Group) -> None:
        """The group's lanes in threads (each lane's jobs in order), then its ``then`` jobs."""

        def lane(names: tuple[str, ...]) -> None:
            for name in names:
                self.run_job(name, group.env)

        threads = [threading.Thread(target=lane, args=(names,)) for names in group.lanes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        lane(group.then)

    def run(self, names: list[str]) -> int:
        """Each name, a group or a job, in order; a line per job's status at the end; 1 when one failed."""
        for name in names:
            if name in self.plan.groups:
                self.run_group(self.plan.groups[name])
            else:
                self.run_job(name, {})
        self.say("=== each job's exit status\n" + "\n".join(f"{n} rc={rc}" for n, rc in self.status.items()))
        return int(any(self.status.values()))


def collect(out: Path, dest: Path) -> Path:
    """Archive ``out`` (logs, benchmark output), the background steps' logs (``/tmp/bg``) and the reports and
    records (:func:`results_dir`) into ``dest/gpu-run.tgz``."""
    archive = dest / "gpu-run.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for path, name in ((out, out.name), (Path("/tmp/bg"), "bg"), (results_dir(), results_dir().name)):
            if path.is_dir():
                tar.add(path, arcname=name)
    return archive


def listing(plan: Plan) -> str:
    """The jobs (name, timeout, what runs) and the groups (their lanes)."""
    lines = [f"{j.name:24} {j.timeout:5d} s  {shlex.join(j.argv)}" for j in plan.jobs.values()]
    lines += [f"group {g.name}: " + " | ".join(" ".join(lane) for lane in g.lanes) for g in plan.groups.values()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="jobs or groups of jobs.toml")
    ap.add_argument("--out", type=Path, default=Path("/tmp/gpu-run"), help="logs and benchmark output")
    ap.add_argument("--skip", default="", help="comma-separated jobs to leave out")
    ap.add_argument("--no-packs", default="", help="comma-separated packs not to make (their variables unset)")
    ap.add_argument("--release", help="refuse to run unless this vLLM release is installed")
    ap.add_argument("--list", action="store_true", help="print the jobs and groups")
    ap.add_argument("--check", action="store_true", help="check jobs.toml against the tree")
    ap.add_argument("--collect", action="store_true", help="archive the results so far into $OUT (or /tmp)")
    args = ap.parse_args(argv)
    plan = load()
    if args.check:
        problems = check(plan)
        print("\n".join(problems) or f"{JOBS.name} fits the tree")
        return int(bool(problems))
    if args.list:
        print(listing(plan))
        return 0
    if args.collect:
        print(collect(args.out, Path(os.environ.get("OUT") or "/tmp")))
        return 0
    if unknown := [n for n in args.names if n not in plan.jobs and n not in plan.groups]:
        raise SystemExit(f"no job or group {', '.join(unknown)} in {JOBS} (--list)")
    if args.release and vllm_release() != args.release:
        raise SystemExit(f"vLLM {vllm_release()} is installed, not --release {args.release}: no run")
    if not (ROOT / "fixtures" / "README.md").is_file():
        raise SystemExit(f"no fixtures/ beside the code in {ROOT}: make the copy with ci/gpu/snapshot.sh DEST")
    args.out.mkdir(parents=True, exist_ok=True)
    skip, no_packs = (set(filter(None, names.split(","))) for names in (args.skip, args.no_packs))
    runner = Runner(plan, args.out, skip, no_packs)
    return runner.run(args.names)


if __name__ == "__main__":
    sys.exit(main())
