"""Batch-1 decode speed on a Llama-3-8B-shaped EXL3 pack: vLLM + quantpack-exl3 against exllamav3 itself.

The pack is synthetic (random trellis words, which decode like real weights: every bit pattern is a legal trellis),
written once by this script with the shapes of Llama-3-8B (hidden 4096, MLP 14336, 32 layers, 32/8 heads, vocabulary
128256), K=4 mul1 for the layers and K=6 for lm_head, a bf16 embedding and a word-level tokenizer covering the whole
vocabulary. Decode speed does not depend on the values.

Measured per engine: tokens per second of greedy batch-1 decoding (256 tokens after a 64-token prompt, minus the
time of a 1-token generation, best of 3), and for vLLM the process's host RSS before building the engine and after
loading (host copies of the weights must not stay behind) and the GPU memory the model weights take.

Usage (GPU machine, after ci/gpu/setup.sh): ``source ci/gpu/env.sh && python3 benchmarks/decode_8b.py [--pack DIR]
[--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

SHAPE = dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128, vocab=128256)
PROMPT_TOKENS = 64
DECODE_TOKENS = 256


def make_pack(
    path: Path, shape: dict | None = None, *, shards: int = 8, head_first: bool = False, max_positions: int = 8192
) -> Path:
    """Write a synthetic Llama-shaped EXL3 pack unless it is already there: ``shape`` (default :data:`SHAPE`, the 8B
    one: 4.6 GiB), K=4 mul1 layers, a K=6 head and a bf16 embedding, in ``shards`` files. ``head_first`` writes the
    head and the embedding before the layers, so that they share the first shard as in the packs exllamav3 writes
    (``cpu_load.py``). Written under ``<path>.partial`` and renamed when complete."""
    if (path / "config.json").exists():
        return path
    import torch

    from quantpack_core.synthetic import random_exl3_layer, write_pack, write_word_tokenizer

    s = shape or SHAPE
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}

    def linear(name, i, o, k_bits):
        for suffix, t in random_exl3_layer(i, o, k_bits, "mul1", generator=g, scale=0.02, device=dev).items():
            tensors[f"{name}.{suffix}"] = t.cpu()

    def head_and_embedding():
        linear("lm_head", s["hidden"], s["vocab"], 6)
        tensors["model.embed_tokens.weight"] = (
            (0.02 * torch.randn(s["vocab"], s["hidden"], generator=g, device=dev)).bfloat16().cpu()
        )

    if head_first:
        head_and_embedding()
    attn, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    for n in range(s["layers"]):
        p = f"model.layers.{n}"
        for proj, o in (("q_proj", attn), ("k_proj", kv), ("v_proj", kv)):
            linear(f"{p}.self_attn.{proj}", s["hidden"], o, 4)
        linear(f"{p}.self_attn.o_proj", attn, s["hidden"], 4)
        linear(f"{p}.mlp.gate_proj", s["hidden"], s["intermediate"], 4)
        linear(f"{p}.mlp.up_proj", s["hidden"], s["intermediate"], 4)
        linear(f"{p}.mlp.down_proj", s["intermediate"], s["hidden"], 4)
        tensors[f"{p}.input_layernorm.weight"] = torch.ones(s["hidden"], dtype=torch.bfloat16)
        tensors[f"{p}.post_attention_layernorm.weight"] = torch.ones(s["hidden"], dtype=torch.bfloat16)
    if not head_first:
        head_and_embedding()
    tensors["model.norm.weight"] = torch.ones(s["hidden"], dtype=torch.bfloat16)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": s["hidden"],
        "intermediate_size": s["intermediate"],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["head_dim"],
        "vocab_size": s["vocab"],
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "bfloat16",
    }
    tmp = path.with_name(path.name + ".partial")
    write_pack(tmp, tensors, config, shards=shards)  # the default quant config: exl3, 4 bits, head 6, mul1
    write_word_tokenizer(tmp, s["vocab"])
    tmp.rename(path)
    return path


def rss_gib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**30


class KernelTable(logging.Handler):
    """Keeps the plugin's per-model kernel table (quantpack_core.kernels.KernelLog) when it is logged."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.tables: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "kernels chosen per shard" in message:
            self.tables.append(message)


