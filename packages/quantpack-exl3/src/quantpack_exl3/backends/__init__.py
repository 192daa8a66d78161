"""EXL3 kernel backends, one folder each, every folder owning its custom ops:

* ``exllamav3/``: exllamav3's CUDA kernels (CUDA sm_80+);
* ``reference/``: plain torch on any device (the CPU path; on a GPU only when forced);
* ``trellis_mma/``: the adapter of quantpack-core's own CUDA kernels (``quantpack_core.trellis_mma``, CUDA sm_80+),
  whose ops live with them.

Which kernel serves which shard: :mod:`quantpack_exl3.kernels` (the priority lists) and docs/kernels.md.
"""
