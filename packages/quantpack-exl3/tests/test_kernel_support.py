"""The support matrix: which kernel serves which shard or bank, pinned explicitly (platform and capability, K,
codebook, shape, model dtype, tensor-parallel cut). A change to a kernel's ``can_implement`` or to a priority list
that moves any cell fails here; docs/kernels.md is this table in prose.

The cells are what the kernels' static rules decide (``can_implement`` walked over the platform's list); whether a
kernel's extension imports on a machine (``available``) is checked where it matters: at config time (see
test_exl3_errors.py) and by the GPU tier."""

import pytest
import torch

from quantpack_core.dense import DenseKernel
from quantpack_core.kernels import CPU, CUDA, ROCM, ExpertSpec, LinearSpec, Platform

H200, A100, T4 = Platform(CUDA, 90), Platform(CUDA, 80), Platform(CUDA, 75)
RDNA4, HOST = Platform(ROCM, arch="gfx1201"), Platform(CPU)


def first_accepting(kernels, spec):
    """The kernel :func:`~quantpack_core.kernels.choose_kernel` would pick where every kernel is available."""
    return next((k.name for k in kernels if k.can_implement(spec)[0]), None)


def linear(platform, k, codebook, shape=(4096, 4096), dtype=torch.bfloat16, tp="whole", fmt="exl3"):
    (i, o), pad = shape, lambda n: -(-n // 128) * 128
    return LinearSpec(platform, fmt, k, codebook, pad(i), pad(o), i, o, dtype, tp)


LINEAR_MATRIX = [
    # platform, K, codebook, (in, out), dtype, tp -> kernel
    (H200, 4, "mul1", (4096, 4096), torch.bfloat16, "whole", "trellis_mma"),
    (H200, 4, "mul1", (4096, 14336), torch.float16, "sliced", "trellis_mma"),
    (H200, 1.5, "mul1", (4096, 1024), torch.bfloat16, "whole", "trellis_mma"),
    (H200, 8, "3inst", (200, 300), torch.float32, "whole", "exllamav3"),  # trellis_mma takes 16-bit models
    (H200, 2, "mcg", (256, 64), torch.bfloat16, "column-fallback", "trellis_mma"),
    (H200, 3, "mcg", (320, 256), torch.float16, "row-fallback", "trellis_mma"),
    (H200, 4, "mul1", (4096, 4096), torch.float64, "whole", None),  # the kernels take 16/32-bit models
    (A100, 5, "3inst", (4096, 4096), torch.float16, "whole", "trellis_mma"),
    (T4, 4, "mul1", (4096, 4096), torch.float16, "whole", None),  # both CUDA kernels need sm_80
    (HOST, 4, "mul1", (4096, 4096), torch.float32, "whole", "reference"),
    (HOST, 2.5, "mul1", (200, 300), torch.bfloat16, "column-fallback", "reference"),
    (HOST, 1, "3inst", (256, 128), torch.float16, "row-fallback", "reference"),
    (RDNA4, 2, "mul1", (4096, 4096), torch.bfloat16, "whole", None),  # no EXL3 kernel for ROCm yet
]


@pytest.mark.parametrize(("platform", "k", "codebook", "shape", "dtype", "tp", "want"), LINEAR_MATRIX)
def test_linear_support_matrix(platform, k, codebook, shape, dtype, tp, want):
    from quantpack_exl3.kernels import LINEAR_KERNELS

    spec = linear(platform, k, codebook, shape, dtype, tp)
    assert first_accepting(LINEAR_KERNELS[platform.kind], spec) == want


@pytest.mark.parametrize("platform", [H200, HOST, RDNA4])
def test_dense_shards_go_to_the_dense_kernel_everywhere(platform):
    from quantpack_exl3.kernels import LINEAR_KERNELS

    spec = linear(platform, None, None, (256, 8), fmt="dense")
    assert first_accepting([DenseKernel], spec) == "dense"
    assert first_accepting(LINEAR_KERNELS[platform.kind], spec) is None  # no EXL3 kernel takes a dense shard


EXPERT_MATRIX = [
    (H200, ((4.0, 4.0),), "mul1", torch.bfloat16, "whole", "trellis_mma"),
    (H200, ((2.0, 3.0), (3.0, 4.0), (4.0, 4.0)), "mul1", torch.float16, "expert-split", "trellis_mma"),
    (A100, ((3.0, 3.0),), "mcg", torch.float16, "sliced", "trellis_mma"),
    (H200, ((4.0, 4.0),), "3inst", torch.float32, "whole", "exllamav3"),
    (H200, tuple((float(k), 4.0) for k in range(1, 9)) * 3, "mul1", torch.float16, "whole", "exllamav3"),
    (T4, ((4.0, 4.0),), "mul1", torch.float16, "whole", None),
    (HOST, ((2.5, 3.0), (4.0, 4.0)), "mul1", torch.float32, "whole", "reference"),
    (RDNA4, ((2.0, 2.0),), "mul1", torch.bfloat16, "whole", None),
]


@pytest.mark.parametrize(("platform", "groups", "codebook", "dtype", "tp", "want"), EXPERT_MATRIX)
def test_expert_support_matrix(platform, groups, codebook, dtype, tp, want):
    from quantpack_exl3.kernels import EXPERT_KERNELS

    spec = ExpertSpec(platform, "exl3", codebook, groups, 128, 128, 2048, 768, dtype, tp)
    assert first_accepting(EXPERT_KERNELS[platform.kind], spec) == want


def test_reasons_name_what_does_not_fit():
    from quantpack_exl3.backends.exllamav3 import Exllamav3LinearKernel

    assert Exllamav3LinearKernel.can_implement(linear(T4, 4, "mul1")) == (
        False,
        "needs compute capability 8.0 or newer (this GPU has 7.5)",
    )
    ok, why = Exllamav3LinearKernel.can_implement(linear(RDNA4, 4, "mul1"))
    assert not ok and "needs a CUDA device (this platform is 'rocm')" in why
    ok, why = Exllamav3LinearKernel.can_implement(linear(H200, None, None, fmt="dense"))
    assert not ok and "EXL3 only" in why


def test_every_listed_kernel_declares_a_unique_name_per_operation():
    from quantpack_exl3.kernels import EXPERT_KERNELS, LINEAR_KERNELS

    for table in (LINEAR_KERNELS, EXPERT_KERNELS):
        for kernels in table.values():
            assert len({k.name for k in kernels}) == len(kernels)
