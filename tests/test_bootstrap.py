"""The README's two commands on a machine whose only Python is an externally managed one (PEP 668: Debian's
``python3``) and that has no uv and no nox: ``scripts/setup-env`` and ``scripts/test`` fetch uv into the checkout's
``.tools/`` and run nox through it, and nothing is written into that interpreter's site-packages.

The interpreter is built here from the one running the tests: its binary copied into a new prefix whose standard
library links to the real one and holds an ``EXTERNALLY-MANAGED`` marker and an empty site-packages (with or without
pip in it), so that ``sys.prefix`` and the marker are the new prefix's; PATH holds it and the few shell commands the
scripts use, nothing else. The scripts run in a copy of the checkout's tracked files (without the fixtures).
Needs the package index (pip downloads uv's wheel, uv installs .venv), as the rest of CI does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the commands scripts/setup-env, scripts/test and scripts/lib/uv.sh call besides Python and uv (realpath: the
#: launcher of a tool uv installs)
SHELL_TOOLS = ("bash", "env", "dirname", "basename", "realpath", "cat", "cksum")
STDLIB_DIR = f"python{sys.version_info.major}.{sys.version_info.minor}"


def _managed_python(prefix: Path, with_pip: bool) -> Path:
    """An externally managed copy of the running interpreter under ``prefix``; the folder it installs packages into
    (its ``purelib``: ``lib/python3.X/site-packages``, Debian's ``local/lib/python3.X/dist-packages``)."""
    base = Path(sys.base_prefix)
    binary = Path(os.path.realpath(sys._base_executable))
    (prefix / "bin").mkdir(parents=True)
    shutil.copy2(binary, prefix / "bin" / "python3")
    (prefix / "lib").mkdir()
    for lib in (base / "lib").glob("libpython*"):  # a binary linked against $ORIGIN/../lib finds it there
        (prefix / "lib" / lib.name).symlink_to(lib)
    stdlib = prefix / "lib" / STDLIB_DIR
    stdlib.mkdir()
    real_stdlib = Path(sysconfig.get_paths(vars={"installed_base": str(base), "base": str(base)})["stdlib"])
    for entry in real_stdlib.iterdir():
        if entry.name not in ("site-packages", "EXTERNALLY-MANAGED"):
            (stdlib / entry.name).symlink_to(entry)
    (stdlib / "EXTERNALLY-MANAGED").write_text(
        "[externally-managed]\nError=This Python is managed by the system: use a virtual environment.\n"
    )
    probe = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(subprocess.run([str(prefix / "bin" / "python3"), "-c", probe], capture_output=True, text=True,
                               check=True).stdout.strip())  # fmt: skip
    assert site.is_relative_to(prefix), site
    site.mkdir(parents=True, exist_ok=True)
    if with_pip:  # where Debian's python3-pip puts it: importable from the interpreter's own paths
        _add_pip(site, binary)
    return site


def _add_pip(site: Path, base_python: Path) -> None:
    """pip in ``site``: ensurepip's bundled wheel unpacked, else a link to the base interpreter's pip (Debian's
    ensurepip bundles none)."""
    import ensurepip

    wheels = sorted((Path(ensurepip.__file__).parent / "_bundled").glob("pip-*.whl"))
    if wheels:
        with zipfile.ZipFile(wheels[-1]) as z:
            z.extractall(site)
        return
    found = subprocess.run(
        [str(base_python), "-c", "import pip; print(pip.__path__[0])"], capture_output=True, text=True
    )
    if found.returncode != 0:
        pytest.skip(f"{base_python} has neither ensurepip's pip wheel nor pip to give the managed copy")
    (site / "pip").symlink_to(found.stdout.strip())


def _checkout_copy(dest: Path) -> Path:
    """The checkout's files as git sees them now (uncommitted and untracked ones included, ignored ones not), without
    fixtures/."""
    files = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        text=True,
        check=True,
    )
    for name in files.stdout.splitlines():
        src = ROOT / name
        if name.startswith("fixtures/") or not src.is_file():
            continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / name)
    return dest


def _tools_path(tmp: Path, python_bin: Path) -> str:
    """PATH: the managed interpreter, then links to :data:`SHELL_TOOLS` only (no uv, no nox, no other Python)."""
    tools = tmp / "tools-bin"
    tools.mkdir()
    for name in SHELL_TOOLS:
        found = shutil.which(name)
        assert found, f"{name} is not on this machine's PATH"
        (tools / name).symlink_to(found)
    return f"{python_bin}:{tools}"


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


