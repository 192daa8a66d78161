"""Where a decode step's GPU time goes, kernel by kernel: vLLM + quantpack-exl3 against vLLM bf16 on the Llama-3-8B
shape of ``decode_8b.py`` (or ``--model 30b-a3b`` / ``30b-a3b-mixed``, the MoE shapes of ``serve_8b.py``), so that the
time outside the linear layers and expert banks can be compared (end to end the plugin's step is longer than its
linear stack by more than bf16's is).

One engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the profiler sees the model's kernels): after a
warm-up, ``torch.profiler`` records one generation of ``--steps`` tokens for ``--batch`` prompts of 64 tokens; every
kernel's device time is summed and divided by the steps, and the kernels are grouped (the project's linear kernels,
exllamav3's, cuBLAS / CUTLASS GEMMs, attention, Triton kernels Inductor generated, copies and the rest). With CUDA
graphs (the default) the profiler sees the kernels of graph replays where CUPTI reports graph nodes; ``--eager``
runs without graphs (each kernel launched, the same kernels).

Usage (GPU machine, after ci/gpu/setup.sh): ``source ci/gpu/env.sh && python3 benchmarks/profile_decode.py --engine
plugin [--model 8b] [--batch 1] [--steps 64] [--eager] [--json OUT]``; ``--engine bf16`` profiles vLLM bf16 on the
same config.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

#: kernel-name patterns -> group, first match wins
GROUPS = [
    ("quantpack experts (trellis_moe)", r"trellis_moe|moe_sort"),
    ("quantpack linear (trellis_mma)", r"trellis_mma|input_transform_kernel"),
    ("vLLM MoE (fused_moe, routing)", r"fused_moe|moe_align|topk|moe_sum"),
    ("exllamav3", r"exl3|reconstruct|had_r_128|hgemm"),
    ("cuBLAS / CUTLASS GEMM", r"gemm|nvjet|cutlass|sm90_xmma|cublas"),
    ("attention", r"attn|attention|paged|flash|reshape_and_cache"),
    ("Inductor / Triton", r"^triton_|triton"),
    ("copies and fills", r"copy|memcpy|memset|fill|cat"),
]


def group_of(name: str) -> str:
    """The :data:`GROUPS` entry a kernel name falls into ("other" when none)."""
    for group, pattern in GROUPS:
        if re.search(pattern, name, re.IGNORECASE):
            return group
    return "other"


def main() -> None:
    """Profile one engine's decode and print the per-step device time per kernel group and the top kernels."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("8b", "30b-a3b", "30b-a3b-mixed"), default="8b")
    ap.add_argument("--pack", type=Path, help="the EXL3 pack (written there unless present); default per model")
    ap.add_argument("--engine", choices=("plugin", "bf16"), default="plugin")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from serve_8b import MODELS, dummy_model, prompt_ids, vocab_size
    from vllm import LLM, SamplingParams

    make_pack, _, w4a16, default_pack, _ = MODELS[args.model]
    pack = args.pack or Path(default_pack)
    make_pack(pack)
    model = pack if args.engine == "plugin" else dummy_model(pack, "bf16", w4a16)
    llm = LLM(
        model=str(model),
        dtype="float16" if args.engine == "plugin" else "bfloat16",
        max_model_len=1024,
        max_num_seqs=max(args.batch, 1),
        skip_tokenizer_init=True,
        seed=0,
        load_format="auto" if args.engine == "plugin" else "dummy",
        enable_prefix_caching=False,
        enforce_eager=args.eager,
        attention_backend="TRITON_ATTN",
        gpu_memory_utilization=0.6,
    )
    vocab = vocab_size(model)

    def generate(new: int) -> float:
        prompts = [{"prompt_token_ids": ids} for ids in prompt_ids(args.batch, 64, vocab)]
        sp = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, detokenize=False)
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    generate(16)
    wall = generate(args.steps + 1) - generate(1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        generate(args.steps + 1)
    kernels: dict[str, list[float]] = {}
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", 0.0) or 0.0
        if us > 0:
            kernels[event.key] = [us / args.steps, event.count / args.steps]
    groups: dict[str, float] = {}
    for name, (us, _) in kernels.items():
        groups[group_of(name)] = groups.get(group_of(name), 0.0) + us
    total = sum(groups.values())
    mode = "eager" if args.eager else "CUDA graphs"
    print(f"{args.model} {args.engine}, batch {args.batch}, {mode}: wall {wall / args.steps * 1000:.3f} ms per step; "
          "device time")  # fmt: skip
    print(f"seen by the profiler {total / 1000:.3f} ms per step (the prompt's prefill spread over the steps)")
    for group, us in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {group:32s} {us / 1000:8.3f} ms")
    print("top kernels (us per step, launches per step):")
    for name, (us, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:25]:
        print(f"  {us:9.1f}  {count:6.1f}  {name[:110]}")
    if args.json:
        record = {"model": args.model, "engine": args.engine, "batch": args.batch, "steps": args.steps,
                  "eager": args.eager, "wall_ms_per_step": wall / args.steps * 1000, "groups_us": groups,
                  "kernels_us": kernels}  # fmt: skip
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