def bench_vllm(pack: Path) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from vllm import LLM, SamplingParams

    kernels = KernelTable()
    logging.getLogger("vllm.quantpack").addHandler(kernels)
    rss_before = rss_gib()
    t0 = time.time()
    llm = LLM(
        model=str(pack),
        dtype="float16",
        max_model_len=2048,
        gpu_memory_utilization=0.5,
        max_num_seqs=8,
        attention_backend="TRITON_ATTN",
        skip_tokenizer_init=True,
        seed=0,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]},
    )
    load_s = time.time() - t0
    rss_after = rss_gib()

    def model_bytes(model) -> int:
        tensors = [*model.parameters(), *model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors if t.is_cuda)

    weights_gib = llm.apply_model(model_bytes)[0] / 2**30
    prompt = [{"prompt_token_ids": list(range(100, 100 + PROMPT_TOKENS))}]

    def run(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(
            prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False), use_tqdm=False
        )
        torch.cuda.synchronize()
        return time.perf_counter() - t

    run(DECODE_TOKENS + 1)  # warm
    best = min(run(DECODE_TOKENS + 1) - run(1) for _ in range(3))
    return {
        "engine": "vLLM + quantpack-exl3 (CUDA graphs; kernels as chosen, see the table below)",
        "decode_tok_s": DECODE_TOKENS / best,
        "load_s": load_s,
        "host_rss_before_gib": rss_before,
        "host_rss_after_load_gib": rss_after,
        "model_on_device_gib": weights_gib,
        "kernels": kernels.tables[-1] if kernels.tables else None,
    }


def exllamav3_runner(pack: Path):
    """exllamav3's own Generator on the pack, loaded.

    Returns:
        ``(run, load_s)``: ``run(n)`` is the seconds to generate ``n`` tokens greedily after the
        :data:`PROMPT_TOKENS`-token prompt (GPU synchronized); ``load_s`` the model's load time.
    """
    import torch
    from exllamav3 import Cache, Config, Generator, Model, Tokenizer

    config = Config.from_directory(str(pack))
    model = Model.from_config(config)
    cache = Cache(model, max_num_tokens=2048)
    t0 = time.time()
    model.load()
    load_s = time.time() - t0
    tokenizer = Tokenizer.from_config(config)
    generator = Generator(model=model, cache=cache, tokenizer=tokenizer)
    prompt = " ".join(f"t{i}" for i in range(100, 100 + PROMPT_TOKENS))

    def run(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        generator.generate(prompt=prompt, max_new_tokens=n, stop_conditions=[], completion_only=True, add_bos=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    return run, load_s


def bench_exllamav3(pack: Path) -> dict:
    run, load_s = exllamav3_runner(pack)
    run(DECODE_TOKENS + 1)
    best = min(run(DECODE_TOKENS + 1) - run(1) for _ in range(3))
    return {"engine": "exllamav3 1.6.5 native (Generator)", "decode_tok_s": DECODE_TOKENS / best, "load_s": load_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", type=Path, default=Path("/tmp/bench-8b-exl3"))
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--engine", choices=["vllm", "exllamav3", "both"], default="both")
    ap.add_argument("--make-only", action="store_true", help="write the pack and stop")
    args = ap.parse_args()
    t0 = time.time()
    make_pack(args.pack)
    size = sum(f.stat().st_size for f in args.pack.glob("*.safetensors")) / 2**30
    print(f"pack {args.pack}: {size:.2f} GiB of safetensors (made/checked in {time.time() - t0:.0f} s)", flush=True)
    if args.make_only:
        return
    if args.engine != "both":
        res = bench_vllm(args.pack) if args.engine == "vllm" else bench_exllamav3(args.pack)
        print("RESULT " + json.dumps(res), flush=True)
        return
    results = []
    for engine in ("vllm", "exllamav3"):  # each in its own process: one engine's GPU memory never meets the other's
        proc = subprocess.run(
            [sys.executable, __file__, "--pack", str(args.pack), "--engine", engine], capture_output=True, text=True
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            results.append({"engine": engine, "error": proc.stderr[-3000:]})
        else:
            results.append(json.loads(lines[-1][7:]))
    print("\n| engine | batch-1 decode tok/s | load s | host RSS before -> after load (GiB) | model on GPU (GiB) |")
    print("|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['engine']} | failed | | | |")
            continue
        rss = (
            f"{r['host_rss_before_gib']:.2f} -> {r['host_rss_after_load_gib']:.2f}"
            if "host_rss_before_gib" in r
            else ""
        )
        dev = f"{r['model_on_device_gib']:.2f}" if "model_on_device_gib" in r else ""
        print(f"| {r['engine']} | {r['decode_tok_s']:.1f} | {r['load_s']:.0f} | {rss} | {dev} |")
    for r in results:
        if r.get("kernels"):
            print(f"\n{r['kernels']}")
        if "error" in r:
            print(f"\n{r['engine']} failed:\n{r['error']}")
    if args.json:
        args.json.write_text(json.dumps({"shape": SHAPE, "pack_gib": size, "results": results}, indent=1))


if __name__ == "__main__":
    main()
