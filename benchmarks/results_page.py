"""The benchmark records of ``benchmarks/results/`` as Markdown: one table per record, with the conditions the record
names (card or machine, vLLM and torch releases, commit), written into the generated blocks of ``docs/results.md``,
the README's speed figure and ``docs/kernels.md``'s stack table. Standard library only; the figures are the records',
nothing is typed by hand.

Usage (repository root)::

    python3 benchmarks/results_page.py            # print every block
    python3 benchmarks/results_page.py --write    # rewrite the blocks in README.md, docs/results.md, docs/kernels.md
    python3 benchmarks/results_page.py --check    # exit 1 where a block differs from what the records give

Each block sits between ``<!-- results_page.py NAME -->`` and ``<!-- results_page.py end -->`` lines.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "ci"))
import markdown_blocks  # noqa: E402  (the repository's ci/)

TOOL = "results_page.py"
RESULTS = ROOT / "benchmarks" / "results"
#: the engines of ``serve_8b.py`` records, as the tables name them
ENGINES = {
    "plugin": "vLLM + quantpack-exl3",
    "plugin-exllamav3": "vLLM + quantpack-exl3, exllamav3's kernels",
    "plugin-trellis_mma": "vLLM + quantpack-exl3, trellis_mma only",
    "bf16": "vLLM bf16",
    "w4a16": "vLLM W4A16",
    "exllamav3": "exllamav3's generator",
}
#: the lines of ``kernel_8b.py`` records in the order drawn: (kernel, variant); variant None is a launch per shard
KERNEL_LINES = (
    ("trellis_mma", "served"),
    ("trellis_mma", "fused"),
    ("trellis_mma", None),
    ("trellis_mma_tc", "fused"),
    ("trellis_mma_tc", None),
    ("trellis_mma_dense", "fused"),
    ("trellis_mma_dense", None),
    ("exllamav3", None),
    ("escha_trellis_mma", None),
    ("escha_triton", None),
)
#: the models of ``serve_8b.py`` records
MODELS = {
    "8b": "Llama-3-8B shape",
    "30b-a3b": "Qwen3-30B-A3B shape",
    "30b-a3b-mixed": "Qwen3-30B-A3B shape with three expert K groups",
}


def num(x: float) -> str:
    """A figure as the tables print it: an integer as it is, thousands grouped from 1,000, one decimal from 100, else 3
    significant digits."""
    if isinstance(x, int):
        return f"{x:,}"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.1f}" if abs(x) >= 100 else f"{x:#.3g}"


def conditions(record: dict) -> str:
    """The run's conditions as the record names them: card or device, vLLM, torch, commit; what it lacks, left out."""
    parts = []
    if card := record.get("gpu") or (record.get("device") if record.get("device") != "cpu" else None):
        parts.append(card)
    if record.get("cpus"):
        parts.append(f"{record['cpus']} CPU cores")
    parts += [f"vLLM {record['vllm']}"] if record.get("vllm") else []
    parts += [f"torch {record['torch']}"] if record.get("torch") else []
    parts.append(f"commit {record['commit'][:7]}" if record.get("commit") else "no commit recorded")
    return ", ".join(parts)


def wrap(text: str) -> str:
    """Prose wrapped at 118 columns (links and code kept whole)."""
    return textwrap.fill(text, 118, break_long_words=False, break_on_hyphens=False)


def table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def heading(path: Path, record: dict, what: str) -> str:
    rel = path.relative_to(ROOT).as_posix()
    return f"#### [`{path.name}`](../{rel})\n\n" + wrap(f"{what} ({conditions(record)}).")


def serve_section(path: Path, record: dict) -> str:
    """A ``serve_8b.py`` record: per engine and batch, decode tokens/s, ms per step, time to first token, prefill."""
    long = any("prefill2048_tok_s" in row for r in record["results"] for row in r["rows"])
    head = ["engine", "batch", "decode tok/s", "ms / step", "TTFT ms", "prefill 512 tok/s"]
    head += ["prefill 2,048 tok/s"] if long else []
    rows = []
    for res in record["results"]:
        for row in res["rows"]:
            cells = [ENGINES.get(res["engine"], res["engine"]), str(row["batch"]), num(row["decode_tok_s"])]
            cells += [num(row["ms_per_step"]), num(row["ttft_ms"]), num(row["prefill_tok_s"])]
            cells += [num(row["prefill2048_tok_s"]) if "prefill2048_tok_s" in row else ""] if long else []
            rows.append(cells)
    repeats = record.get("repeats", 1)
    what = f"Serving the {MODELS.get(record['model'], record['model'])}"
    what += f", the fastest of {repeats} repeats" if repeats > 1 else ", one run"
    weights = "; ".join(
        f"{ENGINES.get(r['engine'], r['engine'])} {num(r['weights_gib'])} GiB" for r in record["results"]
    )
    out = [heading(path, record, what), table(head, rows), wrap(f"Weights on the GPU: {weights}.")]
    if not_run := record.get("engines_not_run"):
        out.append(wrap("Not run: " + "; ".join(f"{ENGINES.get(e, e)} ({why})" for e, why in not_run.items()) + "."))
    return "\n\n".join(out)


