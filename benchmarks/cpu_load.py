"""Loading a larger EXL3 pack on CPU: time, memory and what stays mapped, through vLLM and the reference backend.

The pack is synthetic (random trellis words decode like real weights: every bit pattern is a legal trellis), written
once under ``--pack`` (default ``/tmp/quantpack-cpu-load-pack``) and reused: a Llama of 58 layers, hidden 2048, MLP
8192, 16 / 8 heads of 128, vocabulary 32000 (untied head), K=4 mul1 for the layers, K=6 for ``lm_head``, a bf16
embedding, 4 safetensors shards (1.87 GiB; the largest, with the head and the embedding, 605 MiB); 3.78 G weights,
7.04 GiB as dense bf16. The shape of the pack behind the CPU load figures of issue 19.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, uni-process executor, bf16, eager,
``VLLM_CPU_KVCACHE_SPACE=1``), so the figures are the worker's own:

* load: seconds of ``LLM(...)`` and of vLLM's ``load_model`` (read + dequantize + vLLM's CPU GEMM packing), MB/s of
  pack read over ``load_model``, and the reference backend's decode (seconds inside its ``prepare``, MB/s of trellis
  decoded);
* RSS: before ``load_model``, after it (with its anonymous / file-backed parts), and its peak during it (sampled
  every 50 ms), each also as the excess over the dense bf16 weights (the figure the target bounds: at most 1.2x the
  largest shard); and once the engine is ready (vLLM has added its KV cache, 1 GiB here);
* the shard files still in ``/proc/self/maps`` after load (the target: none);
* a few greedy tokens, to show the model runs;
* the load average at start and after the load (the figures are only comparable on an otherwise idle machine: with
  other processes on the two cores, vLLM's pinned OpenMP threads wait on each other and a load takes several times
  longer).

Writes ``--json`` (default ``benchmarks/results/cpu_load.json``). Usage: ``.venv/bin/python benchmarks/cpu_load.py
[--pack DIR] [--label before|after]``; one engine at a time on a small machine (it needs about 10 GiB free).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

SHAPE = dict(hidden=2048, intermediate=8192, layers=58, heads=16, kv_heads=8, head_dim=128, vocab=32000)
SHARDS = 4
MiB = 2**20


def make_pack(path: Path) -> Path:
    """Write the synthetic pack unless it is already there (about a minute on 2 cores): :data:`SHAPE` through
    ``decode_8b.make_pack``, the head and the embedding in the first shard, as in the packs exllamav3 writes."""
    import decode_8b

    return decode_8b.make_pack(path, SHAPE, shards=SHARDS, head_first=True, max_positions=4096)


def dense_bytes() -> int:
    """Bytes of the model as dense bf16 (every linear, the embedding and the norms)."""
    s = SHAPE
    attn, kv, h = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["hidden"]
    layer = h * (attn + 2 * kv) + attn * h + 3 * h * s["intermediate"] + 2 * h
    return 2 * (s["layers"] * layer + 2 * s["vocab"] * h + h)


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``, ``RssFile`` ...) in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def mapped_files(folder: Path) -> list[str]:
    """Files under ``folder`` that this process maps (``/proc/self/maps``)."""
    root = str(folder.resolve())
    seen = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith(root) and parts[5] not in seen:
            seen.append(parts[5])
    return seen


class Sampler(threading.Thread):
    """RSS every ``period`` seconds: the peak, and a thinned time series ``(s, MiB)``."""

    def __init__(self, period: float = 0.05):
        super().__init__(daemon=True)
        self.period, self.peak, self.series, self.t0 = period, 0, [], time.perf_counter()
        self.stop = threading.Event()

    def run(self) -> None:
        import psutil

        proc, last = psutil.Process(), -1.0
        while not self.stop.is_set():
            rss = proc.memory_info().rss
            self.peak = max(self.peak, rss)
            t = time.perf_counter() - self.t0
            if t - last >= 1.0:
                self.series.append((round(t, 1), round(rss / MiB)))
                last = t
            self.stop.wait(self.period)


def instrument() -> dict:
    """Wrap vLLM's ``load_model`` and the reference kernels' ``prepare`` to time them and read RSS around the load.

    Returns:
        the dict the wrappers fill: ``load_model_s``, ``rss_before_load`` / ``rss_after_load`` (bytes),
        ``decode_s``, ``trellis_bytes``, ``decoded_shards``.
    """
    import psutil
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from quantpack_exl3.backends.reference.kernels import ReferenceLinearKernel

    got = {"decode_s": 0.0, "trellis_bytes": 0, "decoded_shards": 0}
    proc = psutil.Process()
    load_model = BaseModelLoader.load_model

    def timed_load(self, *a, **kw):
        got["rss_before_load"] = proc.memory_info().rss
        t0 = time.perf_counter()
        model = load_model(self, *a, **kw)
        got["load_model_s"] = time.perf_counter() - t0
        got["rss_after_load"] = proc.memory_info().rss
        got["peak_in_load"] = max(got["sampler"].peak, got["rss_after_load"])
        got["loadavg_after_load"] = os.getloadavg()
        got["rss_file_after_load"] = status_kib("RssFile") * 1024
        got["rss_anon_after_load"] = status_kib("RssAnon") * 1024
        got["mapped_after_load"] = mapped_files(got["pack"])
        return model

    BaseModelLoader.load_model = timed_load
    prepare = ReferenceLinearKernel.prepare.__func__

    def timed_prepare(cls, shard, spec, device):
        t0 = time.perf_counter()
        out = prepare(cls, shard, spec, device)
        got["decode_s"] += time.perf_counter() - t0
        got["trellis_bytes"] += shard.trellis.numel() * 2
        got["decoded_shards"] += 1
        return out

    ReferenceLinearKernel.prepare = classmethod(timed_prepare)
    return got


def main() -> None:
    """Build or reuse the pack, load it, print the figures and write the JSON record."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pack", type=Path, default=Path("/tmp/quantpack-cpu-load-pack"))
    ap.add_argument("--label", default="run", help="the record's name in the JSON (e.g. before / after)")
    ap.add_argument("--json", type=Path, default=Path(__file__).with_name("results") / "cpu_load.json")
    ap.add_argument("--tokens", type=int, default=8)
    args = ap.parse_args()

    start_load = os.getloadavg()
    t0 = time.perf_counter()
    pack = make_pack(args.pack)
    build_s = time.perf_counter() - t0
    shards = sorted(pack.glob("*.safetensors"))
    pack_bytes = sum(f.stat().st_size for f in shards)
    largest = max(f.stat().st_size for f in shards)

    import torch
    from vllm import LLM, SamplingParams

    got = instrument()
    got["pack"] = pack
    sampler = got["sampler"] = Sampler()
    sampler.start()
    t0 = time.perf_counter()
    llm = LLM(
        model=str(pack),
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=4,
        distributed_executor_backend="uni",
        seed=0,
    )
    llm_s = time.perf_counter() - t0
    sampler.stop.set()
    sampler.join()
    rss_engine = status_kib("VmRSS") * 1024
    hwm = status_kib("VmHWM") * 1024
    out = llm.generate(
        [{"prompt_token_ids": list(range(100, 116))}],
        SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    tokens = list(out[0].outputs[0].token_ids)
    dense = dense_bytes()
    before, after = got["rss_before_load"], got["rss_after_load"]
    peak = got["peak_in_load"]
    record = {
        "label": args.label,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_at_start": [round(x, 2) for x in start_load],
        "loadavg_after_load": [round(x, 2) for x in got["loadavg_after_load"]],
        "pack": str(pack),
        "pack_build_s": round(build_s, 1),
        "pack_MiB": round(pack_bytes / MiB),
        "largest_shard_MiB": round(largest / MiB),
        "dense_bf16_MiB": round(dense / MiB),
        "llm_init_s": round(llm_s, 1),
        "load_model_s": round(got["load_model_s"], 1),
        "pack_read_MB_per_s": round(pack_bytes / 1e6 / got["load_model_s"], 1),
        "decode_s": round(got["decode_s"], 1),
        "decoded_shards": got["decoded_shards"],
        "decode_trellis_MB_per_s": round(got["trellis_bytes"] / 1e6 / max(got["decode_s"], 1e-9), 1),
        "rss_before_load_MiB": round(before / MiB),
        "rss_after_load_MiB": round(after / MiB),
        "rss_anon_after_load_MiB": round(got["rss_anon_after_load"] / MiB),
        "rss_file_after_load_MiB": round(got["rss_file_after_load"] / MiB),
        "rss_peak_load_MiB": round(peak / MiB),
        "vm_hwm_engine_ready_MiB": round(hwm / MiB),
        "rss_engine_ready_MiB": round(rss_engine / MiB),
        "excess_after_load_MiB": round((after - before - dense) / MiB),
        "excess_peak_MiB": round((peak - before - dense) / MiB),
        "excess_after_load_per_largest_shard": round((after - before - dense) / largest, 2),
        "excess_peak_per_largest_shard": round((peak - before - dense) / largest, 2),
        "mapped_shards_after_load": [Path(p).name for p in got["mapped_after_load"]],
        "mapped_shards_engine_ready": [Path(p).name for p in mapped_files(pack)],
        "generated_tokens": tokens,
        "rss_series_s_MiB": sampler.series,
    }
    width = max(len(k) for k in record)
    for k, v in record.items():
        if k != "rss_series_s_MiB":
            print(f"{k:<{width}}  {v}")
    records = json.loads(args.json.read_text()) if args.json.exists() else {}
    records[args.label] = record
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(records, indent=1))
    print(f"wrote {args.json} [{args.label}]")


if __name__ == "__main__":
    main()
