"""The integer-op floor of the trellis_mma decode: instructions per tile from the compiled kernels' SASS, and what
they cost for the Llama-3-8B linear stack, beside the bandwidth floor.

Builds the trellis_mma library (``quantpack_core/trellis_mma/csrc/``) for one architecture (nvcc), disassembles it
(``cuobjdump -sass``: the CUDA toolkit's, or PyPI's ``nvidia-cuda-cuobjdump``), finds each kernel's innermost loop that
holds the ``HMMA`` instructions (one round of the cp.async ring: four groups of four tiles along k) and counts its
instructions per tile and warp, split by pipe: the ALU pipe (shifts, logic, permutes, compares, address adds) and the
FMA-heavy pipe (``IMAD``, ``IDP4A``) each take a warp instruction every two cycles per scheduler on sm_80 / sm_90,
everything else issues once. The floor of a stack is its tiles times the largest of (instructions, 2 x ALU, 2 x
FMA-heavy) over the GPU's schedulers and clock. Needs nvcc and cuobjdump, not a GPU. The expert kernels' loop (the same
decode through one 16-row fragment, one loop per K in one kernel) is counted too: the range over its K; and the kernels
of 2 rows and more (16- and 64-row fragments) at K = 4, per tile and warp (a 64-row kernel's tile serves its four 16-row
fragments: 8 HMMA).

Usage: ``python3 benchmarks/decode_floor.py [--arch 90] [--sms 132] [--clock-ghz 1.98] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import os
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
    raise SystemExit(
        "cuobjdump not found: install the CUDA toolkit or `pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`"
    )


def mangled(cb: int, ka: int, half: bool, mb: int, fused: bool) -> str:
    """The kernel's mangled-name fragment of ``trellis_mma_kernel<CB, KA, HALFK, MB, FUSED>``."""
    return f"trellis_mma_kernelILi{cb}ELi{ka}ELb{int(half)}ELi{mb}ELb{int(fused)}E"


def mangled_moe(cb: int, down: bool) -> str:
    """The kernel's mangled-name fragment of ``trellis_moe_kernel<CB, DOWN>`` (the expert banks: one decode loop per K
    of the codebook behind a switch)."""
    return f"trellis_moe_kernelILi{cb}ELb{int(down)}E"


def hmma_loops(sass: str, name: str) -> list[tuple[int, list[str]]]:
    """The innermost loops holding ``HMMA`` instructions of one kernel in a ``cuobjdump -sass`` listing, as (HMMA
    count, instructions), in address order."""
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
    spans = []
    for addr, text in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            lo = int(m.group(1), 16)
            body = [t for a, t in ins if lo <= a <= addr]
            if any("HMMA" in t for t in body):
                spans.append((lo, addr, body))
    inner = [sp for sp in spans if not any(o is not sp and sp[0] <= o[0] and o[1] <= sp[1] for o in spans)]
    return [(sum("HMMA" in t for t in body), body) for _, _, body in sorted(inner)]


def counts_of(hmma: int, body: list[str], mb: int = 1) -> dict:
    """Instructions per tile and warp of one HMMA loop of a kernel of ``mb`` 16-row fragments, in all and on the ALU
    and FMA-heavy pipes."""
    ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
    tiles = hmma / (2 * mb)  # two mma.m16n8k16 per tile and 16-row fragment
    return {
        "instructions": len(body) / tiles,
        "alu": sum(v for k, v in ops.items() if k in ALU) / tiles,
        "fma_heavy": sum(v for k, v in ops.items() if k in FMA_HEAVY) / tiles,
    }


def loop_counts(sass: str, name: str, mb: int = 1) -> dict:
    """Instruction counts per tile of the smallest innermost HMMA loop of one kernel (a kernel of one K)."""
    loops = hmma_loops(sass, name)
    if not loops:
        raise SystemExit(f"no HMMA loop found in {name}")
    return counts_of(*min(loops, key=lambda hb: len(hb[1])), mb=mb)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--sms", type=int, default=132, help="SMs of the GPU (132: H200)")
    ap.add_argument("--clock-ghz", type=float, default=1.98, help="SM clock (1.98: H200 boost)")
    ap.add_argument("--bandwidth-tbs", type=float, default=4.3)
    ap.add_argument("--json", type=Path, default=Path(__file__).with_name("results") / "decode_floor.json")
    args = ap.parse_args()

    from quantpack_core.trellis_mma import library

    so = library.build(args.arch)
    tool = cuobjdump()  # it runs nvdisasm, which PyPI's wheels put beside it
    env = {**os.environ, "PATH": f"{Path(tool).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    sass = subprocess.run([tool, "-sass", str(so)], capture_output=True, text=True, check=True, env=env).stdout
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
    # the kernels of 2 rows and more (the transformed input streamed into the CTA's A ring; 16- and 64-row
    # fragments), at the stack's K = 4
    streamed = {}
    for cb, cb_name in CODEBOOKS:
        for label, name, mb in [
            ("2-16 rows", mangled(cb, 4, False, 1, False), 1),
            ("17-64 rows", mangled(cb, 4, False, 4, False), 4),
        ]:
            counts = loop_counts(sass, name, mb)
            counts["cycles"] = max(counts["instructions"], 2 * counts["alu"], 2 * counts["fma_heavy"])
            streamed[f"{cb_name} K=4 {label}"] = counts
            print(
                f"{cb_name:5s} K=4 {label:19s}: {counts['instructions']:5.1f} instructions per tile and warp, "
                f"ALU {counts['alu']:4.1f}, FMA-heavy {counts['fma_heavy']:4.1f}"
            )
    experts = {}  # the expert kernel: one loop per K of the codebook (one 16-row fragment), gate/up and down
    for cb, cb_name in CODEBOOKS:
        for down in (False, True):
            per_k = [counts_of(*hb)["instructions"] for hb in hmma_loops(sass, mangled_moe(cb, down))]
            if not per_k:
                raise SystemExit(f"no HMMA loop found in {mangled_moe(cb, down)}")
            key = f"{cb_name} {'down' if down else 'gate/up'}"
            experts[key] = {"loops": len(per_k), "instructions_min": min(per_k), "instructions_max": max(per_k)}
            print(
                f"experts {key:13s}: {len(per_k)} K loops, {min(per_k):5.1f} - {max(per_k):5.1f} instructions per "
                "tile and warp"
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
        "streamed_per_tile": streamed,
        "experts_per_tile": experts,
        "stack_issue_floor_ms": stack,
        "stack_trellis_bytes": nbytes,
        "stack_bandwidth_floor_ms": bandwidth_ms,
    }
    args.json.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
