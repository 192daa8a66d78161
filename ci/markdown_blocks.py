"""Generated Markdown blocks in the repository's README and docs. A tool's block ``NAME`` sits between a line
``<!-- TOOL NAME -->`` and a line ``<!-- TOOL end -->``; the tool makes each block's Markdown from committed records
and writes it there, or reports the blocks that differ (``--check``). Used by ci/gpu/matrix_table.py and
benchmarks/results_page.py (each puts ``ci/`` on ``sys.path``)."""

from __future__ import annotations

import re
from pathlib import Path


def rewrite(text: str, tool: str, name: str, body: str) -> str:
    """``text`` with ``tool``'s block ``name`` replaced by ``body``.

    Raises:
        SystemExit: the block's markers are not there exactly once.
    """
    begin, end = f"<!-- {tool} {name} -->", f"<!-- {tool} end -->"
    pattern = re.compile(rf"^{re.escape(begin)}\n.*?^{re.escape(end)}$", re.S | re.M)
    if len(pattern.findall(text)) != 1:
        raise SystemExit(f"no single '{begin}' ... '{end}' block to write")
    return pattern.sub(lambda _: f"{begin}\n{body}\n{end}", text)


def stale(root: Path, tool: str, targets: dict[str, list[str]], made: dict[str, str]) -> list[str]:
    """The blocks (``file: name``) of ``targets`` (``{file under root: [block names]}``) that differ from ``made``."""
    out = []
    for file, names in targets.items():
        text = (root / file).read_text()
        out += [f"{file}: {name}" for name in names if rewrite(text, tool, name, made[name]) != text]
    return out


def write(root: Path, tool: str, targets: dict[str, list[str]], made: dict[str, str]) -> list[str]:
    """Rewrite every block of ``targets`` from ``made``; one line per file (``file: names written``)."""
    lines = []
    for file, names in targets.items():
        path = root / file
        text = path.read_text()
        for name in names:
            text = rewrite(text, tool, name, made[name])
        path.write_text(text)
        lines.append(f"{file}: {', '.join(names)} written")
    return lines
