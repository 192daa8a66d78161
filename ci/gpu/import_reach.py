"""Which third-party packages a slim vLLM bundle imports on the GPU tier's path that a proven bundle did not.

A bundle (ci/gpu/bundle.sh) carries only the part of vLLM's dependency tree that ``bundle-deps.txt`` lists under
``[bundle]``; the rest must be on the GPU machine or off the tier's path. A package a new release imports where an
older one did not (vLLM 0.22.1 imports its ``humming`` quantization config, and with it the ``humming`` package,
whenever any quantization method is resolved; 0.25.1 only under ``TYPE_CHECKING``) stops every engine at start, a
whole device session's column lost. This reads the sources instead, on this machine:

``python3 ci/gpu/import_reach.py NEW_SITE PROVEN_SITE`` follows vLLM's module-level imports (and the function-level
ones of the modules in :data:`FUNCTION_LEVEL`, which import lazily what every engine start reaches) from the
tier's entry modules (:data:`ENTRY`) through each unpacked bundle (``NEW_SITE``, ``PROVEN_SITE``: folders holding
``vllm/``), skipping imports under ``TYPE_CHECKING`` or in a ``try`` block (guarded, as vLLM does for optional
packages), and prints each third-party top-level module reachable in ``NEW_SITE`` that neither ships in it nor is
reachable in ``PROVEN_SITE`` (a bundle that ran the tier: the machine has what it imported), with the module that
imports it. Exit status 1 when there is one. A reading of the sources, not an import: what a module imports
through ``importlib`` or ``__import__`` is not seen, and a function-level import elsewhere only when its module is
listed.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

#: the modules an engine start on the tier reaches (LLM(...), the V1 engine core and GPU worker, the attention
#: backend the tests choose, the default loader, the compile backend) and the model files of the tier's packs
ENTRY = (
    "vllm",
    "vllm.entrypoints.llm",
    "vllm.v1.engine.core",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.attention.backends.triton_attn",
    "vllm.model_executor.model_loader.default_loader",
    "vllm.compilation.backends",
    "vllm.model_executor.layers.fused_moe",
    "vllm.model_executor.layers.quantization",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.qwen2",
    "vllm.model_executor.models.qwen3_moe",
)
#: modules whose function-level imports run at every engine start (``get_quantization_config`` imports every
#: method's config module once any method is resolved)
FUNCTION_LEVEL = frozenset({"vllm.model_executor.layers.quantization"})


def module_path(site: Path, module: str) -> Path | None:
    """The source file of ``module`` under ``site`` (``a/b.py`` or ``a/b/__init__.py``), or None."""
    base = site.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def module_imports(site: Path, module: str, function_level: bool) -> tuple[set[str], set[str]]:
    """``(vllm_modules, third_party_tops)`` that ``module`` imports unguarded: at module level (also inside ``if``
    and class bodies), and inside functions too when ``function_level``; not under ``if TYPE_CHECKING`` nor in a
    ``try`` block's body. Standard-library modules are left out. A file that does not parse gives two empty sets.
    """
    path = module_path(site, module)
    internal: set[str] = set()
    external: set[str] = set()
    if path is None:
        return internal, external
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return internal, external
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def add(name: str) -> None:
        top = name.split(".")[0]
        if top == "vllm":
            internal.add(name)
        elif top and top not in sys.stdlib_module_names:
            external.add(top)

    def walk(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    walk(node.body)
                    walk(node.orelse)
            elif isinstance(node, ast.Try):  # the body is guarded; a handler's import is not
                for handler in node.handlers:
                    walk(handler.body)
                walk(node.orelse)
                walk(node.finalbody)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if function_level:
                    walk(node.body)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    target = f"{base}.{node.module}" if node.module else base
                else:
                    target = node.module or ""
                add(target)
                for alias in node.names:  # `from pkg import submodule`
                    if module_path(site, f"{target}.{alias.name}"):
                        add(f"{target}.{alias.name}")
            elif isinstance(node, (ast.ClassDef, ast.With, ast.For, ast.While)):
                walk(node.body)

    walk(tree.body)
    return internal, external


def reachable(site: Path, entry=ENTRY, function_level=FUNCTION_LEVEL) -> dict[str, str]:
    """Third-party top-level module -> the first vLLM module found importing it, over every vLLM module reachable
    from ``entry`` under ``site`` (parents of a module count as imported, as Python imports them first)."""
    seen: set[str] = set()
    found: dict[str, str] = {}
    stack = list(entry)
    while stack:
        module = stack.pop()
        if module in seen or module_path(site, module) is None:
            continue
        seen.add(module)
        parts = module.split(".")
        stack.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        internal, external = module_imports(site, module, module in function_level)
        for top in sorted(external):
            found.setdefault(top, module)
        stack.extend(internal)
    return found


def new_imports(new_site: Path, proven_site: Path) -> dict[str, str]:
    """What :func:`reachable` finds in ``new_site`` that neither ships there (a top-level folder or module of that
    name) nor is reachable in ``proven_site``: top-level module -> the importing vLLM module."""
    proven = reachable(proven_site)
    shipped = {p.name.removesuffix(".py") for p in new_site.iterdir()}
    return {top: via for top, via in sorted(reachable(new_site).items()) if top not in shipped and top not in proven}


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module's docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("new_site", type=Path, help="an unpacked bundle (the folder holding vllm/)")
    parser.add_argument("proven_site", type=Path, help="an unpacked bundle that ran the tier")
    args = parser.parse_args(argv)
    for site in (args.new_site, args.proven_site):
        if module_path(site, "vllm") is None:
            parser.error(f"{site}: no vllm/ package there (give the folder an unpacked bundle holds)")
    new = new_imports(args.new_site, args.proven_site)
    for top, via in new.items():
        print(f"NEW IMPORT: {top} (imported by {via}): not in the bundle and not imported on the proven bundle's path")
    if not new:
        print(f"no third-party import on the tier's path beyond {args.proven_site}'s and the bundle's own")
    return 1 if new else 0


if __name__ == "__main__":
    sys.exit(main())
