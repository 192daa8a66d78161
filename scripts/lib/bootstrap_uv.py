"""Put uv into a private folder of the checkout and print the path of its binary.

Run by scripts/lib/uv.sh with whatever Python >= 3.10 is on PATH when no uv is found, the system's externally managed
one included (PEP 668): nothing is installed into that interpreter, and with ``-B`` no bytecode is written. uv's wheel
is fetched by pip (``pip download``, which installs nothing; pip's own configuration, index and certificates apply):
the interpreter's own pip, else the pip that the standard library's ``venv`` puts into a throw-away environment. The
``uv`` and ``uvx`` binaries are then taken out of the wheel into ``DEST/bin``.

    python3 scripts/lib/bootstrap_uv.py DEST VERSION
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import venv
import zipfile
from pathlib import Path


def _download(python: str, tmp: Path, version: str) -> Path | None:
    """uv's wheel for this machine downloaded by ``python``'s pip into ``tmp``; None when that pip is missing or
    fails (pip's own message on stderr)."""
    argv = [python, "-B", "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--dest", str(tmp)]
    has_pip = subprocess.run([python, "-B", "-c", "import pip"], capture_output=True, check=False).returncode == 0
    if not has_pip or subprocess.run([*argv, f"uv=={version}"], check=False).returncode != 0:
        return None
    wheels = sorted(tmp.glob("uv-*.whl"))
    return wheels[0] if wheels else None


def _throwaway_pip(tmp: Path) -> str | None:
    """The Python of a new environment in ``tmp`` holding the pip that ``venv`` installs (ensurepip's bundled
    wheel, no download); None where this interpreter has no ensurepip (Debian without python3-venv)."""
    try:
        venv.EnvBuilder(with_pip=True).create(tmp / "venv")
    except (subprocess.CalledProcessError, OSError):
        return None
    python = tmp / "venv" / "bin" / "python"
    return str(python) if python.exists() else None


def _unpack(wheel: Path, dest: Path) -> Path:
    """The wheel's ``uv`` / ``uvx`` scripts written to ``dest/bin`` (executable); the path of ``uv``."""
    bin_dir = dest / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if ".data/scripts/" in name and Path(name).name in ("uv", "uvx"):
                target = bin_dir / Path(name).name
                part = target.with_suffix(".partial")
                part.write_bytes(z.read(name))
                part.chmod(0o755)
                os.replace(part, target)  # a binary appears whole or not at all
    uv = bin_dir / "uv"
    if not uv.is_file():
        raise SystemExit(f"bootstrap-uv: {wheel.name} holds no uv binary")
    return uv


def main() -> None:
    dest, version = Path(sys.argv[1]).resolve(), sys.argv[2]
    with tempfile.TemporaryDirectory(prefix="bootstrap-uv-") as tmp:
        wheel = _download(sys.executable, Path(tmp), version)
        if wheel is None and (pip_python := _throwaway_pip(Path(tmp))) is not None:
            wheel = _download(pip_python, Path(tmp), version)
        if wheel is None:
            raise SystemExit(
                f"bootstrap-uv: {sys.executable} has neither pip nor venv's pip to fetch uv with (on Debian / Ubuntu: "
                "apt install python3-pip, or python3-venv)"
            )
        print(_unpack(wheel, dest))


if __name__ == "__main__":
    main()
