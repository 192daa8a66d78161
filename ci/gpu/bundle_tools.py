"""The Python steps of ci/gpu/bundle.sh, which builds the GPU tier's slim vLLM bundle of one release.

Subcommands:

- ``lock REPORT DEPS VERSION LOCK``: from pip's installation report of ``vllm==VERSION`` (its whole dependency
  tree, resolved for CPython 3.12 on manylinux x86_64), write the pinned, hashed requirements of what the bundle
  carries: vLLM and the packages ``DEPS`` (ci/gpu/bundle-deps.txt) lists under ``[bundle]``. Checks vLLM's own pins
  against the versions the GPU machine has (``[machine]``) and names every package of the tree that DEPS does not
  classify (left out, but a new dependency of that release deserves a look).
- ``constraints REPORT CONSTRAINTS OUT``: write to OUT the pins of CONSTRAINTS (ci/gpu/bundle-constraints.txt)
  that vLLM's own requirements allow, from pip's report on ``vllm`` alone; names each pin it drops (a release that
  pins another version of a package, e.g. 0.26.0's apache-tvm-ffi==0.1.10).
- ``patch-flash-attn SITE``: let ``vllm.vllm_flash_attn`` import without its FlashAttention binaries (the bundle
  removes them): vLLM imports the module on CUDA whatever the attention backend, and its guard raises ImportError
  when neither binary is there.
- ``verify BUNDLE VERSION LOCK``: unpack a built bundle into a temporary folder and check it: vLLM's version, every
  locked distribution present (and nothing else), no FlashAttention binary, the patched guard, sm_90-only device
  code, no byte-code, the console script; prints its sizes and how many parts stage.sh makes of it.
"""

from __future__ import annotations

import argparse
import json
import py_compile
import re
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prune_fatbin import check as check_fatbin
from prune_fatbin import fatbin_section

#: the guard of vllm/vllm_flash_attn/__init__.py (as in 0.22.1, 0.25.1 and 0.26.0)
FA_GUARD = re.compile(r"^if not \(FA2_AVAILABLE or FA3_AVAILABLE\):\n(?=[ \t]+raise ImportError\()", re.M)
FA_PATCHED = (
    "# slim bundle: the FlashAttention binaries are left out; vLLM runs with another attention backend\n"
    "if False and not (FA2_AVAILABLE or FA3_AVAILABLE):\n"
)
#: what the bundle removes from vLLM (bundle.sh), checked absent by verify
REMOVED = (
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
    "vllm/third_party/deep_gemm",
    "vllm/third_party/fmha_sm100",
    "vllm/_flashmla_C.abi3.so",
    "vllm/_flashmla_extension_C.abi3.so",
    "vllm/_qutlass_C.abi3.so",
    "vllm/vllm-rs",
)


