"""End-to-end serving speed side by side on the Llama-3-8B shape (``--model 8b``) or the Qwen3-30B-A3B MoE shape
(``--model 30b-a3b``, ``30b-a3b-mixed``: three K groups per expert bank): vLLM + quantpack-exl3 (its kernels as chosen,
and with one kernel backend forced), vLLM bf16, vLLM W4A16 and exllamav3 native, each engine in its own process, in one
run.

The 8B model uses the synthetic pack of ``decode_8b.py``; the MoE models that of ``decode_moe_30b_a3b.py``; the engines
below are described for the 8B one, and differ for the MoE models where said.

* plugin: vLLM + quantpack-exl3 on the synthetic EXL3 pack of ``decode_8b.py`` (K=4 mul1, head K=6), kernels as
  chosen (trellis_mma, its row buckets delegated to exllamav3 where measured faster).
* plugin-exllamav3: the same with ``QUANTPACK_EXL3_BACKEND=exllamav3`` (exllamav3's kernels for every shard).
* bf16: vLLM on the same config.json without its quantization config, ``load_format="dummy"`` (no weights written).
* w4a16: the same config with an AWQ quantization config (4 bits, group 128, zero point), ``load_format="dummy"``:
  vLLM's own 4-bit path (AWQ-Marlin / Machete on Hopper). For the MoE models a GPTQ config (4 bits, group 128,
  symmetric, no act-order, the router left in bf16): vLLM's Marlin MoE kernels for the experts.
* plugin-trellis_mma: the plugin with ``QUANTPACK_EXL3_BACKEND=trellis_mma`` (trellis_mma for every shard and bank,
  no row bucket delegated to exllamav3). For the MoE models "plugin" runs the expert banks through trellis_mma's grouped
  kernels (the CUDA default) and "plugin-exllamav3" through exllamav3's ``exl3_mgemm``.
* exllamav3: its own Generator on the same pack (jobs of token ids, argmax sampling, all of a batch enqueued at
  once).

Per engine and batch size B (default 1, 8, 64, 256): decode with B prompts of 64 tokens and 256 new tokens
(greedy, no early stop): tokens/s = B x 256 / (t(257 tokens) - t(1 token)), ms per step, and the time to first token
t(1 token); prefill with B prompts of 512 tokens, and up to 8 prompts also of 2,048 tokens, and one new token: prompt
tokens/s and its time. Each time is measured ``--repeats`` times (default 3): the figures are from the fastest, the
record keeps the median too (``*_median``). Every call's
prompts are new token sequences (a per-call first token), and vLLM's prefix caching is off, so no call reuses an
earlier one's KV cache. Plus the load time, the weights' size on the GPU and the process's peak GPU memory (torch's
allocator). CUDA graphs and torch.compile as vLLM configures them by default; the attention backend is
``TRITON_ATTN`` (the GPU bundle has no FlashAttention); every engine gets the same fixed KV cache
(:data:`KV_CACHE_GIB` per model, ``kv_cache_memory_bytes``) instead of a memory fraction, so that the bf16 MoE model
fits an 80 GB card beside it. The record names the card, vLLM's and torch's releases and the commit.

Writes ``--json`` (default ``benchmarks/results/serve_<model>.json``) and prints a markdown table;
``benchmarks/plot_kernels.py`` draws both this and ``kernel_8b.py``'s record. Usage (GPU machine, after
ci/gpu/setup.sh): ``source ci/gpu/env.sh && python3 benchmarks/serve_8b.py [--model 8b|30b-a3b|30b-a3b-mixed]
[--engines plugin,plugin-exllamav3,bf16,w4a16,exllamav3] [--batches 1,8,64,256] [--repeats 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import decode_8b
import decode_moe_30b_a3b
from decode_8b import KernelTable

PROMPT_TOKENS, DECODE_TOKENS, PREFILL_TOKENS, LONG_PREFILL_TOKENS = 64, 256, 512, 2048
#: batches up to which the long prefill is measured too
LONG_PREFILL_BATCH = 8
#: the fixed KV cache of every engine, per model (GiB)
KV_CACHE_GIB = {"8b": 24, "30b-a3b": 8, "30b-a3b-mixed": 8}
ENGINES = ("plugin", "plugin-exllamav3", "plugin-trellis_mma", "bf16", "w4a16", "exllamav3")
#: the engines that load the EXL3 pack through the plugin, and the kernel backend each forces (None: as chosen)
PLUGIN_BACKENDS = {"plugin": None, "plugin-exllamav3": "exllamav3", "plugin-trellis_mma": "trellis_mma"}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
#: as GPTQ MoE checkpoints are made: the router (``mlp.gate``) left in bf16 (vLLM's GPTQ ``dynamic`` exclusion)
GPTQ = {
    "quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False,
    "dynamic": {r"-:.*\.mlp\.gate$": {}},
}  # fmt: skip
#: model -> (write its pack, its shape, the W4A16 config, the default pack folder, the default engines)
MODELS = {
    "8b": (
        decode_8b.make_pack, decode_8b.SHAPE, AWQ, "/tmp/bench-8b-exl3",
        ("plugin", "plugin-exllamav3", "bf16", "w4a16", "exllamav3"),
    ),
    "30b-a3b": (
        lambda p: decode_moe_30b_a3b.make_pack(p, False), decode_moe_30b_a3b.SHAPE, GPTQ, "/tmp/bench-moe-exl3",
        ("plugin", "plugin-exllamav3", "bf16", "w4a16"),
    ),
    "30b-a3b-mixed": (
        lambda p: decode_moe_30b_a3b.make_pack(p, True), decode_moe_30b_a3b.SHAPE, GPTQ, "/tmp/bench-moe-exl3-mixed",
        ("plugin",),
    ),
}  # fmt: skip
_calls = [0]


def prompt_ids(batch: int, length: int, vocab: int) -> list[list[int]]:
    """``batch`` distinct prompts of ``length`` token ids below ``vocab``, unlike those of any earlier call in this
    process (the first token counts the calls, in the lower half of the vocabulary; the rest lie in the upper half),
    so that no engine serves a prompt from a prefix cache."""
    _calls[0] += 1
    half = vocab // 2
    return [
        [1 + _calls[0] % (half - 1)] + [half + (7 * i + j) % (half - 1) for j in range(length - 1)]
        for i in range(batch)
    ]


def vocab_size(model: Path) -> int:
    """The ``vocab_size`` of a model folder's config.json."""
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def dummy_model(pack: Path, kind: str, w4a16: dict) -> Path:
    """A weightless copy of the pack's config for ``load_format="dummy"``: bf16, or with the W4A16 config ``w4a16``."""
    target = pack.parent / f"{pack.name}-{kind}-dummy"
    target.mkdir(exist_ok=True)
    config = json.loads((pack / "config.json").read_text())
    config.pop("quantization_config", None)
    if kind == "w4a16":
        config["quantization_config"] = w4a16
        config["dtype"] = config["torch_dtype"] = "float16"
    (target / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (pack / name).exists():
            shutil.copy(pack / name, target / name)
    return target


def timed(fn) -> float:
    """Seconds ``fn()`` takes, the GPU synchronized before and after (when there is one)."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def bench_vllm(model: Path, kind: str, batches: list[int], repeats: int, kv_gib: float) -> dict:
    """One vLLM engine: load, then decode and prefill at every batch size (see the module)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import logging

    import torch
    from vllm import LLM, SamplingParams

    kernels = KernelTable()
    logging.getLogger("vllm.quantpack").addHandler(kernels)
    vocab = vocab_size(model)
    cuda = torch.cuda.is_available()
    t0 = time.time()
    llm = LLM(
        model=str(model),
        dtype="bfloat16" if kind == "bf16" else "float16",
        max_model_len=LONG_PREFILL_TOKENS + DECODE_TOKENS + 64,
        max_num_seqs=max(batches),
        skip_tokenizer_init=True,
        seed=0,
        load_format="auto" if kind in PLUGIN_BACKENDS else "dummy",
        enable_prefix_caching=False,
        **({"attention_backend": "TRITON_ATTN", "kv_cache_memory_bytes": int(kv_gib * 2**30)} if cuda else {}),
    )
    load_s = time.time() - t0

    def model_bytes(m) -> int:
        """Bytes of the model's parameters and buffers."""
        return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])

    weights_gib = llm.apply_model(model_bytes)[0] / 2**30

    def run(batch: int, length: int, new: int) -> float:
        """Seconds to generate ``new`` tokens (greedy, no early stop) for ``batch`` new prompts of ``length``."""
        sp = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, detokenize=False)
        prompts = [{"prompt_token_ids": ids} for ids in prompt_ids(batch, length, vocab)]
        return timed(lambda: llm.generate(prompts, sp, use_tqdm=False))

    rows = measure(kind, run, batches, repeats)
    return {
        "engine": kind,
        "load_s": load_s,
        "weights_gib": weights_gib,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "kernels": kernels.tables[-1] if kernels.tables else None,
        "rows": rows,
    }


