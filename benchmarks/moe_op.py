"""Time one expert bank of a Qwen3-30B-A3B-shaped MoE layer (128 experts, top 8, hidden 2048, expert width 768,
K = 4 mul1) through ``quantpack::trellis_moe_`` on each of its paths, beside vLLM's own bf16 fused-MoE Triton kernel
on a bf16 bank of the same shape, at 16 .. 8192 tokens.

Paths: ``mma16`` (the 16-row mma.sync kernel for every call: ``moe_tc_picks`` 0), ``tc64`` (the tensor-core path for
every call, Hopper: ``moe_tc_picks`` 1) and ``served`` (the default setting: the path the op takes in serving).
Each cell: ``--repeats`` timings of 10 back-to-back eager calls after a warm-up call, min and median in ms per call.
The record (JSON) names the card, torch, vLLM, the commit and the settings; the crossover of ``mma16`` and ``tc64``
is where ``moe_tc_picks`` belongs.

    python3 benchmarks/moe_op.py --json benchmarks/results/moe_op.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packages" / "quantpack-exl3" / "tests"))  # the GPU tests' bank builders
sys.path.insert(0, str(ROOT / "benchmarks"))

EXPERTS, TOP_K, HIDDEN, INTER, K = 128, 8, 2048, 768, 4
PATHS = {"mma16": {"moe_tc_picks": 0}, "tc64": {"moe_tc_picks": 1}, "served": None}


def time_calls(call, repeats: int) -> dict:
    """Min and median ms per call over ``repeats`` timings of 10 calls."""
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            call()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 10)
    return {"min_ms": min(times), "median_ms": statistics.median(times), "repeats": repeats}


def bench_paths(tokens_list: list[int], repeats: int) -> dict:
    from test_exl3_gpu_moe import GroupedBanks, _kernel, random_bank, routing

    t0 = time.time()
    bank = random_bank([(K, K)] * EXPERTS, HIDDEN, INTER, "mul1", seed=0)
    print(f"bank made in {time.time() - t0:.1f} s", flush=True)
    kernel = _kernel("trellis_mma").kernel
    out = {}
    for path, settings in PATHS.items():
        backend = GroupedBanks(kernel, "trellis_moe_", path, settings)
        run = backend.prepare_moe(bank, HIDDEN, INTER, torch.float16, torch.device("cuda"))
        rows = []
        for tokens in tokens_list:
            x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.float16)
            ids, w = routing(tokens, EXPERTS, TOP_K, 0)
            y = torch.empty_like(x)
            cell = time_calls(lambda: run.run(x, ids, w, *run.tensors.values(), *run.static, y), repeats)  # noqa: B023
            rows.append({"tokens": tokens, **cell})
            print(
                f"{path:7s} {tokens:5d} tokens: min {cell['min_ms']:.3f} median {cell['median_ms']:.3f} ms", flush=True
            )
        out[path] = rows
    return out


def bench_vllm_bf16(tokens_list: list[int], repeats: int) -> list[dict] | str:
    """vLLM's fused_experts (Triton) on a random bf16 bank of the same shape, or why it could not run."""
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
    except ImportError as e:
        return f"vLLM's fused_experts could not be imported: {e}"
    g = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    from test_exl3_gpu_moe import routing

    rows = []
    for tokens in tokens_list:
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        ids, w = routing(tokens, EXPERTS, TOP_K, 0)
        cell = time_calls(lambda: fused_experts(x, w1, w2, w.float(), ids), repeats)  # noqa: B023
        rows.append({"tokens": tokens, **cell})
        print(f"bf16    {tokens:5d} tokens: {cell['min_ms']:.3f} / {cell['median_ms']:.3f} ms", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="16,64,128,256,512,1024,2048,4096,8192")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "moe_op.json")
    args = ap.parse_args()
    from kernel_8b import commit

    from quantpack_core.trellis_mma import settings

    tokens_list = [int(t) for t in args.tokens.split(",")]
    try:
        import vllm

        vllm_version = vllm.__version__
    except ImportError:
        vllm_version = None
    record = {
        "shape": {"experts": EXPERTS, "top_k": TOP_K, "hidden": HIDDEN, "inter": INTER, "k": K, "codebook": "mul1"},
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "vllm": vllm_version,
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "served_moe_tc_picks": settings.current().moe_tc_picks,
        "timing": "eager, 10 calls per timing after a warm-up call; min and median of the timings",
        "paths": bench_paths(tokens_list, args.repeats),
        "vllm_bf16_fused_experts": bench_vllm_bf16(tokens_list, args.repeats),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
