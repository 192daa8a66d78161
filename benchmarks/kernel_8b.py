"""Kernel-level speed of EXL3 linear layers on the Llama-3-8B stack: every CUDA linear kernel side by side with dense
bf16 cuBLAS, against the bandwidth floor.

The stack is 32 layers x (q 4096->4096, k and v 4096->1024, o 4096->4096, gate and up 4096->14336, down
14336->4096) at K=4 and the head 4096->128256 at K=6, all mul1 by default (the shapes and K of
``decode_8b.py``), with random trellis words (every bit pattern is a legal trellis; decode speed does not depend on
the values). For each kernel and row count the whole stack (225 shard launches) is captured in one CUDA graph and
replayed; the time is the median over replays. Each shape class (the 32 layers' q shards, ...) is also timed alone,
which is what the per-shard kernel choice rests on. A kernel that fuses a layer's shards (``fuse``: q / k / v and gate /
up in one launch) is also timed as the linear method runs it, fused (record key ``fused``, classes qkv, o, gate_up,
down, head). trellis_mma runs with its split-K kernel above 16 rows (record key ``trellis_mma``) and, on Hopper, with
its tensor-core kernel there (``trellis_mma_tc``), with its dense route there (``trellis_mma_dense``: each shard's
weights rebuilt per call, then cuBLAS); and as served: each fused run's row buckets on the kernel the
load-time measurement found fastest, exllamav3's included (key ``served``, with the measured ``selection``). Dense bf16
(``torch.matmul`` on the same shapes) is timed the same way, and so are the dense route's GEMMs alone (float16
weights laid out as the route rebuilds them: what the route costs besides its rebuild); the GPU's copy bandwidth is
measured in the same run: the bandwidth floor of a stack is its bytes (trellis + suh + svh; bf16 weights for dense)
over that bandwidth.

Writes a JSON record (``--json``, default ``benchmarks/results/kernel_8b.json``); ``benchmarks/plot_kernels.py``
draws it. Usage (GPU machine, after ci/gpu/setup.sh): ``source ci/gpu/env.sh && python3 benchmarks/kernel_8b.py
[--rows 1,4,16,64,256] [--kernels exllamav3,trellis_mma] [--codebook mul1] [--layer-k 4] [--no-dense]
[--inline-transform-rows N]``.

The escha line (quantpack-escha-rocm's kernels against the EXL3 kernels on the same trellis, read as an escha code:
docs/escha-format.md): ``--codebook mcg --kernels exllamav3,trellis_mma,escha_trellis_mma,escha_triton --layer-k 2``
(``escha_trellis_mma``: escha's backend handing its shards to trellis_mma).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

HIDDEN, INTER, LAYERS, VOCAB = 4096, 14336, 32, 128256
#: the record's lines of trellis_mma under another wide kernel (its ``wide_kernel`` setting), timed in its run
TRELLIS_VARIANTS = {"trellis_mma_tc": "tc", "trellis_mma_dense": "dense"}
#: (class, in, out) of one layer's shards
LAYER_SHARDS = [
    ("q", HIDDEN, HIDDEN),
    ("k", HIDDEN, 1024),
    ("v", HIDDEN, 1024),
    ("o", HIDDEN, HIDDEN),
    ("gate", HIDDEN, INTER),
    ("up", HIDDEN, INTER),
    ("down", INTER, HIDDEN),
]
#: shards the linear method runs as one, by the class of the first: (the fused run's class, how many shards)
FUSED_GROUPS = {"q": ("qkv", 3), "gate": ("gate_up", 2)}
LAYER_K, HEAD_K = 4.0, 6.0
REPLAYS = 20


#: record keys of quantpack-escha-rocm's Triton and trellis_mma kernels, timed on the same trellis as an escha stack
#: (``--kernels``)
ESCHA_TRITON, ESCHA_TRELLIS_MMA = "escha_triton", "escha_trellis_mma"
ESCHA_KERNELS = (ESCHA_TRITON, ESCHA_TRELLIS_MMA)


def kernel_classes() -> dict:
    """Name -> linear kernel class of every CUDA kernel (EXL3's, and escha's Triton and trellis_mma kernels when
    quantpack-escha-rocm is installed, under :data:`ESCHA_TRITON` and :data:`ESCHA_TRELLIS_MMA`)."""
    from quantpack_exl3.backends.exllamav3 import Exllamav3LinearKernel
    from quantpack_exl3.backends.trellis_mma import TrellisMmaLinearKernel

    classes = {k.name: k for k in (Exllamav3LinearKernel, TrellisMmaLinearKernel)}
    try:
        from quantpack_escha.backends.trellis_mma import EschaTrellisMmaLinearKernel
        from quantpack_escha.backends.triton import EschaTritonLinearKernel
    except ImportError:
        return classes
    classes[ESCHA_TRITON] = EschaTritonLinearKernel
    classes[ESCHA_TRELLIS_MMA] = EschaTrellisMmaLinearKernel
    return classes


def as_escha(t):
    """The same layer as an escha shard (docs/escha-format.md; as ``quantpack escha-from-exl3`` converts): code =
    trellis, ``rin = suh / sqrt(128)`` and ``rout = svh / sqrt(128)`` (escha's Hadamard transforms are unnormalized),
    s_in and s_out ones; the codebook must be mcg (escha's)."""
    from quantpack_escha.codec import HAD_GAIN, EschaTensors

    ones_in = torch.ones_like(t.suh, dtype=torch.float16)
    ones_out = torch.ones_like(t.svh, dtype=torch.float16)
    rin, rout = (t.suh.float() / HAD_GAIN).half(), (t.svh.float() / HAD_GAIN).half()
    return EschaTensors(code=t.trellis, rin=rin, s_in=ones_in, rout=rout, s_out=ones_out)


def as_format(name: str, t):
    """``(format, shard)`` that the kernel of record key ``name`` runs on the EXL3 layer ``t``: escha's kernels
    (:data:`ESCHA_KERNELS`) take it read as an escha shard (:func:`as_escha`), the others as it is."""
    if name in ESCHA_KERNELS:
        from quantpack_escha.format import ESCHA

        return ESCHA, as_escha(t)
    from quantpack_exl3.format import EXL3

    return EXL3, t


def make_stack(codebook: str, device: torch.device, layer_k: float = LAYER_K) -> list[tuple[str, object]]:
    """The 225 shards as ``(class, Exl3Tensors)`` on the GPU, layer by layer, head last (layers at ``layer_k``)."""
    from quantpack_core.codec import Exl3Tensors
    from quantpack_core.synthetic import random_exl3_layer

    g = torch.Generator(device=device).manual_seed(0)
    stack = []
    for _ in range(LAYERS):
        for cls, i, o in LAYER_SHARDS:
            t = random_exl3_layer(i, o, layer_k, codebook, generator=g, device=device)
            stack.append((cls, Exl3Tensors.from_tensors(t)))
    t = random_exl3_layer(HIDDEN, VOCAB, HEAD_K, codebook, generator=g, device=device)
    stack.append(("head", Exl3Tensors.from_tensors(t)))
    return stack


def time_graph(step, replays: int = REPLAYS) -> float:
    """Median milliseconds of one replay of a CUDA graph of ``step()`` (captured after one eager warm-up call)."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del graph
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (read + write of a 2 GiB buffer, counted both ways). The
    record's ``exl3_bandwidth_floor_ms`` is the stack's bytes at this rate: a reference, not a strict floor (cuBLAS
    has read faster than this rate)."""
    src = torch.empty(1 << 30, dtype=torch.int16, device=device).random_()
    dst = torch.empty_like(src)
    ms = time_graph(lambda: dst.copy_(src), replays=10)
    return 2 * (2 << 30) / (ms / 1000)


def shard_bytes(t) -> int:
    """Bytes a shard's kernel reads: trellis (int16) + suh + svh (fp16)."""
    return t.trellis.numel() * 2 + t.suh.numel() * 2 + t.svh.numel() * 2


def device_platform():
    """The :class:`~quantpack_core.kernels.Platform` of this GPU."""
    from quantpack_core.kernels import CUDA, Platform

    major, minor = torch.cuda.get_device_capability()
    return Platform(CUDA, capability=major * 10 + minor)


def bench_kernel(kernel, stack, rows_list, device, unfused: bool = True, label: str | None = None) -> dict:
    """Stack and per-class milliseconds of one kernel at each row count (``unfused=False``: only the fused stack,
    under key ``fused``); ``label`` is its record key (default its name): it names it in the printed lines and picks
    the format its shards are read in (:func:`as_format`)."""
    label = label or kernel.name
    from quantpack_core.kernels import TP_WHOLE

    plat = device_platform()
    prepared = []
    for cls, t in stack:
        fmt, t = as_format(label, t)
        k, n = fmt.stored_shape(t)
        spec = fmt.spec(t, plat, k, n, torch.float16, TP_WHOLE)
        ok, why = kernel.can_implement(spec)
        if not ok:
            return {"skipped": why}
        prepared.append((cls, kernel.prepare(t, spec, device), k, n))
    result = time_stack(label, prepared, rows_list, device) if unfused else {}
    fused = fused_stack(kernel, prepared)
    if fused is not None:
        result["fused"] = time_stack(f"{label}+", fused, rows_list, device)
    return result


def fused_spans(classes: list[str]) -> list[tuple[int, int, str | None]]:
    """Where a stack of shards of ``classes`` runs as the linear method runs it: per run ``(first shard, shards, the
    fused run's class or None for a shard alone)`` (:data:`FUSED_GROUPS`)."""
    spans, i = [], 0
    while i < len(classes):
        name, count = FUSED_GROUPS.get(classes[i], (None, 1))
        spans.append((i, count, name))
        i += count
    return spans


def fused_stack(kernel, prepared):
    """The prepared stack as the linear method runs it: each layer's q / k / v and gate / up as one run of
    ``kernel.fuse``; None when the kernel fuses neither."""
    runs = []
    for i, count, name in fused_spans([cls for cls, _, _, _ in prepared]):
        if name is None:
            runs.append(prepared[i])
            continue
        one = kernel.fuse([p for _, p, _, _ in prepared[i : i + count]])
        if one is None:
            return None
        runs.append((name, one, prepared[i][2], one.out_features))
    return runs


def time_stack(label: str, prepared, rows_list, device) -> dict:
    """Stack and per-class milliseconds of prepared ``(class, run, in, out)`` items at each row count."""
    result = {"stack_ms": {}, "class_ms": {}}
    for rows in rows_list:
        xs = {w: torch.randn((rows, w), device=device).half() for w in (HIDDEN, INTER)}
        outs = {n: torch.empty((rows, n), dtype=torch.float16, device=device) for n in {p[3] for p in prepared}}

        def run(items, xs=xs, outs=outs):
            for _, p, k, n in items:
                p.run(xs[k], *p.tensors.values(), *p.static, outs[n], 0)

        result["stack_ms"][rows] = time_graph(lambda: run(prepared))
        by_class = {}
        for cls in dict.fromkeys(p[0] for p in prepared):
            items = [p for p in prepared if p[0] == cls]
            by_class[cls] = time_graph(lambda items=items: run(items))
        result["class_ms"][rows] = by_class
        print(f"  {label:12s} rows {rows:4d}: stack {result['stack_ms'][rows]:8.3f} ms  "
              + "  ".join(f"{c} {v:.3f}" for c, v in by_class.items()), flush=True)  # fmt: skip
    return result


def bench_served(kernel, stack, rows_list, device) -> dict:
    """The stack as a model is served with trellis_mma selected: fused runs whose row buckets run on the kernel the
    load-time measurement found fastest (``quantpack_core.trellis_mma.selection.measure_bucket_kernels``). Returns the
    fused stack's times (``stack_ms``, ``class_ms``) and ``selection``: per run shape and row bucket, each candidate's
    microseconds (one call at each of ``timed_rows``, summed) and the kernel that serves it."""
    from quantpack_core.trellis_mma import ops, settings
    from quantpack_core.trellis_mma import selection as sel

    with settings.using(delegate_rows=None, wide_kernel=None):
        result = bench_kernel(kernel, stack, rows_list, device, unfused=False)["fused"]
    chosen = []
    for record in sel.selection_records():
        if record.times_us:
            print(f"  selected {record.describe()}", flush=True)
            chosen.append({
                "k": record.k, "out_features": record.out_features, "k_bits": record.k_bits,
                "codebook": record.codebook, "dtype": str(record.dtype).removeprefix("torch."), "rows": record.rows,
                "times_us": [{record.name(c): us for c, us in timed} for timed in record.times_us],
                "timed_rows": [list(record.timed_rows(i)) for i in range(len(record.rows))],
                "serves": [record.name(ops.kernel_of(record.bucket_kernels, r)) for r in record.rows],
            })  # fmt: skip
    result["selection"] = chosen
    return result


def bench_dense(rows_list, device) -> dict:
    """Dense bf16 cuBLAS on the same shapes (weights (in, out), one matmul per shard into preallocated outputs)."""
    weights = []
    for _ in range(LAYERS):
        for cls, i, o in LAYER_SHARDS:
            weights.append((cls, torch.randn((i, o), device=device, dtype=torch.bfloat16) * 0.02))
    weights.append(("head", torch.randn((HIDDEN, VOCAB), device=device, dtype=torch.bfloat16) * 0.02))
    nbytes = sum(w.numel() * 2 for _, w in weights)
    result = {"bytes": nbytes, "stack_ms": {}}
    for rows in rows_list:
        xs = {w: torch.randn((rows, w), device=device, dtype=torch.bfloat16) for w in (HIDDEN, INTER)}
        outs = {o: torch.empty((rows, o), dtype=torch.bfloat16, device=device) for o in (HIDDEN, 1024, INTER, VOCAB)}

        def run(xs=xs, outs=outs):
            for _, w in weights:
                torch.matmul(xs[w.shape[0]], w, out=outs[w.shape[1]])

        result["stack_ms"][rows] = time_graph(run)
        print(f"  {'dense bf16':12s} rows {rows:4d}: stack {result['stack_ms'][rows]:8.3f} ms", flush=True)
    return result


def bench_route_gemms(rows_list, device) -> dict:
    """The dense route's GEMMs without its rebuild: float16 weights laid out as the route rebuilds them ((columns, k),
    a fused layer's shards side by side in the GEMMs ``dense_plan`` gives for its 128 MiB), ``x @ w.T`` into the
    layer's output, under the route's float32 sums (``stack_ms``) and under torch's default switches
    (``default_sums_ms``). The route's line minus ``stack_ms`` is its rebuild; ``stack_ms`` minus dense bf16 is what
    the GEMMs' layout, dtype and sums cost."""
    from quantpack_core.trellis_mma.ops import DENSE_BYTES, dense_plan, float32_sums

    layer = [  # (k, its shards' output widths) per run of a layer, fused as the linear method fuses them
        (LAYER_SHARDS[i][1], tuple(o for _, _, o in LAYER_SHARDS[i : i + count]))
        for i, count, _ in fused_spans([cls for cls, _, _ in LAYER_SHARDS])
    ]
    gemms = []  # (k, the layer's output width, the GEMM's first column, its weights (width, k))
    for k, outs in [*layer * LAYERS, (HIDDEN, (VOCAB,))]:
        for first, width, _ in dense_plan(outs, DENSE_BYTES // 2 // k // 128 * 128):
            gemms.append((k, sum(outs), first, torch.randn((width, k), device=device, dtype=torch.float16) * 0.02))
    result = {"stack_ms": {}, "default_sums_ms": {}}
    for rows in rows_list:
        xs = {k: torch.randn((rows, k), device=device, dtype=torch.float16) for k in (HIDDEN, INTER)}
        outs = {n: torch.empty((rows, n), dtype=torch.float16, device=device) for n in {g[1] for g in gemms}}

        def run(xs=xs, outs=outs):
            for k, n, first, w in gemms:
                torch.mm(xs[k], w.t(), out=outs[n][:, first : first + w.shape[0]])

        with float32_sums():
            result["stack_ms"][rows] = time_graph(run)
        result["default_sums_ms"][rows] = time_graph(run)
        print(
            f"  {'route GEMMs':12s} rows {rows:4d}: stack {result['stack_ms'][rows]:8.3f} ms (float32 sums), "
            f"{result['default_sums_ms'][rows]:8.3f} ms (torch's default)",
            flush=True,
        )
    return result


def main() -> None:
    """Measure every kernel and dense bf16 at each row count, print the figures and write the JSON record."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,16,64,256")
    ap.add_argument("--kernels", default="exllamav3,trellis_mma")
    ap.add_argument("--codebook", default="mul1")
    ap.add_argument("--layer-k", type=float, default=LAYER_K, help="K of the layers' shards (the head stays K=6)")
    ap.add_argument("--no-dense", action="store_true")
    ap.add_argument(
        "--inline-transform-rows",
        type=int,
        default=None,
        help="trellis_mma: 1 = a one-row call transforms its input in the GEMM CTAs, 0 = in one launch first "
        "(default: the library's, 1)",
    )
    ap.add_argument(
        "--ctas-per-sm",
        type=int,
        default=None,
        help="trellis_mma: split-K target in CTAs per SM up to 16 rows (default: the settings', 4; capped "
        "by what fits)",
    )
    ap.add_argument(
        "--ctas-per-sm-wide",
        type=int,
        default=None,
        help="trellis_mma: split-K target in CTAs per SM above 16 rows (default: the settings', 2)",
    )
    ap.add_argument("--json", type=Path, default=Path(__file__).with_name("results") / "kernel_8b.json")
    args = ap.parse_args()
    if variants := sorted(set(args.kernels.split(",")) & set(TRELLIS_VARIANTS)):
        ap.error(f"--kernels {', '.join(variants)}: timed within trellis_mma's run (name trellis_mma)")
    from quantpack_core.trellis_mma import settings

    with settings.using(**trellis_settings(args)):
        run(args)


def trellis_settings(args) -> dict:
    """The trellis_mma settings the run changes: trellis_mma's own kernels at every row count (the served op hands
    large calls over: ``bench_served`` measures that), and the options given (``--ctas-per-sm`` sets the wide target
    too unless ``--ctas-per-sm-wide`` is given, as the environment variables do)."""
    changes = {"delegate_rows": 0, "wide_kernel": "split"}
    if args.inline_transform_rows is not None:
        changes["inline_transform_rows"] = max(0, min(args.inline_transform_rows, 1))
    if args.ctas_per_sm is not None:  # read when the kernel's workspace is made
        changes["ctas_per_sm"] = changes["ctas_per_sm_wide"] = args.ctas_per_sm
    if args.ctas_per_sm_wide is not None:
        changes["ctas_per_sm_wide"] = args.ctas_per_sm_wide
    return changes


def commit() -> str | None:
    """The checkout's commit (``QUANTPACK_COMMIT`` where the tree travelled without its git folder), or None."""
    import os
    import subprocess

    if os.environ.get("QUANTPACK_COMMIT"):
        return os.environ["QUANTPACK_COMMIT"]
    done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    return done.stdout.strip() or None


def run(args) -> None:
    """Measure under the settings of :func:`trellis_settings` (see :func:`main`)."""
    from quantpack_core.trellis_mma import settings

    device = torch.device("cuda")
    rows_list = [int(r) for r in args.rows.split(",")]
    bw = copy_bandwidth(device)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    t0 = time.time()
    stack = make_stack(args.codebook, device, args.layer_k)
    nbytes = sum(shard_bytes(t) for _, t in stack)
    print(f"stack: {len(stack)} shards, {nbytes / 1e9:.3f} GB, made in {time.time() - t0:.1f} s", flush=True)
    record = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "host": platform.node(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit(),
        "codebook": args.codebook,
        "layer_k": args.layer_k,
        "head_k": HEAD_K,
        "copy_bandwidth_Bps": bw,
        "exl3_bytes": nbytes,
        "exl3_bandwidth_floor_ms": nbytes / bw * 1000,
        "kernels": {},
    }
    classes = kernel_classes()
    record["inline_transform_rows"] = settings.current().inline_transform_rows
    record["ctas_per_sm"] = settings.current().ctas_per_sm
    record["ctas_per_sm_wide"] = settings.current().ctas_per_sm_wide
    for name in args.kernels.split(","):
        kernel = classes.get(name)
        if kernel is None:
            record["kernels"][name] = {"skipped": f"not installed here (known: {', '.join(classes)})"}
            continue
        if name in ESCHA_KERNELS and args.codebook != "mcg":
            record["kernels"][name] = {"skipped": "escha is the mcg codebook: run with --codebook mcg"}
            continue
        ok, why = kernel.available(device_platform())
        record["kernels"][name] = bench_kernel(kernel, stack, rows_list, device, label=name) if ok else {"skipped": why}
        torch.cuda.empty_cache()
        if name == "trellis_mma" and ok:  # its other kernels above 16 rows: tensor cores (Hopper), the dense route
            hopper = torch.cuda.get_device_capability() == (9, 0)
            for variant, wide in TRELLIS_VARIANTS.items():
                if wide == "tc" and not hopper:
                    continue
                with settings.using(wide_kernel=wide):
                    record["kernels"][variant] = bench_kernel(kernel, stack, rows_list, device, label=variant)
                torch.cuda.empty_cache()
        if name == "trellis_mma" and ok and "exllamav3" in args.kernels.split(","):
            record["kernels"]["trellis_mma"]["served"] = bench_served(kernel, stack, rows_list, device)
    del stack
    torch.cuda.empty_cache()
    if not args.no_dense:
        dense = bench_dense(rows_list, device)
        dense["bandwidth_floor_ms"] = dense["bytes"] / bw * 1000
        record["dense_bf16"] = dense
        torch.cuda.empty_cache()
        record["dense_route_gemms"] = bench_route_gemms(rows_list, device)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1))
    print(f"bandwidth floor: EXL3 stack {record['exl3_bandwidth_floor_ms']:.3f} ms", flush=True)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