def measure(kind: str, run, batches: list[int], repeats: int) -> list[dict]:
    """Decode and prefill figures of one engine at every batch size (see the module), from ``run(batch, length,
    new)`` -> seconds: each from the fastest of ``repeats`` runs, and ``*_median`` from their median."""
    import statistics

    rows = []
    for batch in batches:
        run(batch, PROMPT_TOKENS, 8)  # warm this batch size
        first = [run(batch, PROMPT_TOKENS, 1) for _ in range(repeats)]
        full = [run(batch, PROMPT_TOKENS, DECODE_TOKENS + 1) for _ in range(repeats)]
        row = {"batch": batch, "ttft_ms": min(first) * 1000}
        for name, pick in (("", min), ("_median", statistics.median)):
            step = max(pick(full) - pick(first), 1e-9) / DECODE_TOKENS
            row[f"decode_tok_s{name}"] = batch / step
            row[f"ms_per_step{name}"] = step * 1000
        lengths = [PREFILL_TOKENS] + ([LONG_PREFILL_TOKENS] if batch <= LONG_PREFILL_BATCH else [])
        for length in lengths:
            times = [run(batch, length, 1) for _ in range(repeats)]
            key = "prefill" if length == PREFILL_TOKENS else f"prefill{length}"
            row[f"{key}_tok_s"] = batch * length / min(times)
            row[f"{key}_tok_s_median"] = batch * length / statistics.median(times)
            row[f"{key}_ms"] = min(times) * 1000
        rows.append(row)
        print(f"  {kind} batch {batch}: {row}", file=sys.stderr, flush=True)
    return rows


