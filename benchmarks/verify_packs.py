"""``quantpack verify`` on every bundled pack that stores its reference logits: each pack decoded by the core codec into
transformers' model of its config (float32, CPU) against its ``reference_logits.pt`` (exllamav3's own forward of the
pack), KL in nats per token and top-1 agreement. Writes a record for ``docs/results.md`` (``results_page.py``).

Usage (repository root, the workspace's venv): ``.venv/bin/python benchmarks/verify_packs.py [--json OUT]`` (about
two minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import torch
import transformers

from quantpack_core.verify import verify_pack

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """HEAD, with ``-dirty`` where tracked files differ from it."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=ROOT).returncode != 0
    return head + ("-dirty" if dirty else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "verify_cpu.json")
    args = ap.parse_args()
    packs = []
    for reference in sorted(ROOT.glob("fixtures/*/reference_logits.pt")):
        started = time.monotonic()
        verdict = verify_pack(reference.parent)
        a = verdict.agreement
        packs.append({
            "pack": reference.parent.name, "kl": a.kl, "kl_median": a.kl_median, "kl_max": a.kl_max, "top1": a.top1,
            "positions": a.positions, "within_bounds": verdict.ok, "s": time.monotonic() - started,
        })  # fmt: skip
        print(f"{reference.parent.name}: KL {a.kl:.3g}, top-1 {a.top1:.1%} over {a.positions} ({packs[-1]['s']:.0f} s)")
    record = {
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "packs": packs,
    }
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
