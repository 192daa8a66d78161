"""CPU dequantization speed of EXL3 layers: what loading a pack on CPU spends per layer (the reference kernels decode
every shard to a dense weight at load, ``quantpack_core.codec.dequantize``: trellis decode, two 128-block Hadamard
transforms, suh / svh).

Random trellis words (decode speed does not depend on the values) for the shapes of a Llama-3-8B layer and of the
hidden-2048 layers of the synthetic pack in docs/install.md's CPU load figures, at K=4 mul1 and K=3 3INST; per shape
the median of ``--repeats`` runs: seconds, MB/s of trellis read, million weights/s, and the process's peak RSS.
Writes ``--json`` (default ``benchmarks/results/cpu_dequant.json``). Usage: ``.venv/bin/python
benchmarks/cpu_dequant.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import time
from pathlib import Path

import torch

#: (name, in, out)
SHAPES = [("2048x8192 (hidden 2048 MLP)", 2048, 8192), ("4096x14336 (8B gate)", 4096, 14336)]
CASES = [(4.0, "mul1"), (3.0, "3inst")]


def main() -> None:
    """Time every shape and case, print a table and write the JSON record."""
    from quantpack_core.codec import Exl3Tensors, dequantize
    from quantpack_core.synthetic import random_exl3_layer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=Path(__file__).with_name("results") / "cpu_dequant.json")
    args = ap.parse_args()
    record = {"host": platform.node(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "runs": []}  # fmt: skip
    print("| shape | K, codebook | s | MB/s of trellis | Mweights/s |\n|---|---|---|---|---|")
    for name, k_in, n_out in SHAPES:
        for k_bits, codebook in CASES:
            g = torch.Generator().manual_seed(0)
            t = Exl3Tensors.from_tensors(random_exl3_layer(k_in, n_out, k_bits, codebook, generator=g))
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                w = dequantize(t, torch.float32)
                times.append(time.perf_counter() - t0)
                del w
            s = statistics.median(times)
            mb = t.trellis.numel() * 2 / 1e6
            run = {"shape": name, "K": k_bits, "codebook": codebook, "s": s, "trellis_MB": mb,
                   "MB_per_s": mb / s, "Mweights_per_s": k_in * n_out / s / 1e6}  # fmt: skip
            record["runs"].append(run)
            print(f"| {name} | {k_bits:g} {codebook} | {s:.3f} | {mb / s:.1f} | {run['Mweights_per_s']:.1f} |")
    record["peak_rss_MiB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {record['peak_rss_MiB']:.0f} MiB")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
