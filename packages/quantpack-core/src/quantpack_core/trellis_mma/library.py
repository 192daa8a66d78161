"""Building and loading the trellis_mma kernels (``csrc/``): nvcc alone, no torch headers, loaded with ctypes.

The sources are compiled once per (sources, nvcc version, flags, GPU architecture) into a shared library cached under
``$QUANTPACK_CACHE_DIR`` (default ``$XDG_CACHE_HOME/quantpack`` or ``~/.cache/quantpack``). Each ``.cu`` of
:data:`UNITS` is its own translation unit, compiled by its own nvcc process, all at once, then linked into one
library; a unit may ask for the arch-specific target on Hopper (``sm_90a``: wgmma and the other instructions only
that architecture has) while the others build for the plain architecture.
Its entry points take device pointers and a ``cudaStream_t``, so the library does not depend on the torch build.
``QUANTPACK_NVCC`` names the compiler; otherwise ``$CUDA_HOME/bin/nvcc``, then ``nvcc`` on ``PATH`` (both variables
read once, with the kernels' other settings: :mod:`.settings`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .settings import current

logger = logging.getLogger("vllm.quantpack")

CSRC = Path(__file__).with_name("csrc")


@dataclass(frozen=True)
class Unit:
    """One translation unit of the library.

    Attributes:
        source: its file under ``csrc/``.
        hopper_specific: built for ``sm_90a`` on Hopper (compute capability 9.0), for instructions only that
            architecture has (wgmma); for the plain architecture on every other GPU.
    """

    source: str
    hopper_specific: bool = False

    def gencode(self, arch: int) -> str:
        """Its nvcc ``-gencode`` option for compute capability ``arch``."""
        target = f"{arch}a" if self.hopper_specific and arch == 90 else str(arch)
        return f"-gencode=arch=compute_{target},code=sm_{target}"


#: the library's translation units (each includes ``csrc/common.cuh``)
UNITS = (
    Unit("linear.cu"),
    Unit("moe.cu"),
    Unit("tc.cu", hopper_specific=True),
    Unit("moe_tc.cu", hopper_specific=True),
    Unit("dense.cu"),
)
#: what to install when nvcc is missing
NVCC_HINT = (
    "install the CUDA toolkit's nvcc (one that knows your GPU's architecture, and no newer than your driver) and put "
    "it on PATH, or set CUDA_HOME or QUANTPACK_NVCC"
)
#: nvcc flags of each unit's compilation besides its architecture, and of the link (part of the cache key)
COMPILE_FLAGS = ("-O3", "-std=c++17", "-Xcompiler", "-fPIC")
LINK_FLAGS = ("-shared",)
#: return codes of the library's entry points below 0
ERRORS = {
    -1: "bad geometry (k and n must be multiples of 128, the input no wider than k, out_features at most n; the dense "
    "route's weights buffer 8-byte aligned)",
    -2: "no kernel for this K",
    -3: "unknown codebook id",
    -4: "the workspace is too small for this call",
    -5: "one launch runs 1-8 shards",
    -6: "the tensor-core kernels run on Hopper (compute capability 9.0) only",
}


class LibraryError(RuntimeError):
    """nvcc is missing, the build failed, or a kernel launch returned an error; the message says which and the fix."""


#: the settings that serve without these kernels, one per format whose adapter uses them (:func:`add_fallback`)
_fallbacks: list[str] = []


def add_fallback(setting: str) -> None:
    """Name ``setting`` (e.g. a format's backend variable forcing another kernel) in the messages of a missing
    compiler, a failed build and a failed launch, as what serves without these kernels."""
    if setting not in _fallbacks:
        _fallbacks.append(setting)


def nvcc_hint() -> str:
    """What to do when nvcc is missing: :data:`NVCC_HINT`, and the fallbacks where adapters named some."""
    return f"{NVCC_HINT}; or serve with {' or '.join(_fallbacks)}" if _fallbacks else NVCC_HINT


def _serves_without(template: str) -> str:
    """``template`` with the fallbacks (``{}``), or an empty string where no adapter named one."""
    return template.format(" or ".join(_fallbacks)) if _fallbacks else ""


def nvcc_path() -> str | None:
    """The nvcc to build with (the settings' ``nvcc``, ``$CUDA_HOME/bin/nvcc``, ``PATH``), or None."""
    explicit = current().nvcc
    if explicit:
        return explicit
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


@functools.cache
def compiler_reason() -> str | None:
    """Why the kernels cannot be built on this machine (no nvcc, or it does not run), or None. Checked once per
    process; runs ``nvcc --version`` only (no CUDA initialization, no build)."""
    nvcc = nvcc_path()
    if nvcc is None:
        return f"no nvcc; {nvcc_hint()}"
    try:
        subprocess.run([nvcc, "--version"], capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{nvcc} --version failed ({e}); {nvcc_hint()}"
    return None


def cache_dir() -> Path:
    """Where built libraries are kept (created on demand): the settings' ``cache_dir``."""
    return current().cache_dir


def library_path(arch: int, nvcc: str | None = None) -> Path:
    """Where :func:`build` keeps (or finds) the library for ``arch`` built by ``nvcc``: under :func:`cache_dir`,
    named by a hash of the sources (every ``.cu`` and ``.cuh``), ``nvcc --version``'s output, the flags (each unit's
    architecture option too) and the architecture, so a library built on
    another machine with the same compiler and copied there is used as is (``ci/gpu/stage.sh`` stages one).

    Args:
        arch: compute capability as ``major * 10 + minor``.
        nvcc: the compiler (default :func:`nvcc_path`).

    Raises:
        LibraryError: no nvcc, or ``nvcc --version`` failed.
    """
    nvcc = nvcc or nvcc_path()
    if nvcc is None:
        raise LibraryError(f"trellis_mma: no nvcc to build its kernels; {nvcc_hint()}")
    try:
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise LibraryError(f"trellis_mma: {nvcc} --version failed ({e}); {nvcc_hint()}") from None
    ident = hashlib.sha256()
    for source in sorted(CSRC.iterdir()):  # every source and header, by name
        if source.suffix in (".cu", ".cuh"):
            ident.update(source.name.encode() + b"\0" + source.read_bytes())
    flags = (*COMPILE_FLAGS, *LINK_FLAGS, *(f"{u.source}:{u.gencode(arch)}" for u in UNITS))
    ident.update(version.encode() + str(arch).encode() + " ".join(flags).encode())
    return cache_dir() / f"trellis_mma-sm{arch}-{ident.hexdigest()[:16]}.so"


def build(arch: int, nvcc: str | None = None) -> Path:
    """Compile the kernels for one GPU architecture unless a cached build exists.

    Args:
        arch: compute capability as ``major * 10 + minor`` (90 for an H200).
        nvcc: the compiler (default :func:`nvcc_path`).

    Returns:
        the shared library's path.

    Raises:
        LibraryError: no nvcc, or the compiler failed (its output is in the message).
    """
    nvcc = nvcc or nvcc_path()
    target = library_path(arch, nvcc)
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LibraryError(
            f"trellis_mma: cannot create its build cache {target.parent} ({e}); set QUANTPACK_CACHE_DIR"
        ) from None
    logger.info("quantpack: building the trellis_mma kernels for sm_%d with %s (once, 1-2 minutes)", arch, nvcc)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        objects = _compile_units(nvcc, arch, Path(tmp))
        _run([nvcc, *LINK_FLAGS, "-o", str(out), *map(str, objects)])
        os.replace(out, target)  # atomic: another process building the same key sees a whole file or none
    return target


def _compile_units(nvcc: str, arch: int, tmp: Path) -> list[Path]:
    """Compile each unit of :data:`UNITS` to an object in ``tmp``: one nvcc process per unit, all running at once.

    Raises:
        LibraryError: a unit failed to compile (the first failing one's command and output).
    """
    objects, running = [], []
    for unit in UNITS:
        obj = tmp / f"{unit.source}.o"
        cmd = [nvcc, *COMPILE_FLAGS, unit.gencode(arch), "-c", "-o", str(obj), str(CSRC / unit.source)]
        running.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
        objects.append(obj)
    failed = None
    for cmd, proc in running:
        _, stderr = proc.communicate()
        if proc.returncode != 0 and failed is None:
            failed = (cmd, stderr)
    if failed is not None:
        _fail(*failed)
    return objects


def _run(cmd: list[str]) -> None:
    """Run one build command (the link); :class:`LibraryError` with its output when it fails."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        _fail(cmd, done.stderr)


def _fail(cmd: list[str], stderr: str) -> None:
    raise LibraryError(
        f"trellis_mma: building its kernels failed ({' '.join(cmd)})"
        f"{_serves_without('; {} serves without them')}:\n{stderr[-4000:]}"
    )


@functools.cache
def load(arch: int) -> ctypes.CDLL:
    """Build (if needed) and load the library for one architecture, with its entry points' argument types set.

    Raises:
        LibraryError: as :func:`build`.
    """
    lib = ctypes.CDLL(str(build(arch)))
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.qp_trellis_mma.restype = i32
    lib.qp_trellis_mma.argtypes = [
        ptr, ptr,  # x, xh
        ptr, ptr, ptr, ptr, ptr, ptr, i32,  # per shard (host arrays): trellis, suh, svh, n, col, out_features; count
        ptr, ptr, i64, ptr, i64,  # out, partials, capacity, counters, capacity
        i32, i32, i32, i32, i32,  # rows, x_width, x_stride, k, out_stride
        i32, i32, i32, i32, i32,  # codebook, 2K, bf16, target CTAs, rows transformed in the GEMM
        ptr,  # stream
    ]  # fmt: skip
    lib.qp_trellis_mma_splits.restype = i32
    lib.qp_trellis_mma_splits.argtypes = [i32, i32, i32, i32, i64, i64]
    # the tensor-core kernel (tc.cu; runs on Hopper, whose build has sm_90a's wgmma)
    lib.qp_trellis_tc.restype = i32
    lib.qp_trellis_tc.argtypes = [
        ptr, ptr,  # x (None: xh holds the transformed input), xh
        ptr, ptr, ptr, ptr, ptr, ptr, i32,  # per shard (host arrays): trellis, suh, svh, n, col, out_features; count
        ptr, ptr, i64, ptr, i64,  # out, partials, capacity, counters, capacity
        i32, i32, i32, i32, i32,  # rows, x_width, x_stride, k, out_stride
        i32, i32, i32, i32, i32, i32,  # codebook, 2K, bf16, target CTAs, rows per CTA, partial sums only
        ptr,  # stream
    ]  # fmt: skip
    lib.qp_trellis_tc_rows.restype = i32
    lib.qp_trellis_tc_rows.argtypes = [i32]
    lib.qp_trellis_tc_splits.restype = i32
    lib.qp_trellis_tc_splits.argtypes = [i32, i32, i32, i32, i32, i64, i64]
    # the dense route (dense.cu): a shard's weights rebuilt for one GEMM
    lib.qp_trellis_dense.restype = i32
    lib.qp_trellis_dense.argtypes = [
        ptr, ptr, ptr, ptr,  # trellis, suh, svh, w
        i32, i32, i32, i32,  # k, n, first column, columns
        i32, i32, i32, ptr,  # codebook, 2K, bf16, stream
    ]  # fmt: skip
    lib.qp_decode_tile_host.restype = i32
    lib.qp_decode_tile_host.argtypes = [ptr, i32, i32, ptr]
    # expert banks
    lib.qp_moe_items.restype = i32
    lib.qp_moe_items.argtypes = [i32, i32, i32]
    lib.qp_moe_splits.restype = i32
    lib.qp_moe_splits.argtypes = [i32, i32, i32, i32, i32, i64, i64]
    lib.qp_moe_plan_host.restype = None
    lib.qp_moe_plan_host.argtypes = [ptr, i32, ptr, i32, ptr, ptr, ptr, i32]
    lib.qp_moe_sort.restype = i32
    lib.qp_moe_sort.argtypes = [
        ptr, i32, ptr, i32, i32, ptr, i32, i32,  # ids, int64?, perm, picks, slots, group starts (host), groups, rows
        ptr, ptr, ptr, ptr, ptr, ptr,  # slot_of, offsets, sorted, work, group_work, stream
    ]  # fmt: skip
    lib.qp_moe_gemm.restype = i32
    lib.qp_moe_gemm.argtypes = [
        i32, i32, ptr, ptr, ptr, ptr, i32,  # down, gated, x, gu, y, tables, slots
        ptr, ptr, ptr, ptr,  # sorted, offsets, work, group_work
        i32, ptr, ptr, i32,  # K groups, their 2K (host array), weights, weights dtype
        ptr, i64, ptr, i64,  # partials, capacity, counters, capacity
        i32, i32, i32, i32, i32, i32,  # items, top_k, x_width, x_stride, k, n_proj
        i32, i32, i32, ptr,  # codebook, bf16, target CTAs, stream
    ]  # fmt: skip
    # the expert banks' tensor-core path (moe_tc.cu; Hopper)
    lib.qp_moe_tc_gemm.restype = i32
    lib.qp_moe_tc_gemm.argtypes = [
        i32, i32, ptr, ptr, ptr, ptr, i64, ptr, i32,  # down, gated, x, gu, y, xh, its capacity, tables, slots
        ptr, ptr, ptr, ptr, ptr,  # slot_of, sorted, offsets, work, group_work
        i32, ptr, ptr, i32,  # K groups, their 2K (host array), weights, weights dtype
        ptr, i64, ptr, i64,  # partials, capacity, counters, capacity
        i32, i32, i32, i32, i32, i32, i32, i32,  # picks, items, rows per item, top_k, x_width, x_stride, k, n_proj
        i32, i32, i32, ptr,  # codebook, bf16, target CTAs, stream
    ]  # fmt: skip
    lib.qp_moe_reduce.restype = i32
    lib.qp_moe_reduce.argtypes = [ptr, ptr, ptr, i32, i32, i32, i32, i32, i32, ptr]
    return lib


def check(code: int, what: str) -> None:
    """Raise :class:`LibraryError` for a non-zero return code of an entry point.

    Args:
        code: the return code (< 0: the library's own, see :data:`ERRORS`; > 0: a ``cudaError_t``).
        what: the call, for the message.
    """
    if code == 0:
        return
    why = ERRORS.get(code, f"CUDA error {code} (a cudaError_t; 35: the driver is older than the nvcc that built it)")
    raise LibraryError(f"trellis_mma: {what}: {why}{_serves_without(' ({} serves without these kernels)')}")
