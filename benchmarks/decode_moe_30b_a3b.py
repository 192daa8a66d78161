"""Decode speed on a Qwen3-30B-A3B-shaped EXL3 MoE pack, batch 1 and batch 64: vLLM + quantpack-exl3.

The pack is synthetic (random trellis words decode like real weights; speed does not depend on the values), written
once by this script with the shapes of Qwen3-30B-A3B (hidden 2048, 48 layers, 32 query / 4 key-value heads of 128,
128 experts of width 768, top-8, vocabulary 151936): attention and experts at K=4 mul1, lm_head at K=6, a bf16
embedding and router, a word-level tokenizer covering the vocabulary. ``--mixed`` gives the experts three K groups
per layer (gate/up and down at 4/4, 3/4 and 2/3 over 64 / 40 / 24 experts) instead.

Measured per batch size B: tokens per second of greedy decoding (B prompts of 64 tokens, 128 new tokens each, minus
the time of a 1-token generation, best of 3), i.e. ``B * 128 / t``; the engine runs with torch.compile and CUDA
graphs captured for 1..64 sequences.

Usage (GPU machine, after ci/gpu/setup.sh): ``source ci/gpu/env.sh && python3 benchmarks/decode_moe_30b_a3b.py
[--pack DIR] [--mixed] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

SHAPE = dict(
    hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, moe_intermediate=768, vocab=151936
)
PROMPT_TOKENS = 64
DECODE_TOKENS = 128
BATCHES = (1, 64)


def expert_k(e: int, mixed: bool) -> tuple[float, float]:
    """(K of gate/up, K of down) of expert ``e``."""
    if not mixed or e < 64:
        return 4, 4
    return (3, 4) if e < 104 else (2, 3)


def make_pack(path: Path, mixed: bool) -> Path:
    """Write the synthetic pack (about 14 GiB at K=4) unless it is already there."""
    if (path / "config.json").exists():
        return path
    import torch

    from quantpack_core.synthetic import random_exl3_layer, write_pack, write_word_tokenizer

    s = SHAPE
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}

    def linear(name, i, o, k_bits):
        for suffix, t in random_exl3_layer(i, o, k_bits, "mul1", generator=g, scale=0.02, device=dev).items():
            tensors[f"{name}.{suffix}"] = t.cpu()

    def dense(name, *shape, value=None):
        t = torch.full(shape, value) if value is not None else 0.02 * torch.randn(*shape, generator=g, device=dev)
        tensors[name] = t.to(torch.bfloat16).cpu()

    h, hd = s["hidden"], s["head_dim"]
    for n in range(s["layers"]):
        p = f"model.layers.{n}"
        linear(f"{p}.self_attn.q_proj", h, s["heads"] * hd, 4)
        linear(f"{p}.self_attn.k_proj", h, s["kv_heads"] * hd, 4)
        linear(f"{p}.self_attn.v_proj", h, s["kv_heads"] * hd, 4)
        linear(f"{p}.self_attn.o_proj", s["heads"] * hd, h, 4)
        dense(f"{p}.self_attn.q_norm.weight", hd, value=1.0)
        dense(f"{p}.self_attn.k_norm.weight", hd, value=1.0)
        for e in range(s["experts"]):
            kgu, kd = expert_k(e, mixed)
            linear(f"{p}.mlp.experts.{e}.gate_proj", h, s["moe_intermediate"], kgu)
            linear(f"{p}.mlp.experts.{e}.up_proj", h, s["moe_intermediate"], kgu)
            linear(f"{p}.mlp.experts.{e}.down_proj", s["moe_intermediate"], h, kd)
        dense(f"{p}.mlp.gate.weight", s["experts"], h)
        dense(f"{p}.input_layernorm.weight", h, value=1.0)
        dense(f"{p}.post_attention_layernorm.weight", h, value=1.0)
    linear("lm_head", h, s["vocab"], 6)
    dense("model.embed_tokens.weight", s["vocab"], h)
    dense("model.norm.weight", h, value=1.0)
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": h,
        "intermediate_size": 6144,
        "moe_intermediate_size": s["moe_intermediate"],
        "num_experts": s["experts"],
        "num_experts_per_tok": s["top_k"],
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": hd,
        "vocab_size": s["vocab"],
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "bfloat16",
    }
    write_pack(path, tensors, config, shards=16)  # the default quant config: exl3, 4 bits, head 6, mul1
    write_word_tokenizer(path, s["vocab"])
    return path


def bench_vllm(pack: Path) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(
        model=str(pack),
        dtype="float16",
        max_model_len=1024,
        gpu_memory_utilization=0.5,
        max_num_seqs=max(BATCHES),
        attention_backend="TRITON_ATTN",
        skip_tokenizer_init=True,
        seed=0,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]},
    )
    load_s = time.time() - t0

    def model_bytes(model) -> int:
        return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()] if t.is_cuda)

    weights_gib = llm.apply_model(model_bytes)[0] / 2**30
    out = {"engine": "vLLM + quantpack-exl3 (exllamav3 kernels, CUDA graphs)", "load_s": load_s}
    out["model_on_device_gib"] = weights_gib
    for batch in BATCHES:
        prompts = [{"prompt_token_ids": [100 + (b * 7 + i) % 5000 for i in range(PROMPT_TOKENS)]} for b in range(batch)]

        def run(n: int, prompts=prompts) -> float:
            torch.cuda.synchronize()
            t = time.perf_counter()
            llm.generate(
                prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False), use_tqdm=False
            )
            torch.cuda.synchronize()
            return time.perf_counter() - t

        run(DECODE_TOKENS + 1)  # warm
        best = min(run(DECODE_TOKENS + 1) - run(1) for _ in range(3))
        out[f"batch{batch}_tok_s"] = batch * DECODE_TOKENS / best
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", type=Path, default=None)
    ap.add_argument("--mixed", action="store_true", help="three expert K groups per layer instead of K=4 everywhere")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--make-only", action="store_true", help="write the pack and stop")
    args = ap.parse_args()
    pack = args.pack or Path("/tmp/bench-30b-a3b-exl3" + ("-mixed" if args.mixed else ""))
    t0 = time.time()
    make_pack(pack, args.mixed)
    size = sum(f.stat().st_size for f in pack.glob("*.safetensors")) / 2**30
    print(f"pack {pack}: {size:.2f} GiB of safetensors (made/checked in {time.time() - t0:.0f} s)", flush=True)
    if args.make_only:
        return
    res = bench_vllm(pack)
    print("\n| pack | batch-1 decode tok/s | batch-64 decode tok/s | load s | model on GPU (GiB) |")
    print("|---|---|---|---|---|")
    print(
        f"| {pack.name} | {res['batch1_tok_s']:.1f} | {res['batch64_tok_s']:.1f} | {res['load_s']:.0f} | "
        f"{res['model_on_device_gib']:.2f} |"
    )
    print("RESULT " + json.dumps(res), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"shape": SHAPE, "mixed": args.mixed, "pack_gib": size, **res}, indent=1))


if __name__ == "__main__":
    main()