def kernel_lines(record: dict) -> list[tuple[str, dict]]:
    """``(label, {rows: ms})`` per measured line of a ``kernel_8b.py`` record, then dense bf16 and the floor."""
    lines = []
    for kernel, variant in KERNEL_LINES:
        res = record.get("kernels", {}).get(kernel, {})
        res = res.get(variant, {}) if variant else res
        if "stack_ms" in res:  # a kernel the run skipped has its reason instead
            lines.append((f"`{kernel}` {variant or ''}".strip(), res["stack_ms"]))
    if "dense_bf16" in record:
        lines.append(("dense bf16 (cuBLAS)", record["dense_bf16"]["stack_ms"]))
    if "dense_route_gemms" in record:  # the route's GEMMs without its rebuild
        gemms = record["dense_route_gemms"]
        lines.append(("the dense route's GEMMs alone (float16)", gemms["stack_ms"]))
        lines.append(("the same, torch's default sums", gemms["default_sums_ms"]))
    return lines


#: the row counts of docs/kernels.md's stack table (docs/results.md's has every one measured)
KERNELS_DOC_ROWS = (1, 16, 64, 256, 1024, 4096)


def kernel_table(record: dict, only: tuple[int, ...] | None = None) -> str:
    """The stack's milliseconds per row count (columns; those of ``only`` where given) for each line (rows)."""
    lines = kernel_lines(record)
    counts = sorted({int(r) for _, ms in lines for r in ms if only is None or int(r) in only})
    rows = [[label, *(num(ms[str(c)]) if str(c) in ms else "" for c in counts)] for label, ms in lines]
    return table(["ms per call of the stack, at rows", *map(str, counts)], rows)


def kernel_section(path: Path, record: dict) -> str:
    """A ``kernel_8b.py`` record: the 8B stack's shards (every linear layer of 32 blocks and the head)."""
    settings = ", ".join(
        f"{k} {record[k]}" for k in ("ctas_per_sm", "ctas_per_sm_wide", "inline_transform_rows") if k in record
    )
    what = (
        f"The 8B stack's linear layers, {record['codebook']} K={record['layer_k']:g} (head K={record['head_k']:g}); "
        f"the EXL3 weights' bandwidth floor {num(record['exl3_bandwidth_floor_ms'])} ms at the measured copy rate"
        + (f"; settings: {settings}" if settings else "")
    )
    out = [heading(path, record, what), kernel_table(record)]
    if skipped := {k: r["skipped"] for k, r in record.get("kernels", {}).items() if "skipped" in r}:
        out.append(wrap("Not run: " + "; ".join(f"`{k}`, {why}" for k, why in skipped.items()) + "."))
    return "\n\n".join(out)


def profile_section(paths: list[Path]) -> str:
    """``profile_decode.py`` records of one model: each kernel group's microseconds per decode step, per run."""
    records = [json.loads(p.read_text()) for p in paths]
    groups = sorted({g for r in records for g in r["groups_us"]})
    head = ["µs per decode step", *(f"{ENGINES.get(r['engine'], r['engine'])}, batch {r['batch']}" for r in records)]
    rows = [[g, *(num(r["groups_us"][g]) if g in r["groups_us"] else "" for r in records)] for g in groups]
    rows.append(["wall time per step", *(num(r["wall_ms_per_step"] * 1000) for r in records)])
    names = ", ".join(f"[`{p.name}`](../{p.relative_to(ROOT).as_posix()})" for p in paths)
    title = f"#### The {MODELS.get(records[0]['model'], records[0]['model'])}'s decode step by kernel group"
    return f"{title}\n\n{wrap(f'{names} ({conditions(records[0])}).')}\n\n{table(head, rows)}"