def _managed(tmp: Path, with_pip: bool) -> tuple[Path, dict[str, str], Path]:
    """(checkout copy, environment, the interpreter's site-packages) for a managed Python without / with pip."""
    site = _managed_python(tmp / "python", with_pip)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "UV_", "PYTHON", "NOX"))}
    env["PATH"] = _tools_path(tmp, tmp / "python" / "bin")
    return _checkout_copy(tmp / "checkout"), env, site


@pytest.fixture(scope="module")
def with_pip(tmp_path_factory):
    """Debian's python3 with python3-pip: pip there refuses to install into it."""
    return _managed(tmp_path_factory.mktemp("with-pip"), with_pip=True)


@pytest.fixture(scope="module")
def no_pip(tmp_path_factory):
    """A managed Python without pip (venv's ensurepip still there)."""
    return _managed(tmp_path_factory.mktemp("no-pip"), with_pip=False)


def _untouched(site: Path):
    """A check that ``site`` and the user's site-packages are as they were when this was called."""
    user_site = Path(os.path.expanduser("~/.local/lib")) / STDLIB_DIR / "site-packages"
    before = _listing(site), _listing(user_site)

    def check() -> None:
        assert _listing(site) == before[0], "the scripts wrote into the managed interpreter's site-packages"
        assert _listing(user_site) == before[1], "the scripts installed into the user's site-packages"

    return check


def test_the_interpreters_are_externally_managed(with_pip, no_pip):
    """The copies are the kind of Python the scripts meet on Debian: their own prefix, the marker where pip looks for
    it, and the one with pip refusing an install."""
    probe = "import sys, sysconfig; print(sys.prefix); print(sysconfig.get_path('stdlib'))"
    for _, env, site in (with_pip, no_pip):
        out = subprocess.run(["python3", "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
        prefix, stdlib = out.split()
        assert Path(prefix).name == "python" and site.is_relative_to(prefix)  # the copy's own prefix
        assert (Path(stdlib) / "EXTERNALLY-MANAGED").is_file()
    env = with_pip[1]
    pip = subprocess.run(["python3", "-m", "pip", "install", "nox"], env=env, capture_output=True, text=True)
    assert pip.returncode != 0 and "externally-managed-environment" in pip.stderr, pip.stderr


@pytest.mark.parametrize("python", ["with_pip", "no_pip"])
def test_scripts_test_fetches_uv_and_runs_nox(python, request):
    """``scripts/test`` with no uv: uv fetched into .tools/ (by the interpreter's pip, or by the pip venv gives a
    throw-away environment), nox run by uv; again, .tools/ reused."""
    checkout, env, site = request.getfixturevalue(python)
    untouched = _untouched(site)
    for attempt in (1, 2):
        run = subprocess.run(["scripts/test", "--list"], cwd=checkout, env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "tests-matrix(vllm='0.32.0')" in run.stdout
        assert ("no uv on PATH; fetching uv" in run.stderr) == (attempt == 1), run.stderr[-3000:]
    assert sorted(p.name for p in (checkout / ".tools").glob("uv-*/bin/*")) == ["uv", "uvx"]
    untouched()


def test_setup_env_builds_the_venv(with_pip):
    """``scripts/setup-env`` with no uv on PATH: .venv synced from uv.lock on the managed interpreter (3.11) and
    vLLM importable from it; run again, it leaves the synced environment as it is; the interpreter untouched."""
    checkout, env, site = with_pip
    untouched = _untouched(site)
    setup = subprocess.run(["scripts/setup-env"], cwd=checkout, env=env, capture_output=True, text=True, timeout=900)
    assert setup.returncode == 0, setup.stderr[-3000:]
    probe = "import sys, quantpack_exl3, vllm; print(sys.base_prefix); print(vllm.__version__)"
    out = subprocess.run(
        [str(checkout / ".venv/bin/python"), "-c", probe], capture_output=True, text=True, env=env, check=True
    ).stdout.split()
    assert site.is_relative_to(out[0]) and Path(out[0]).name == "python" and out[1] == "0.32.0"
    again = subprocess.run(["scripts/setup-env"], cwd=checkout, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and again.stderr == "", again.stderr[-3000:]  # in sync: nothing reinstalled
    untouched()
