"""The integer-op floor of the trellis_mma decode: instructions per tile from the compiled kernels' SASS, and what
they cost for the Llama-3-8B linear stack, beside the bandwidth floor.

Builds ``csrc/trellis_mma.cu`` for one architecture (nvcc), disassembles it (``cuobjdump -sass``: the CUDA toolkit's,
or PyPI's ``nvidia-cuda-cuobjdump``), finds each kernel's innermost loop that holds the ``HMMA`` instructions (one
round of the cp.async ring: four groups of four tiles along k) and counts its instructions per tile and warp, split
by pipe: the ALU pipe (shifts, logic, permutes, compares, address adds) and the FMA-heavy pipe (``IMAD``, ``IDP4A``)
each take a warp instruction every two cycles per scheduler on sm_80 / sm_90, everything else issues once. The
floor of a stack is its tiles times the largest of (instructions, 2 x ALU, 2 x FMA-heavy) over the GPU's schedulers
and clock. Needs nvcc and cuobjdump, not a GPU. The expert kernels' loop (the same decode through one 16-row
fragment) is counted too, for K=4.

Usage: ``python3 benchmarks/decode_floor.py [--arch 90] [--sms 132] [--clock-ghz 1.98] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path

ALU = {"SHF", "LOP3", "LEA", "IADD3", "PRMT", "ISETP", "SEL", "MOV", "VIADD", "FSEL", "PLOP3", "BMSK", "SGXT"}
FMA_HEAVY = {"IMAD", "IDP"}
#: (codebook id, name), (template K, half-integer), the layers' and the head's K of the 8B benchmark stack
CODEBOOKS = [(0, "3inst"), (1, "mcg"), (2, "mul1")]
KS = [(ka, False) for ka in range(1, 9)] + [(ka, True) for ka in (1, 2, 3)]
HIDDEN, INTER, LAYERS, VOCAB = 4096, 14336, 32, 128256
LAYER_TILES = LAYERS * sum(i * o for i, o in [(HIDDEN, 4096), (HIDDEN, 1024), (HIDDEN, 1024), (HIDDEN, 4096),
                                               (HIDDEN, INTER), (HIDDEN, INTER), (INTER, HIDDEN)]) // 256  # fmt: skip
HEAD_TILES = HIDDEN * VOCAB // 256


def cuobjdump() -> str:
    """Path of cuobjdump (PATH, /usr/local/cuda, or PyPI's nvidia-cuda-cuobjdump wheel)."""
    found = shutil.which("cuobjdump") or (
        "/usr/local/cuda/bin/cuobjdump" if Path("/usr/local/cuda/bin/cuobjdump").exists() else None
    )
    if found:
        return found
    try:
        import nvidia

        for root in nvidia.__path__:
            hits = list(Path(root).glob("*/bin/cuobjdump"))
            if hits:
                return str(hits[0])
    except ImportError:
        pass
    raise SystemExit("cuobjdump not found: install the CUDA toolkit or `pip install nvidia-cuda-cuobjdump`")


def mangled(cb: int, ka: int, half: bool, mb: int, fused: bool) -> str:
    """The kernel's mangled-name fragment of ``trellis_mma_kernel<CB, KA, HALFK, MB, FUSED>``."""
    return f"trellis_mma_kernelILi{cb}ELi{ka}ELb{int(half)}ELi{mb}ELb{int(fused)}E"


def mangled_moe(cb: int, ka: int, half: bool, down: bool) -> str:
    """The kernel's mangled-name fragment of ``trellis_moe_kernel<CB, KA, HALFK, DOWN>`` (the expert banks)."""
    return f"trellis_moe_kernelILi{cb}ELi{ka}ELb{int(half)}ELb{int(down)}E"


def loop_counts(sass: str, name: str) -> dict:
    """Instruction counts per tile of the innermost HMMA loop of one kernel in a ``cuobjdump -sass`` listing."""
    lines, inside = [], False
    for line in sass.splitlines():
        if "Function : " in line:
            inside = name in line
        elif inside:
            lines.append(line)
    ins = []
    for line in lines:
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    best = None
    for addr, text in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            hmma = sum("HMMA" in t for t in body)
            if hmma and (best is None or len(body) < len(best[1])):
                best = (hmma, body)
    if best is None:
        raise SystemExit(f"no HMMA loop found in {name}")
    hmma, body = best
    ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
    tiles = hmma / 2  # two mma.m16n8k16 per tile and 16-row block
    return {
        "instructions": len(body) / tiles,
        "alu": sum(v for k, v in ops.items() if k in ALU) / tiles,
        "fma_heavy": sum(v for k, v in ops.items() if k in FMA_HEAVY) / tiles,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--sms", type=int, default=132, help="SMs of the GPU (132: H200)")
    ap.add_argument("--clock-ghz", type=float, default=1.98, help="SM clock (1.98: H200 boost)")
    ap.add_argument("--bandwidth-tbs", type=float, default=4.3)
    ap.add_argument("--json", type=Path, default=Path(__file__).with_name("results") / "decode_floor.json")
    args = ap.parse_args()

    from quantpack_exl3.backends.trellis_mma import library

    so = library.build(args.arch)
    sass = subprocess.run([cuobjdump(), "-sass", str(so)], capture_output=True, text=True, check=True).stdout
    per_kernel = {}
    for cb, cb_name in CODEBOOKS:
        for ka, half in KS:
            if half and cb_name != "mul1":
                continue
            k = ka + 0.5 * half
            counts = loop_counts(sass, mangled(cb, ka, half, 1, True))
            counts["cycles"] = max(counts["instructions"], 2 * counts["alu"], 2 * counts["fma_heavy"])
            per_kernel[f"{cb_name} K={k:g}"] = counts
            print(
                f"{cb_name:5s} K={k:<3g} per tile and warp: {counts['instructions']:5.1f} instructions, "
                f"ALU {counts['alu']:4.1f}, FMA-heavy {counts['fma_heavy']:4.1f} -> {counts['cycles']:5.1f} "
                "scheduler cycles"
            )
    experts = {}  # the expert kernel's loop (same decode, one 16-row fragment), K=4, gate/up and down launches
    for cb, cb_name in CODEBOOKS:
        for down in (False, True):
            counts = loop_counts(sass, mangled_moe(cb, 4, False, down))
            experts[f"{cb_name} K=4 {'down' if down else 'gate/up'}"] = counts
            print(
                f"experts {cb_name:5s} K=4 {'down   ' if down else 'gate/up'}: {counts['instructions']:5.1f} "
                f"instructions per tile and warp, ALU {counts['alu']:4.1f}, FMA-heavy {counts['fma_heavy']:4.1f}"
            )
    schedulers = 4 * args.sms * args.clock_ghz * 1e9
    stack = {}
    for _, cb_name in CODEBOOKS:
        cycles = (
            LAYER_TILES * per_kernel[f"{cb_name} K=4"]["cycles"] + HEAD_TILES * per_kernel[f"{cb_name} K=6"]["cycles"]
        )
        stack[cb_name] = cycles / schedulers * 1000
    nbytes = (LAYER_TILES * 4 + HEAD_TILES * 6) * 256 // 8
    bandwidth_ms = nbytes / (args.bandwidth_tbs * 1e12) * 1000
    print(f"8B stack (layers K=4, head K=6), {LAYER_TILES + HEAD_TILES:,} tiles at {args.sms} SMs x 4 schedulers x "
          f"{args.clock_ghz} GHz: " + ", ".join(f"{c} {ms:.2f} ms" for c, ms in stack.items())
          + f"; trellis bytes {nbytes / 1e9:.2f} GB at {args.bandwidth_tbs} TB/s: {bandwidth_ms:.2f} ms")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "arch": args.arch,
        "sms": args.sms,
        "clock_ghz": args.clock_ghz,
        "per_tile": per_kernel,
        "experts_per_tile": experts,
        "stack_issue_floor_ms": stack,
        "stack_trellis_bytes": nbytes,
        "stack_bandwidth_floor_ms": bandwidth_ms,
    }
    args.json.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
