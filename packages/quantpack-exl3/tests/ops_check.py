"""The one opcheck helper every custom-op test uses (CPU and GPU tiers), and the list of ops it must cover.

``torch.library.opcheck`` checks an op's schema against what the implementation mutates, its autograd registration,
its fake implementation against the real one, and (by default) tracing under AOT dispatch with dynamic shapes.
Follows vLLM's ``tests/kernels/utils.py`` (``opcheck`` with ``DEFAULT_OPCHECK_TEST_UTILS``).
"""

import torch

DEFAULT_TEST_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
#: every op the project defines, with the test that opchecks it (a new op without an entry fails test_every_op_...)
COVERED = {
    "dense_gemm_": "test_exl3_ops.py::test_dense_gemm_opcheck_and_columns",
    "cpu_linear_": "test_exl3_ops.py::test_cpu_linear_opcheck_and_columns",
    "cpu_fused_moe_": "test_exl3_ops.py::test_cpu_fused_moe_matches_the_reference_loop",
    "exl3_moe_reference_": "test_exl3_ops.py::test_reference_moe_opcheck",
    "exl3_gemm_": "test_exl3_gpu_kernels.py::test_opcheck",
    "trellis_mma_": "test_exl3_gpu_kernels.py::test_opcheck",
    "exl3_moe_": "test_exl3_gpu_moe.py::test_opcheck",
    "trellis_moe_": "test_exl3_gpu_moe.py::test_opcheck",
    "escha_hip_": "quantpack-escha-rocm/tests/test_escha_hip.py::test_opcheck (extension stand-in)",
    "escha_triton_": "quantpack-escha-rocm/tests/test_escha_triton.py::test_opcheck (Triton's interpreter)",
    "int8_rows_logits_": "quantpack-core/tests/test_int8_logits.py::test_opcheck (CPU; the Triton kernel under the "
    "interpreter beside it)",
}


def opcheck(name: str, args: tuple, test_utils=DEFAULT_TEST_UTILS) -> None:
    """``torch.library.opcheck`` of ``quantpack::<name>`` on ``args`` (its ``out`` argument is mutated)."""
    torch.library.opcheck(getattr(torch.ops.quantpack, name).default, args, test_utils=test_utils)
