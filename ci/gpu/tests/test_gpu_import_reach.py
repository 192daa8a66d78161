"""ci/gpu/import_reach.py on two synthetic bundles: a package the new release imports on the tier's path (vLLM
0.22.1's humming case: a module-level import in a module that a function of the quantization package imports) is
named, unless the bundle ships it or the proven bundle imported it too; guarded imports are not."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TOOL = ROOT / "ci" / "gpu" / "import_reach.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("import_reach", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write(site: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = site / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return site


QUANT = "vllm/model_executor/layers/quantization"
COMMON = {
    "vllm/__init__.py": "import numpy\nfrom vllm.engine import start\n",
    "vllm/engine.py": (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import typed_only\n"
        "try:\n    import optional_pkg\nexcept ImportError:\n    optional_pkg = None\n"
        "def start():\n    import lazy_elsewhere\n"
    ),
    "vllm/model_executor/__init__.py": "",
    "vllm/model_executor/layers/__init__.py": "",
}


def test_a_new_import_on_the_tier_path_is_named(tmp_path):
    tool = load_tool()
    proven = write(
        tmp_path / "proven",
        {
            **COMMON,
            f"{QUANT}/__init__.py": "def get_quantization_config(name):\n    from .humming import Config\n",
            f"{QUANT}/humming.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from humming.dtypes import T\n"
            ),
        },
    )
    new = write(
        tmp_path / "new",
        {
            **COMMON,
            f"{QUANT}/__init__.py": "def get_quantization_config(name):\n    from .humming import Config\n",
            f"{QUANT}/humming.py": "from humming.dtypes import DataType\nimport numpy\n",
        },
    )
    found = tool.new_imports(new, proven)
    assert found == {"humming": "vllm.model_executor.layers.quantization.humming"}
    # guarded, TYPE_CHECKING-only and function-level imports outside the listed modules are not followed
    assert {"typed_only", "optional_pkg", "lazy_elsewhere"}.isdisjoint(tool.reachable(new))
    run = subprocess.run([sys.executable, str(TOOL), str(new), str(proven)], capture_output=True, text=True)
    assert run.returncode == 1 and "NEW IMPORT: humming" in run.stdout
    # shipped in the bundle: nothing to add
    write(new, {"humming/__init__.py": "", "humming/dtypes.py": ""})
    assert tool.new_imports(new, proven) == {}
    run = subprocess.run([sys.executable, str(TOOL), str(new), str(proven)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout
    # a folder without vllm/ is refused by name
    run = subprocess.run([sys.executable, str(TOOL), str(tmp_path), str(proven)], capture_output=True, text=True)
    assert run.returncode == 2 and "no vllm/ package there" in run.stderr


def test_the_proven_bundles_import_counts_as_on_the_machine(tmp_path):
    """A package the proven bundle imported on the same path (the GPU machine had it) is not named."""
    tool = load_tool()
    files = {**COMMON, "vllm/engine.py": "import jinja2\ndef start():\n    pass\n"}
    proven, new = write(tmp_path / "proven", files), write(tmp_path / "new", files)
    assert tool.reachable(new)["jinja2"] == "vllm.engine"
    assert tool.new_imports(new, proven) == {}
