"""The workspace's structure: no import cycle between any of its source modules; quantpack-core outside its
optional ``quantpack_core.vllm`` subpackage imports no vLLM (checked in a fresh interpreter, also where vLLM is
installed); quantpack-core imports no format package and names no format's tensors, and its trellis_mma kernels name
no format at all; quantpack-escha-rocm imports nothing of quantpack-exl3; no function over 80 lines.
"""

import ast
import re
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


#: the format packages of the workspace, which quantpack-core never imports
FORMAT_PACKAGES = ("quantpack_exl3", "quantpack_escha", "quantpack_families")
#: words that name a format or its implementations, which quantpack-core's trellis_mma kernels (format-free: trellis
#: tiles, codebook id, K and scales in) never use in code, strings or docstrings
FORMAT_WORDS = re.compile(r"exl3|escha|exllamav3", re.IGNORECASE)
MAX_FUNCTION_LINES = 80


def format_tensor_types() -> set[str]:
    """Names of the classes the format packages define for their tensors (``EschaTensors``, ...)."""
    found = set()
    for name, path in modules().items():
        if name.split(".")[0] in FORMAT_PACKAGES:
            tree = ast.parse(path.read_text())
            found |= {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name.endswith("Tensors")}
    return found


def test_core_imports_no_format_package_and_names_no_format_tensors():
    """No module of quantpack-core imports a format package or names a tensor class one defines; its trellis_mma
    kernels name no format at all (their API takes trellis tiles, codebook id, K and scales)."""
    known, types, bad = modules(), format_tensor_types(), []
    assert "EschaTensors" in types
    for name, path in known.items():
        if not name.startswith("quantpack_core"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                bad += [f"{name} imports {a.name}" for a in node.names if a.name.split(".")[0] in FORMAT_PACKAGES]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORMAT_PACKAGES:
                bad.append(f"{name} imports {node.module}")
            elif isinstance(node, ast.Name | ast.Attribute) and (getattr(node, "id", None) or node.attr) in types:
                bad.append(f"{name} names {getattr(node, 'id', None) or node.attr}")
        if name.startswith("quantpack_core.trellis_mma"):
            bad += [f"{name}: {m.group(0)!r}" for m in FORMAT_WORDS.finditer(path.read_text())]
    assert not bad, bad


def test_escha_imports_nothing_of_quantpack_exl3():
    """quantpack-escha-rocm reaches the trellis_mma kernels through quantpack-core: no module of it imports
    quantpack-exl3 (private names or any other)."""
    bad = []
    for name, path in modules().items():
        if not name.startswith("quantpack_escha"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            bad += [f"{name} imports {n}" for n in names if n.split(".")[0] == "quantpack_exl3"]
    assert not bad, bad


def format_names_and_tensors() -> set[str]:
    """The names of the installed formats (:func:`quantpack_core.format.pack_formats`: the workspace's format packages
    register theirs) and their checkpoint tensors (``suffixes``, ``main_suffix``), those of three letters or more
    (EXL3's legacy ``su`` / ``sv`` are also names of other things: ``su`` is a RoPE type vLLM renames)."""
    from quantpack_core.format import pack_formats

    formats = pack_formats()
    assert {"exl3", "escha"} <= set(formats), sorted(formats)  # the rules below never pass for want of formats
    words = {word for name, fmt in formats.items() for word in (name, fmt.main_suffix, *fmt.suffixes)}
    return {word for word in words if len(word) >= 3}


def string_constants(path: Path) -> set[str]:
    return {
        n.value
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def test_core_names_no_format_outside_its_codec():
    """quantpack-core's trellis codec (quantpack_core.codec: it decodes the tensors exllamav3 writes, and names EXL3)
    is the one module of core that names a format: no string constant of any other module is an installed format's
    name or one of its checkpoint tensors that the codec does not name itself (escha's ``escha_code``, ``"escha"``
    ...). Prose (docstrings, messages) may mention a format; code does not dispatch on one."""
    known = modules()
    codec = set().union(*(string_constants(p) for n, p in known.items() if n.startswith("quantpack_core.codec")))
    foreign = format_names_and_tensors() - codec
    assert "escha_code" in foreign and "escha" in foreign
    bad = []
    for name, path in known.items():
        if name.startswith("quantpack_core") and not name.startswith("quantpack_core.codec"):
            bad += [f"{name}: {word!r}" for word in sorted(string_constants(path) & foreign)]
    assert not bad, bad


def test_the_pack_check_names_no_format():
    """The pack check (quantpack_core.check) names no format at all, the codec's included: no string constant of it
    is a format's name or checkpoint tensor, no name in its code (identifiers, attributes, arguments, imports) holds
    a format word, and it imports nothing of the codec's EXL3 layer (quantpack_core.codec.exl3). A format's rules
    come from its plugin (quantpack_core.format.PackFormat)."""
    words, bad = format_names_and_tensors(), []
    for name, path in modules().items():
        if not name.startswith("quantpack_core.check"):
            continue
        bad += [f"{name}: {w!r}" for w in sorted(string_constants(path) & words)]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("codec.exl3"):
                bad.append(f"{name} imports {node.module}")
            names = [getattr(node, a, None) for a in ("id", "attr", "name", "arg", "asname", "module")]
            bad += [f"{name}: {n}" for n in names if isinstance(n, str) and FORMAT_WORDS.search(n)]
    assert not bad, bad


def test_no_function_over_80_lines():
    """Every function of the packages' sources is at most MAX_FUNCTION_LINES lines, docstring included."""
    long = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert not long, sorted(long)
