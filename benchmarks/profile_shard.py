"""Run one EXL3 shard shape through one linear kernel a few times, for a profiler (Nsight Compute / Systems).

Usage (GPU machine): ``source ci/gpu/env.sh && ncu --profile-from-start off --launch-count 1 --section SpeedOfLight
-k regex:trellis_mma_kernel python3 benchmarks/profile_shard.py --kernel trellis_mma --shape 4096,14336 --rows 1``
(the profiler starts after prepare's warm-up launches: ``ci/gpu/pending.sh ncu``).
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
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    from kernel_8b import device_platform, kernel_classes

    from quantpack_core.codec import Exl3Tensors
    from quantpack_core.kernels import TP_WHOLE
    from quantpack_core.synthetic import random_exl3_layer
    from quantpack_exl3.format import EXL3

    dev = torch.device("cuda")
    i, o = (int(v) for v in args.shape.split(","))
    g = torch.Generator(device=dev).manual_seed(0)
    t = Exl3Tensors.from_tensors(random_exl3_layer(i, o, args.k_bits, args.codebook, generator=g, device=dev))
    kernel = kernel_classes()[args.kernel]
    spec = EXL3.spec(t, device_platform(), i, o, torch.float16, TP_WHOLE)
    p = kernel.prepare(t, spec, dev)
    x = torch.randn((args.rows, i), device=dev).half()
    out = torch.empty((args.rows, o), dtype=torch.float16, device=dev)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()  # a profiler started with --profile-from-start off sees only these calls
    for _ in range(args.repeat):
        p.run(x, *p.tensors.values(), *p.static, out, 0)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