def normalize(name: str) -> str:
    """A distribution name in PEP 503 form (``Foo_bar.baz`` -> ``foo-bar-baz``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_deps(path: Path) -> dict[str, dict[str, str]]:
    """ci/gpu/bundle-deps.txt: ``[section]`` headers, then ``name`` or ``name==version`` words (``#`` comments)."""
    sections: dict[str, dict[str, str]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
        elif current is None:
            raise SystemExit(f"{path}: {line!r} stands before any [section]")
        else:
            for word in line.split():
                name, _, version = word.partition("==")
                current[normalize(name)] = version
    return sections


def lock(report: Path, deps: Path, version: str, out: Path) -> int:
    """Write the bundle's lock file from pip's report (see the module's docstring); 1 on a pin the machine breaks."""
    Requirement = requirement_class()
    sections = read_deps(deps)
    bundled, machine, left = sections.get("bundle", {}), sections.get("machine", {}), sections.get("leave", {})
    tree = {}
    for item in json.loads(report.read_text())["install"]:
        meta = item["metadata"]
        info = item["download_info"]
        tree[normalize(meta["name"])] = (meta, info["archive_info"]["hashes"]["sha256"], info["url"].rsplit("/", 1)[1])
    if tree.get("vllm", ({},))[0].get("version") != version:
        raise SystemExit(f"the report does not resolve vllm=={version}")
    status = 0
    for spec in tree["vllm"][0].get("requires_dist", []):
        requirement = Requirement(spec)
        name = normalize(requirement.name)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        if name in machine and machine[name] and not requirement.specifier.contains(machine[name], prereleases=True):
            print(f"vllm {version} requires {spec}; the GPU machine has {name} {machine[name]}", file=sys.stderr)
            status = 1
    lines = [
        f"# vLLM {version}'s slim bundle for the GPU tier: vLLM and the packages of its dependency tree that the GPU",
        "# machine lacks (ci/gpu/bundle-deps.txt), pinned as pip resolved them for CPython 3.12 manylinux x86_64.",
        f"# Written by ci/gpu/bundle.sh {version} --relock; read by ci/gpu/bundle.sh {version}.",
    ]
    for name in sorted(tree):
        meta, sha256, filename = tree[name]
        if name == "vllm" or name in bundled:
            lines.append(f"{meta['name']}=={meta['version']} --hash=sha256:{sha256}  # {filename}")
    out.write_text("\n".join(lines) + "\n")
    unknown = sorted(set(tree) - set(bundled) - set(machine) - set(left) - {"vllm"})
    absent = sorted(set(bundled) - set(tree))
    carried = sum(1 for name in tree if name in bundled)
    print(f"{out}: vllm {version} and {carried} of its {len(tree) - 1} dependencies")
    if absent:
        print(f"not in vllm {version}'s tree (nothing to carry): {' '.join(absent)}")
    if unknown:
        print(
            f"left out, but not classified in {deps} (new in this release? add each under [bundle] if vLLM imports"
            f" it on the tier's path, else under [leave]): {' '.join(unknown)}"
        )
    return status


def requirement_class():
    """packaging's Requirement (pip's own copy when packaging is not installed)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip carries its own copy
        from pip._vendor.packaging.requirements import Requirement
    return Requirement


def constraints(report: Path, pins: Path, out: Path) -> int:
    """Keep the pins that vLLM's own requirements allow (see the module's docstring)."""
    requirement = requirement_class()
    meta = json.loads(report.read_text())["install"][0]["metadata"]
    wanted: dict[str, list] = {}
    for spec in meta.get("requires_dist", []):
        parsed = requirement(spec)
        if parsed.marker is None or parsed.marker.evaluate({"extra": ""}):
            wanted.setdefault(normalize(parsed.name), []).append(parsed.specifier)
    kept = []
    for line in pins.read_text().splitlines():
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        name, _, version = text.partition("==")
        refused = [str(s) for s in wanted.get(normalize(name), []) if not s.contains(version, prereleases=True)]
        if refused:
            print(f"vllm {meta['version']} requires {name}{','.join(refused)}: its pin {version} is dropped")
        else:
            kept.append(text)
    out.write_text("\n".join(kept) + "\n")
    return 0


def patch_flash_attn(site: Path) -> int:
    """Neutralize vllm_flash_attn's ImportError guard under ``site`` (see the module's docstring)."""
    path = site / "vllm" / "vllm_flash_attn" / "__init__.py"
    if not path.exists():
        print(f"{path}: absent, nothing to patch")
        return 0
    text = path.read_text()
    if FA_PATCHED in text:
        print(f"{path}: already patched")
        return 0
    patched, count = FA_GUARD.subn(FA_PATCHED, text)
    if count != 1:
        if "raise ImportError" in text:
            raise SystemExit(f"{path}: its ImportError guard has changed; adapt FA_GUARD in {__file__}")
        print(f"{path}: no ImportError guard, nothing to patch")
        return 0
    path.write_text(patched)
    py_compile.compile(str(path), cfile=str(Path(tempfile.mkdtemp()) / "x.pyc"), doraise=True)
    print(f"{path}: import guard patched")
    return 0


def verify(bundle: Path, version: str, lock_file: Path) -> int:
    """Check a built bundle (see the module's docstring); 0 when sound, 1 with every problem listed."""
    problems: list[str] = []
    expected = {}
    for line in lock_file.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, rest = line.partition("==")
            expected[normalize(name)] = rest.split()[0]
    with tempfile.TemporaryDirectory(prefix="vllm-bundle-") as tmp:
        root = Path(tmp)
        with tarfile.open(bundle, "r:xz") as archive:
            members = archive.getmembers()
            owners = {(m.uid, m.gid) for m in members}
            mtimes = {m.mtime for m in members}
            archive.extractall(root, filter="tar")
        children: dict[str, list[str]] = {}
        for member in members:
            parent, _, leaf = member.name.rstrip("/").rpartition("/")
            children.setdefault(parent, []).append(leaf)
        if any(names != sorted(names) for names in children.values()):
            problems.append("the members of a folder are not in sorted order")
        if owners != {(0, 0)} or len(mtimes) != 1:
            problems.append(f"owners {owners}, {len(mtimes)} distinct mtimes (want 0:0 and one)")
        found = {}
        for info in root.glob("*.dist-info"):
            name, _, rest = info.name[: -len(".dist-info")].partition("-")
            found[normalize(name)] = rest
        if found != expected:
            problems.append(f"distributions differ from the lock: {set(found.items()) ^ set(expected.items())}")
        if found.get("vllm") != version:
            problems.append(f"vllm {found.get('vllm')} is not {version}")
        for relative in REMOVED:
            if (root / relative).exists():
                problems.append(f"{relative} is still there")
        guard = root / "vllm" / "vllm_flash_attn" / "__init__.py"
        if guard.exists():
            text = guard.read_text()
            if FA_PATCHED not in text and "raise ImportError" in text:
                problems.append(f"{guard.relative_to(root)}: import guard not patched")
            compile(text, str(guard), "exec")
        cut = 0
        for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
            if path.suffix == ".pyc" or path.parent.name == "__pycache__":
                problems.append(f"byte-code: {path.relative_to(root)}")
            with path.open("rb") as handle:
                if handle.read(4) != b"\x7fELF":
                    continue
            if fatbin_section(path.read_bytes()) is None:
                continue
            ok, summary = check_fatbin(path, 90)
            cut += 1
            print(f"  {'sm_90 only' if ok else 'NOT CUT'}: {path.relative_to(root)}: {summary}")
            if not ok:
                problems.append(f"{path.relative_to(root)} keeps device code for other GPUs")
        scripts = sorted(p.name for p in (root / "bin").iterdir()) if (root / "bin").exists() else []
        if scripts != ["vllm"]:
            problems.append(f"bin/ holds {scripts}, want only vllm")
        else:
            first = (root / "bin" / "vllm").read_text().splitlines()[0]
            print(f"  bin/vllm: {first}")
        unpacked = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    size = bundle.stat().st_size
    print(
        f"{bundle}: {size / 1e6:.1f} MB ({size} bytes), {unpacked / 1e6:.1f} MB unpacked, {len(members)} entries, "
        f"{len(found)} distributions, {cut} libraries with device code"
    )
    for problem in problems:
        print(f"PROBLEM: {problem}")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module's docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("lock")
    p.add_argument("report", type=Path)
    p.add_argument("deps", type=Path)
    p.add_argument("version")
    p.add_argument("out", type=Path)
    p = sub.add_parser("constraints")
    p.add_argument("report", type=Path)
    p.add_argument("pins", type=Path)
    p.add_argument("out", type=Path)
    p = sub.add_parser("patch-flash-attn")
    p.add_argument("site", type=Path)
    p = sub.add_parser("verify")
    p.add_argument("bundle", type=Path)
    p.add_argument("version")
    p.add_argument("lock", type=Path)
    args = parser.parse_args(argv)
    if args.command == "lock":
        return lock(args.report, args.deps, args.version, args.out)
    if args.command == "constraints":
        return constraints(args.report, args.pins, args.out)
    if args.command == "patch-flash-attn":
        return patch_flash_attn(args.site)
    return verify(args.bundle, args.version, args.lock)


if __name__ == "__main__":
    sys.exit(main())