def cpu_serve_section(path: Path, record: dict) -> str:
    """``cpu_serve.py``: each pack and its bf16 source, served side by side, medians over the rounds."""
    rows = []
    for pair in record["pairs"].values():
        for side in ("pack", "source"):
            r = pair[side]
            rows.append([f"`{r['model']}`", num(r["request_throughput"]), num(r["output_throughput"]),
                         num(r["mean_ttft_ms"]), num(r["mean_tpot_ms"])])  # fmt: skip
    what = (
        f"vLLM's OpenAI server on CPU, bfloat16, {record['prompts']} requests ({' '.join(record['bench'])}), "
        f"{record['rounds']} rounds alternating between the pack and its source, medians"
    )
    head = ["served model", "requests/s", "output tok/s", "mean TTFT ms", "mean TPOT ms"]
    return "\n\n".join([heading(path, record, what), table(head, rows)])


def cpu_load_section(path: Path, record: dict) -> str:
    """``cpu_load.py``: loading a synthetic pack on CPU, its runs side by side."""
    fields = {
        "pack_MiB": "pack, MiB", "largest_shard_MiB": "largest shard, MiB", "load_model_s": "vLLM's load_model, s",
        "decode_s": "decoding at load, s", "decode_trellis_MB_per_s": "decoding, MB/s of trellis",
        "excess_after_load_MiB": "RSS above the dense weights after load, MiB",
        "excess_peak_MiB": "RSS above the dense weights at the peak, MiB",
    }  # fmt: skip
    runs = list(record.values())
    rows = [
        [label, *(num(r[k]) if isinstance(r.get(k), (int, float)) else "" for r in runs)] for k, label in fields.items()
    ]
    rows.append(["shard files mapped after load", *(str(len(r.get("mapped_shards_after_load", []))) for r in runs)])
    first = runs[0]
    what = f"A synthetic {num(first['pack_MiB'])} MiB Llama pack loaded by vLLM on CPU, bfloat16"
    return "\n\n".join([heading(path, first, what), table(["", *(r["label"] for r in runs)], rows)])


def cpu_dequant_section(path: Path, record: dict) -> str:
    """``cpu_dequant.py``: the reference codec decoding whole shards on CPU."""
    rows = [[r["shape"], f"{r['codebook']} K={r['K']:g}", num(r["s"]), num(r["Mweights_per_s"]), num(r["MB_per_s"])]
            for r in record["runs"]]  # fmt: skip
    head = ["shard", "codebook", "s", "M weights/s", "MB/s of trellis"]
    return "\n\n".join([heading(path, record, "Decoding one shard with the core codec"), table(head, rows)])


def int8_head_section(path: Path, record: dict) -> str:
    """``int8_head.py``: the logits of an int8 embedding table used as the head, per way and row count."""
    rows = []
    for shape in record["shapes"]:
        for way, res in shape["ways"].items():
            ms = " / ".join(f"{num(v)} ({rows_})" for rows_, v in res["ms"].items())
            rows.append([f"{shape['vocab']} x {shape['hidden']}", way, ms, num(res["table_bytes"] / 2**20)])
    head = ["head", "way", "ms (rows)", "table MiB"]
    return "\n\n".join([heading(path, record, f"An int8 head, {record['dtype']}"), table(head, rows)])


def decode_floor_section(path: Path, record: dict) -> str:
    """``decode_floor.py``: the 8B stack's issue and bandwidth floors from the decode loop's instruction counts."""
    rows = [[cb, num(ms)] for cb, ms in record["stack_issue_floor_ms"].items()]
    rows.append(["bandwidth floor (every codebook)", num(record["stack_bandwidth_floor_ms"])])
    what = f"The 8B stack's floors on sm_{record['arch']}, {record['sms']} SMs at {record['clock_ghz']} GHz"
    return "\n\n".join([heading(path, record, what), table(["codebook", "issue floor, ms"], rows)])


def verify_section(path: Path, record: dict) -> str:
    """``verify_packs.py``: ``quantpack verify`` on each bundled pack against its stored reference logits."""
    rows = [[f"`{p['pack']}`", num(p["kl"]), num(p["kl_median"]), num(p["kl_max"]), f"{p['top1']:.1%}",
             str(p["positions"])] for p in record["packs"]]  # fmt: skip
    what = (
        "Each bundled pack decoded by the core codec into transformers' model of its config (float32, CPU) against "
        "its stored reference logits (exllamav3's forward), KL in nats per token; "
        f"transformers {record['transformers']}"
    )
    head = ["pack", "KL mean", "KL median", "KL worst position", "top-1", "positions"]
    return "\n\n".join([heading(path, record, what), table(head, rows)])