def environment() -> dict:
    """The card, vLLM's and torch's releases and the commit a record is measured with."""
    import torch

    try:
        from importlib.metadata import version

        vllm = version("vllm")
    except Exception:  # the release is only a label
        vllm = None
    done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "vllm": vllm,
        "torch": torch.__version__,
        "commit": os.environ.get("QUANTPACK_COMMIT") or done.stdout.strip() or None,
    }


def bench_exllamav3(pack: Path, batches: list[int], repeats: int) -> dict:
    """exllamav3's own Generator on the pack (exllamav3 1.6.5's ``Generator`` / ``Job`` API): every batch size, decode
    and prefill as for the vLLM engines; the cache holds the largest batch's sequences of 512 + 257 tokens."""
    import torch
    from exllamav3 import ArgmaxSampler, Cache, Config, Generator, Job, Model, Tokenizer

    config = Config.from_directory(str(pack))
    model = Model.from_config(config)
    per_sequence = -(-(LONG_PREFILL_TOKENS + DECODE_TOKENS + 1) // 256) * 256  # whole cache pages of 256 tokens
    cache = Cache(model, max_num_tokens=max(batches) * per_sequence)
    t0 = time.time()
    model.load()
    load_s = time.time() - t0
    generator = Generator(
        model=model, cache=cache, tokenizer=Tokenizer.from_config(config), max_batch_size=max(batches)
    )

    def run(batch: int, length: int, new: int) -> float:
        """Seconds to generate ``new`` tokens for ``batch`` new prompts of ``length`` ids, enqueued at once."""

        def generate() -> None:
            for ids in prompt_ids(batch, length, vocab_size(pack)):
                ids = torch.tensor([ids])
                generator.enqueue(Job(input_ids=ids, max_new_tokens=new, stop_conditions=[], sampler=ArgmaxSampler()))
            while generator.num_remaining_jobs():
                generator.iterate()

        return timed(generate)

    rows = measure("exllamav3", run, batches, repeats)
    weights = sum(f.stat().st_size for f in pack.glob("*.safetensors")) / 2**30
    return {
        "engine": "exllamav3",
        "load_s": load_s,
        "weights_gib": weights,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30,
        "rows": rows,
    }


def table(results: list[dict]) -> str:
    """The results as a markdown table (one line per engine and batch)."""
    lines = [
        "| engine | batch | decode tok/s | ms/step | TTFT ms (64-token prompts) | prefill tok/s (512-token prompts) "
        "| prefill tok/s (2,048) | weights GiB | peak GPU GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['engine']} | failed | | | | | | | |")
            continue
        for row in r["rows"]:
            prefill = f"{row['prefill_tok_s']:,.0f}" if "prefill_tok_s" in row else "-"
            long = f"{row['prefill2048_tok_s']:,.0f}" if "prefill2048_tok_s" in row else "-"
            weights = f"{r['weights_gib']:.2f}" if "weights_gib" in r else "-"
            lines.append(
                f"| {r['engine']} | {row['batch']} | {row['decode_tok_s']:,.1f} | {row['ms_per_step']:.2f} | "
                f"{row['ttft_ms']:.1f} | {prefill} | {long} | {weights} | {r['peak_gpu_gib']:.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    """Run each engine in its own process (or, with ``--engine``, one here), print the table, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="8b")
    ap.add_argument("--pack", type=Path, help="the EXL3 pack (written there unless present); default per model")
    ap.add_argument("--engines", help="comma-separated, of " + ", ".join(ENGINES) + "; default per model")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, help="default benchmarks/results/serve_<model>.json")
    ap.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)  # one engine, in this process
    args = ap.parse_args()
    make_pack, shape, w4a16, default_pack, default_engines = MODELS[args.model]
    args.pack = args.pack or Path(default_pack)
    args.json = args.json or Path(__file__).with_name("results") / f"serve_{args.model.replace('-', '_')}.json"
    batches = [int(b) for b in args.batches.split(",")]
    if args.engine:
        if args.engine == "exllamav3":
            res = bench_exllamav3(args.pack, batches, args.repeats)
        elif args.engine in PLUGIN_BACKENDS:
            if PLUGIN_BACKENDS[args.engine]:
                os.environ["QUANTPACK_EXL3_BACKEND"] = PLUGIN_BACKENDS[args.engine]
            res = bench_vllm(args.pack, args.engine, batches, args.repeats, KV_CACHE_GIB[args.model])
        else:
            model = dummy_model(args.pack, args.engine, w4a16)
            res = bench_vllm(model, args.engine, batches, args.repeats, KV_CACHE_GIB[args.model])
        print("RESULT " + json.dumps(res), flush=True)
        return
    make_pack(args.pack)
    results = []
    for engine in args.engines.split(",") if args.engines else default_engines:  # each in its own process
        t0 = time.time()
        cmd = [sys.executable, __file__, "--model", args.model, "--pack", str(args.pack), "--engine", engine]
        cmd += ["--batches", args.batches, "--repeats", str(args.repeats)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            results.append({"engine": engine, "error": proc.stderr[-3000:]})
        else:
            results.append(json.loads(lines[-1][7:]))
        print(f"{engine}: {time.time() - t0:.0f} s", flush=True)
    print(table(results))
    for r in results:
        if r.get("kernels"):
            print(f"\n{r['kernels']}")
        if "error" in r:
            print(f"\n{r['engine']} failed:\n{r['error']}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "model": args.model, "shape": shape, "date": time.strftime("%Y-%m-%d"), "batches": batches,
        "repeats": args.repeats, "kv_cache_gib": KV_CACHE_GIB[args.model], **environment(),
        "results": results,
    }  # fmt: skip
    args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
