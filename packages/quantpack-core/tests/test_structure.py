"""The workspace's structure: no import cycle between any of its source modules, and quantpack-core outside its
optional ``quantpack_core.vllm`` subpackage imports no vLLM (checked in a fresh interpreter, also where vLLM is
installed)."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[2]


def modules() -> dict[str, Path]:
    out = {}
    for src in PACKAGES.glob("*/src"):
        for path in src.rglob("*.py"):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Workspace modules ``name`` imports (``from a.b import c`` counts as ``a.b`` and, if it is one, ``a.b.c``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m in known and m != name}


def test_no_import_cycle_in_the_workspace():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    # a package importing its own submodules (re-exports) is not a cycle, unless the submodule imports the package
    # back: drop only the edges from a package to children that do not
    graph = {n: {d for d in deps if not d.startswith(n + ".") or n in graph[d]} for n, deps in graph.items()}
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert len(known) > 40 and not cycles, cycles


def test_core_outside_its_vllm_subpackage_imports_no_vllm():
    names = sorted(m for m in modules() if m.startswith("quantpack_core") and not m.startswith("quantpack_core.vllm"))
    # A GPU-only module (the Triton kernels) needs triton, which a CPU-only torch does not bring: it is skipped there,
    # and it is listed, so a module that fails for any other reason still fails the test.
    code = (
        "import importlib, sys\n"
        "skipped = []\n"
        f"for m in {names!r}:\n"
        "    try: importlib.import_module(m)\n"
        "    except ModuleNotFoundError as e:\n"
        "        if e.name != 'triton': raise\n"
        "        skipped.append(m)\n"
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))\n"
        "print(skipped)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    loaded_vllm, skipped = res.stdout.strip().splitlines()
    assert loaded_vllm == "[]", loaded_vllm
    assert set(ast.literal_eval(skipped)) <= {"quantpack_core._int8_logits_triton"}, skipped
