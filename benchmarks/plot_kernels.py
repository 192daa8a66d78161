"""Plots of the benchmark records in ``benchmarks/results/``: ``kernel_8b.json`` (``kernel_8b.py``) and, when present,
``serve_8b.json`` (``serve_8b.py``), each drawn to a PNG beside it.

* kernel_8b.png: left, the 8B stack's milliseconds per row count for every kernel, dense bf16 and the EXL3 bandwidth
  floor (at the run's measured copy bandwidth and at 4.3 TB/s); right, each shape class at the largest row count,
  per kernel.
* serve_<model>.png: decode tokens/s per batch size for every engine, per ``serve_8b.py`` record.
* moe_op.png: milliseconds per call of one 30B-A3B expert bank per token count, each path of the op and vLLM's bf16
  fused MoE (``moe_op.py``).

Usage: ``uv run --group bench python3 benchmarks/plot_kernels.py [--results DIR]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: the H200's device-to-device copy rate as measured before on the benchmark machine (4.3 TB/s)
NOMINAL_BANDWIDTH = 4.3e12


def plot_kernels(record: dict, out: Path) -> None:
    """Draw a ``kernel_8b.py`` record (see the module) to ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for name, res in record["kernels"].items():
        if "stack_ms" not in res:
            continue
        rows = sorted(int(r) for r in res["stack_ms"])
        left.plot(rows, [res["stack_ms"][str(r)] for r in rows], marker="o", label=f"EXL3 {name}")
        if "fused" in res:
            fused = res["fused"]["stack_ms"]
            left.plot(rows, [fused[str(r)] for r in rows], marker="^", label=f"EXL3 {name}, q/k/v and gate/up fused")
        if "served" in res:
            served = res["served"]["stack_ms"]
            label = f"EXL3 {name} as served (each row bucket on the kernel measured fastest at load)"
            left.plot(rows, [served[str(r)] for r in rows], marker="*", lw=2, label=label)
    dense = record.get("dense_bf16")
    if dense:
        rows = sorted(int(r) for r in dense["stack_ms"])
        left.plot(rows, [dense["stack_ms"][str(r)] for r in rows], marker="s", color="k", label="dense bf16 (cuBLAS)")
    floor = record["exl3_bandwidth_floor_ms"]
    left.axhline(floor, ls="--", color="gray", label=f"EXL3 bytes at measured copy rate ({floor:.2f} ms)")
    nominal = record["exl3_bytes"] / NOMINAL_BANDWIDTH * 1000
    left.axhline(nominal, ls=":", color="gray", label=f"EXL3 bytes at 4.3 TB/s ({nominal:.2f} ms)")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("rows (tokens in the batch)")
    left.set_ylabel("ms per pass over the 225 linears")
    k, head = record["layer_k"], record["head_k"]
    left.set_title(f"Llama-3-8B linear stack, K={k:g} {record['codebook']} (head K={head:g})")
    left.legend(fontsize=7, loc="upper left")

    kernels = [(n, r) for n, r in record["kernels"].items() if "class_ms" in r]
    if kernels:
        first = kernels[0][1]["class_ms"]
        row = max(first, key=int)
        classes = list(first[row])
        width = 0.8 / len(kernels)
        for i, (name, res) in enumerate(kernels):
            xs = [c + i * width for c in range(len(classes))]
            right.bar(xs, [res["class_ms"][row][c] for c in classes], width, label=name)
        right.set_xticks([c + 0.4 - width / 2 for c in range(len(classes))], classes)
        right.set_ylabel("ms for the 32 layers' shards of the class (the head: 1)")
        right.set_title(f"per shape class at {row} row(s)")
        right.legend(fontsize=8)
    fig.suptitle(f"{record['gpu']}, {record['date']}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_serve(record: dict, out: Path) -> None:
    """Draw a ``serve_8b.py`` record (decode tokens/s per batch and engine) to ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for res in record["results"]:
        if "rows" not in res:
            continue
        batches = [r["batch"] for r in res["rows"]]
        ax.plot(batches, [r["decode_tok_s"] for r in res["rows"]], marker="o", label=res["engine"])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (concurrent sequences)")
    ax.set_ylabel("decode tokens/s")
    shape = {"8b": "Llama-3-8B", "30b-a3b": "Qwen3-30B-A3B", "30b-a3b-mixed": "Qwen3-30B-A3B, 3 K groups"}
    title = shape.get(record.get("model", "8b"), record.get("model"))
    ax.set_title(f"{title} shape, decode after 64-token prompts ({record['date']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_moe_op(record: dict, out: Path) -> None:
    """Draw a ``moe_op.py`` record (see the module) to ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    series = dict(record["paths"])
    if isinstance(record.get("vllm_bf16_fused_experts"), list):
        series["vLLM bf16 fused_experts"] = record["vllm_bf16_fused_experts"]
    for name, rows in series.items():
        ax.plot([r["tokens"] for r in rows], [r["min_ms"] for r in rows], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens (top 8 of 128 experts)")
    ax.set_ylabel("ms per call (min)")
    ax.set_title(f"one 30B-A3B expert bank, K 4, {record['gpu']} ({record['date']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    """Draw every record present in the results folder."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=Path(__file__).with_name("results"))
    args = ap.parse_args()
    plots = (("kernel_8b.json", plot_kernels), ("serve_*.json", plot_serve), ("moe_op.json", plot_moe_op))
    for pattern, draw in plots:
        for src in sorted(args.results.glob(pattern)):
            draw(json.loads(src.read_text()), src.with_suffix(".png"))
            print(f"wrote {src.with_suffix('.png')}")


if __name__ == "__main__":
    main()