#: the CPU and other single records, by the start of their file name
CPU = {
    "cpu_serve": cpu_serve_section,
    "cpu_load": cpu_load_section,
    "cpu_dequant": cpu_dequant_section,
    "int8_head": int8_head_section,
    "decode_floor": decode_floor_section,
}


def section_of(path: Path) -> str:
    """A record's section by its name."""
    if path.name.startswith("serve_"):
        return serve_section(path, json.loads(path.read_text()))
    if path.name.startswith("kernel_8b"):
        return kernel_section(path, json.loads(path.read_text()))
    kind = next(k for k in CPU if path.name.startswith(k))
    return CPU[kind](path, json.loads(path.read_text()))


def speed_figure(results: Path = RESULTS) -> str:
    """The README's figure: decode and prefill of the 8B shape, the plugin against vLLM's other engines in the
    newest ``serve_8b.json``, with its conditions and the engines the record did not run."""
    record = json.loads((results / "serve_8b.json").read_text())
    by_engine = {r["engine"]: {row["batch"]: row for row in r["rows"]} for r in record["results"]}
    batches = sorted(set.intersection(*(set(rows) for rows in by_engine.values())))
    others = [e for e in ("bf16", "w4a16") if e in by_engine]
    decode = "; ".join(
        f"{ENGINES[e]} " + " / ".join(num(by_engine[e][b]["decode_tok_s"]) for b in batches)
        for e in ["plugin", *others]
    )
    prefill = "; ".join(
        f"{ENGINES[e]} " + " / ".join(num(by_engine[e][b]["prefill_tok_s"]) for b in batches)
        for e in ["plugin", *others]
    )
    missing = [ENGINES[e] for e in ("bf16", "w4a16") if e not in by_engine]
    text = (
        f"Decode tokens/s at batch {' / '.join(map(str, batches))} for an 8B Llama-shaped 4.0 bpw pack, random "
        f"weights: {decode}; "
        f"prefill of 512-token prompts, tokens/s: {prefill} ({conditions(record)}; "
        "`benchmarks/serve_8b.py`, [docs/results.md](docs/results.md))."
    )
    return wrap(text + (f" {' and '.join(missing)} did not run in this record." if missing else ""))


def blocks(results: Path = RESULTS) -> dict[str, str]:
    """Each block's Markdown by name."""
    paths = sorted(results.glob("*.json"))
    serving = [section_of(p) for p in paths if p.name.startswith("serve_")]
    kernels = [section_of(p) for p in paths if p.name.startswith("kernel_8b")]
    cpu = [section_of(p) for p in paths if any(p.name.startswith(k) for k in CPU)]
    models: dict[str, list[Path]] = {}
    for p in sorted((results / "profile").glob("*.json")):
        models.setdefault(json.loads(p.read_text())["model"], []).append(p)
    verify = results / "verify_cpu.json"
    return {
        "speed": speed_figure(results),
        "verify": verify_section(verify, json.loads(verify.read_text())) if verify.is_file() else "No record yet.",
        "serving": "\n\n".join(serving),
        "kernels": "\n\n".join(kernels),
        "profiles": "\n\n".join(profile_section(ps) for ps in models.values()),
        "cpu": "\n\n".join(cpu),
        "stack": kernel_table(json.loads((results / "kernel_8b.json").read_text()), KERNELS_DOC_ROWS),
    }


#: where each block goes
TARGETS = {
    "README.md": ["speed"],
    "docs/results.md": ["verify", "serving", "kernels", "profiles", "cpu"],
    "docs/kernels.md": ["stack"],
}


def stale(root: Path = ROOT, results: Path = RESULTS) -> list[str]:
    """The blocks (``file: name``) that differ from what the records give."""
    return markdown_blocks.stale(root, TOOL, TARGETS, blocks(results))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the blocks in place")
    ap.add_argument("--check", action="store_true", help="exit 1 where a block differs from the records")
    args = ap.parse_args(argv)
    made = blocks()
    if args.check:
        bad = markdown_blocks.stale(ROOT, TOOL, TARGETS, made)
        print("\n".join(f"{b}: regenerate with benchmarks/results_page.py --write" for b in bad) or "blocks current")
        return int(bool(bad))
    if not args.write:
        print("\n\n".join(f"<!-- {name} -->\n{body}" for name, body in made.items()))
        return 0
    print("\n".join(markdown_blocks.write(ROOT, TOOL, TARGETS, made)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
