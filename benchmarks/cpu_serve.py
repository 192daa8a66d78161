"""CPU serving speed of a quantized pack against its bf16 source model, with vLLM's own serving benchmark.

For each pair, both models are served by vLLM's OpenAI server on this machine (``VLLM_CPU_KVCACHE_SPACE=1``,
bfloat16, ``--max-model-len 1024``; the pack through the installed quantpack plugins, the source through stock
vLLM) and measured with ``vllm.benchmarks.serve`` (random dataset, 64-token prompts, 32 output tokens,
``--ignore-eos``, 128 requests at concurrency 16, the server warmed by one untimed round first): requests/s, output
tokens/s, mean TTFT and TPOT, each the median over ``--rounds`` timed rounds per model, the rounds alternating
between the two servers (on a 2-core machine one round of a tiny model lasts about a second, and its figures drift
by 10-20% over minutes: measured one model after the other, the bf16 model against a copy of itself came out
1.17x). Writes ``--json`` (default ``benchmarks/results/cpu_serve.json``) and prints a markdown table with the
pack / source ratios.

Usage: ``VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python benchmarks/cpu_serve.py [--pairs llama,qwen3moe]
[--source qwen3moe=DIR]`` (the Qwen3-MoE pack's bf16 source is not bundled: ``--source`` names its folder).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"
#: name -> (quantized pack, its bf16 source); None: the source is not bundled and ``--source NAME=DIR`` names it
PAIRS = {
    "llama": (FIXTURES / "llama-tiny-exl3-4.0bpw-mul1", FIXTURES / "llama-tiny-bf16"),
    "qwen3moe": (FIXTURES / "qwen3moe-tiny-exl3-4.0bpw-mul1", None),
    "qwen3next": (FIXTURES / "qwen3next-tiny-exl3-4.0bpw-mul1", FIXTURES / "qwen3next-tiny-bf16"),
}
BENCH = ["--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "32", "--ignore-eos",
         "--max-concurrency", "16"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: Path, port: int, log: Path) -> subprocess.Popen:
    """Start vLLM's OpenAI server for ``model``; returns once /health answers.

    Raises:
        RuntimeError: the server exited or did not answer within 15 minutes (its log tail in the message).
    """
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    cmd = [sys.executable, "-W", "ignore::DeprecationWarning", "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(model), "--served-model-name", "m", "--dtype", "bfloat16", "--max-model-len", "1024",
           "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server for {model} exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(2)
    proc.kill()
    raise RuntimeError(f"the server for {model} did not answer in 15 minutes:\n{log.read_text()[-3000:]}")


def bench(model: Path, port: int, prompts: int) -> dict:
    """One run of vLLM's serving benchmark against the server on ``port`` (the model's own tokenizer)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    base = ["--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--tokenizer", str(model)]
    args = parser.parse_args([*base, "--num-prompts", str(prompts), *BENCH])
    return main(args)


FIGURES = ("request_throughput", "output_throughput", "mean_ttft_ms", "mean_tpot_ms")


def measure(models: tuple[Path, Path], prompts: int, work: Path, rounds: int) -> dict[Path, list[dict]]:
    """Serve both models (started one after the other, then both up; an idle vLLM server waits on its socket), warm
    each with one untimed round of 16 prompts, then run ``rounds`` timed rounds per model, alternating between them
    so that a slow spell of the machine falls on both; returns each model's rounds (:data:`FIGURES`)."""
    procs, ports = [], {}
    try:
        for model in models:
            ports[model] = free_port()
            procs.append(serve(model, ports[model], work / f"{model.name}.log"))
        for model in models:
            bench(model, ports[model], 16)  # warm-up round
        got = {model: [] for model in models}
        for i in range(rounds):
            for model in models if i % 2 == 0 else models[::-1]:
                got[model].append(pick(bench(model, ports[model], prompts)))
        return got
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)


def pick(result: dict) -> dict:
    """The :data:`FIGURES` of one benchmark result."""
    return {k: result[k] for k in FIGURES}


def summary(model: Path, rounds: list[dict]) -> dict:
    """Median of each figure over ``rounds`` (every round of every server start), plus the rounds themselves."""
    return {"model": model.name, **{k: statistics.median(r[k] for r in rounds) for k in FIGURES}, "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", default="llama", help=f"comma-separated, of {', '.join(PAIRS)}")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=12, help="timed benchmark rounds per model, alternating models")
    ap.add_argument("--json", type=Path, default=Path(__file__).with_name("results") / "cpu_serve.json")
    ap.add_argument("--work", type=Path, default=Path("/tmp/cpu_serve"))
    ap.add_argument("--source", action="append", default=[], help="NAME=DIR: the bf16 source of a pair not bundled")
    args = ap.parse_args()
    given = dict(s.split("=", 1) for s in args.source)
    args.work.mkdir(parents=True, exist_ok=True)
    import vllm

    record = {"host": platform.node(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
              "vllm": vllm.__version__, "bench": BENCH, "prompts": args.prompts, "rounds": args.rounds,
              "pairs": {}}  # fmt: skip
    rows = []
    for name in args.pairs.split(","):
        pack, source = PAIRS[name]
        source = Path(given[name]) if name in given else source
        if source is None or not source.is_dir():
            raise SystemExit(f"pair {name}: no bf16 source folder ({source}); give it with --source {name}=DIR")
        got = measure((pack, source), args.prompts, args.work, args.rounds)
        res = {"pack": summary(pack, got[pack]), "source": summary(source, got[source])}
        res["output_ratio"] = res["pack"]["output_throughput"] / res["source"]["output_throughput"]
        res["tpot_ratio"] = res["pack"]["mean_tpot_ms"] / res["source"]["mean_tpot_ms"]
        record["pairs"][name] = res
        for kind in ("pack", "source"):
            m = res[kind]
            rows.append(f"| {m['model']} | {m['request_throughput']:.2f} | {m['output_throughput']:.0f} | "
                        f"{m['mean_ttft_ms']:.0f} | {m['mean_tpot_ms']:.1f} |")  # fmt: skip
        rows.append(f"| pack / source | | {res['output_ratio']:.2f} | | {res['tpot_ratio']:.2f} |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1))
    print("| served model | requests/s | output tok/s | mean TTFT ms | mean TPOT ms |\n|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
