"""A head over an int8-row table (escha's int8 ``lm_head``, an EXL3 pack's int8 embedding with a tied head): what
each way of serving it costs per logits call and on the device.

Three ways, on the device this runs on (CUDA / ROCm, else the CPU), at head shapes of real models:

* ``int8, dequantized per call``: the int8 rows stay on the device and the whole table is dequantized for each call
  (float32, then the model dtype), then one GEMM: what the int8 embedding method did before 2026-12-02.
* ``int8, int8_rows_logits``: the rows stay on the device and ``quantpack::int8_rows_logits_`` reads them once (on
  CUDA / ROCm its Triton kernel; on the CPU a few megabytes converted at a time): what the method does now.
* ``dense, decoded at load``: the table dequantized once at load into the model dtype, then vLLM's GEMM per call
  (what a runtime that expands the int8 head in its weight stream does).

Per shape and variant: milliseconds per call at each row count (median of ``--repeats`` calls after two warm-up
calls), the table's bytes on the device, and the scratch a call allocates (measured by torch's allocator on a GPU;
on the CPU computed from the variant's temporaries). Writes ``--json`` (default
``benchmarks/results/int8_head_<device>.json``) and prints a table. Usage: ``python3 benchmarks/int8_head.py
[--shapes 128256x4096,151936x5120] [--rows 1,8,64] [--dtype bfloat16]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

#: (vocab, hidden): Llama-3-8B's head, a Qwen3-32B-sized head (the size of escha's 27B model's)
SHAPES = "128256x4096,151936x5120"


def variants(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> dict:
    """Name -> (logits function of x, table bytes on the device, scratch bytes per call by construction)."""
    from quantpack_core import int8_logits
    from quantpack_core.int8_logits import int8_rows_logits

    vocab, width = q.shape
    int8_bytes = q.numel() + s.numel() * s.element_size()
    dense = (q.float() * s[:, None]).to(dtype)
    size = torch.finfo(dtype).bits // 8
    chunk = 0 if q.is_cuda and dtype != torch.float32 else int8_logits.CHUNK_ELEMENTS * size * 2
    return {
        "int8, dequantized per call": (
            lambda x: torch.nn.functional.linear(x, (q.float() * s[:, None]).to(x.dtype)),
            int8_bytes,
            vocab * width * (4 + size),
        ),
        "int8, int8_rows_logits": (lambda x: int8_rows_logits(x, q, s), int8_bytes, chunk),
        "dense, decoded at load": (
            lambda x: torch.nn.functional.linear(x, dense),
            dense.numel() * dense.element_size(),
            0,
        ),
    }


def main() -> None:
    """Measure every variant at every shape and row count; print and write the record."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    from serve_8b import timed

    def ms(fn) -> float:
        """Milliseconds of one call of ``fn`` (the device synchronized around it)."""
        return timed(fn) * 1000

    record = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "dtype": args.dtype,
        "shapes": [],
    }
    print("| head (vocab x hidden) | way | table MiB | scratch MiB per call | " + " | ".join(
        f"ms at {r} rows" for r in args.rows.split(",")) + " |")  # fmt: skip
    for shape in args.shapes.split(","):
        vocab, width = (int(v) for v in shape.split("x"))
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randint(-127, 128, (vocab, width), generator=g, device=device, dtype=torch.int8)
        s = torch.rand(vocab, generator=g, device=device) * 0.01 + 1e-3
        entry = {"vocab": vocab, "hidden": width, "ways": {}}
        for name, (fn, table_bytes, scratch) in variants(q, s, dtype).items():
            times = {}
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn((rows, width), generator=g, device=device).to(dtype)
                fn(x), fn(x)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                times[rows] = statistics.median(ms(lambda x=x, fn=fn: fn(x)) for _ in range(args.repeats))
                if device.type == "cuda":
                    scratch = torch.cuda.max_memory_allocated() - base - rows * vocab * x.element_size()
            entry["ways"][name] = {"ms": times, "table_bytes": table_bytes, "scratch_bytes": scratch}
            print(f"| {vocab} x {width} | {name} | {table_bytes / 2**20:,.0f} | {scratch / 2**20:,.0f} | "
                  + " | ".join(f"{t:.2f}" for t in times.values()) + " |", flush=True)  # fmt: skip
        record["shapes"].append(entry)
        del q, s
    out = args.json or Path(__file__).with_name("results") / f"int8_head_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
