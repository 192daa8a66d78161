"""Run one EXL3 shard shape through one linear kernel a few times, for a profiler (Nsight Compute / Systems).

Usage (GPU machine): ``source ci/gpu/env.sh && ncu --profile-from-start off --launch-count 1 --section SpeedOfLight
-k regex:trellis_mma_kernel python3 benchmarks/profile_shard.py --kernel trellis_mma --shape 4096,14336 --rows 1``
(the profiler starts after prepare's warm-up launches: ``ci/gpu/jobs.toml``'s ``ncu-*`` jobs). ``--kernel
escha_triton`` and ``--kernel escha_trellis_mma`` run the same trellis read as an escha shard (mcg only, as
``kernel_8b.py``'s escha line); ``--kernel-times`` prints each launch's GPU time per call from ``torch.profiler``
instead (no external profiler needed).
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    """Prepare one random shard and run it ``--repeat`` times."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", default="trellis_mma")
    ap.add_argument("--shape", default="4096,14336", help="in,out features")
    ap.add_argument("--k-bits", type=float, default=4.0)
    ap.add_argument("--codebook", default="mul1")
    ap.add_argument("--rows", default="1", help="rows per call; with --kernel-times a comma-separated list")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--kernel-times", action="store_true", help="print each launch's GPU time (torch.profiler)")
    args = ap.parse_args()

    from kernel_8b import as_format, device_platform, kernel_classes

    from quantpack_core.codec import Exl3Tensors
    from quantpack_core.kernels import TP_WHOLE
    from quantpack_core.synthetic import random_exl3_layer

    dev = torch.device("cuda")
    i, o = (int(v) for v in args.shape.split(","))
    g = torch.Generator(device=dev).manual_seed(0)
    t = Exl3Tensors.from_tensors(random_exl3_layer(i, o, args.k_bits, args.codebook, generator=g, device=dev))
    kernel = kernel_classes()[args.kernel]
    fmt, t = as_format(args.kernel, t)
    spec = fmt.spec(t, device_platform(), i, o, torch.float16, TP_WHOLE)
    p = kernel.prepare(t, spec, dev)
    rows_list = [int(r) for r in args.rows.split(",")]
    if args.kernel_times:
        from torch.profiler import ProfilerActivity, profile

        for rows in rows_list:
            x = torch.randn((rows, i), device=dev).half()
            out = torch.empty((rows, o), dtype=torch.float16, device=dev)
            p.run(x, *p.tensors.values(), *p.static, out, 0)  # a first call of this row count outside the profile
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.repeat):
                    p.run(x, *p.tensors.values(), *p.static, out, 0)
                torch.cuda.synchronize()
            print(f"{args.kernel} {args.shape} K={args.k_bits} {args.codebook}, {rows} rows, {args.repeat} calls:")
            for e in sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total):
                if e.self_device_time_total > 0:
                    per_call = e.self_device_time_total / args.repeat
                    print(f"  {e.key[:60]:60s} {e.count:4d} launches {per_call:9.1f} us per call", flush=True)
        return
    x = torch.randn((rows_list[0], i), device=dev).half()
    out = torch.empty((rows_list[0], o), dtype=torch.float16, device=dev)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()  # a profiler started with --profile-from-start off sees only these calls
    for _ in range(args.repeat):
        p.run(x, *p.tensors.values(), *p.static, out, 0)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
