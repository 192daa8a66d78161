"""trellis_mma: the project's own CUDA kernels for trellis shards and expert banks (CUDA sm_80+), shared by every
format whose weights are trellis tiles; an optional part of quantpack-core, built by nvcc at first use (importing this
package needs neither nvcc nor a GPU).

A format's adapter kernel hands them trellis tiles, a codebook id, K and scales (:func:`prepare_shard`,
:func:`fuse_shards`, :func:`prepare_bank`; :func:`available` and :func:`unsupported` for its ``available`` /
``can_implement``), and may give another implementation of the same shard call that a run's row buckets go to where
it measured faster (:class:`.selection.Delegate`).

Modules: :mod:`.kernels` (what adapters call), :mod:`.ops` (``quantpack::trellis_mma_`` and the per-GPU workspace),
:mod:`.moe` (``quantpack::trellis_moe_`` and its buffers), :mod:`.selection` (the kernel of each row bucket,
measured at load, the warm-up, the records), :mod:`.library` (the nvcc build of ``csrc/`` and ctypes loading).
"""

from .kernels import NAME, available, fuse_shards, prepare_bank, prepare_shard, unsupported
from .selection import Delegate

__all__ = [
    "NAME",
    "Delegate",
    "available",
    "fuse_shards",
    "prepare_bank",
    "prepare_shard",
    "unsupported",
]
