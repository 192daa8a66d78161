"""The trellis_mma kernels' settings: every tuning knob and the build's compiler and cache, in one frozen
:class:`Settings` read from the environment once, at first use (:func:`current`), so a process runs under one set of
values however late a module is imported.

Tests and benchmarks run under other values with :func:`using` (a context manager): ``with using(delegate_rows=0):
...`` runs its body under the current settings with those fields replaced and restores them on exit. Values that
shape what :func:`.ops.reserve` allocates or plans (the CTA targets) apply to workspaces made inside the block; the
others apply to every call made inside it.

Standard library only: ``ci/gpu/stage.sh`` builds the library where torch is not installed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

logger = logging.getLogger("vllm.quantpack")

PREFIX = "QUANTPACK_TRELLIS_MMA_"
T = TypeVar("T")


@dataclass(frozen=True)
class Settings:
    """The trellis_mma kernels' settings (environment variable of each in brackets).

    Attributes:
        delegate_rows: None: which row buckets of each run go to the delegate ( another implementation its
            adapter gives) is measured when the run is prepared; N: the same for every run, the buckets wholly
            above N rows delegated (0: none) [``QUANTPACK_TRELLIS_MMA_DELEGATE_ROWS``; not an integer >= 0: None, with a
            warning].
        inline_transform_rows: 1: a one-row call's CTAs transform their own input panel (had128(x * suh)); 0: one
            transform launch first, as from two rows on. The in-CTA transform was measured slower from two rows on
            (that variant's timings are not kept; the 8B stack fused at 4 / 16 rows takes 3.66 / 3.89 ms with one
            transform launch, benchmarks/results/kernel_8b_split.json) [``..._INLINE_TRANSFORM_ROWS``; larger values
            count as 1].
        ctas_per_sm: CTAs a launch of up to 16 rows aims at per SM (split-K fills the GPU with them), 1 to
            :data:`MAX_CTAS_PER_SM` [``..._CTAS_PER_SM``].
        ctas_per_sm_wide: the same above 16 rows (the 64-row kernel, whose split-K partials are 4x as many rows:
            fewer splits trade parallelism for a shorter partial sum); 2 measured fastest on the H200
            (benchmarks/results/kernel_8b_wide2.json / _wide3.json: the 8B stack at 32 / 64 / 128 / 256 rows took
            7.14 / 8.50 / 12.88 / 21.12 ms with 2, 7.38 / 9.11 / 13.26 / 21.62 with 3; 4's timings are not kept)
            [``..._CTAS_PER_SM_WIDE``; unset: ``ctas_per_sm`` where that is set to a valid value, else 2].
        wide_fused: the split-K kernel above 16 rows runs a layer's shards (q / k / v, gate / up) in one launch too,
            as up to 16 rows, instead of a launch per shard (benchmarks/results/kernel_8b_wide_fused.json: the 8B stack
            at 32 / 64 / 128 rows took 5.85 / 6.64 / 11.32 ms against 6.98 / 8.51 / 12.90); the tensor-core kernel
            and the dense route always take a run's shards together [``..._WIDE_FUSED``: 1 / 0, true / false, on /
            off, yes / no].
        wide_kernel: above 16 rows, None: the kernel of each row bucket (the split-K kernel, on Hopper the
            tensor-core kernel with 64, 128 or 256 rows per CTA, from 513 rows the dense route) is measured when a run
            is prepared, where there is a choice; "split" / "tc": that kernel for every bucket above 16 rows (the
            tensor-core one where the GPU has it), "dense": the dense route (a shard's weights rebuilt in the model
            dtype per call, then cuBLAS) [``..._WIDE_KERNEL``; another value: None, with a warning].
        moe_tc_picks: expert banks on Hopper: a call whose tokens x top_k reach this many picks per expert of the
            layer (a rank of the expert split counts over the layer's experts, not its own) runs the tensor-core
            expert path (``csrc/moe_tc.cu``, 64-row work items), a smaller one the 16-row kernel; 0: never (and no
            buffers for it). 8: where the two paths cross on an H100 (``benchmarks/moe_op.py``, a 30B-A3B bank: 0.317
            / 0.319 ms at 8 picks per expert, 0.483 / 0.347 at 16) [``..._MOE_TC_PICKS``].
        nvcc: the compiler; None: ``$CUDA_HOME/bin/nvcc``, then ``nvcc`` on ``PATH`` [``QUANTPACK_NVCC``].
        cache_dir: where built libraries are kept [``QUANTPACK_CACHE_DIR``; default ``$XDG_CACHE_HOME/quantpack``
            or ``~/.cache/quantpack``].
    """

    delegate_rows: int | None = None
    inline_transform_rows: int = 1
    ctas_per_sm: int = 4
    ctas_per_sm_wide: int = 2
    wide_fused: bool = True
    wide_kernel: str | None = None
    moe_tc_picks: int = 8
    nvcc: str | None = None
    cache_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "quantpack")

    def __post_init__(self) -> None:
        """Refuse a value no knob takes (the environment's are checked, with a warning, before they get here:
        this catches :func:`using`'s)."""
        allowed = {
            "delegate_rows": self.delegate_rows is None or _int_in(self.delegate_rows, 0),
            "inline_transform_rows": self.inline_transform_rows in (0, 1),
            "ctas_per_sm": _int_in(self.ctas_per_sm, 1, MAX_CTAS_PER_SM),
            "ctas_per_sm_wide": _int_in(self.ctas_per_sm_wide, 1, MAX_CTAS_PER_SM),
            "wide_fused": isinstance(self.wide_fused, bool),
            "wide_kernel": self.wide_kernel is None or self.wide_kernel in WIDE_KERNELS,
            "moe_tc_picks": _int_in(self.moe_tc_picks, 0),
        }
        bad = [f"{name}={getattr(self, name)!r}" for name, ok in allowed.items() if not ok]
        if bad:
            raise ValueError(f"trellis_mma settings: {', '.join(bad)} out of range (see Settings' attributes)")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        """The settings an environment gives; a value a knob does not take is ignored with a warning naming the
        variable (a bad setting never stops a server from starting)."""
        per_sm = _env_int(environ, f"{PREFIX}CTAS_PER_SM", None, minimum=1, maximum=MAX_CTAS_PER_SM)
        wide_default = cls.ctas_per_sm_wide if per_sm is None else per_sm  # follows a valid CTAS_PER_SM only
        base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return cls(
            delegate_rows=_env_int(
                environ, f"{PREFIX}DELEGATE_ROWS", None, instead="measuring each layer's delegated row buckets instead"
            ),
            inline_transform_rows=min(_env_int(environ, f"{PREFIX}INLINE_TRANSFORM_ROWS", 1), 1),
            ctas_per_sm=cls.ctas_per_sm if per_sm is None else per_sm,
            ctas_per_sm_wide=_env_int(
                environ, f"{PREFIX}CTAS_PER_SM_WIDE", wide_default, minimum=1, maximum=MAX_CTAS_PER_SM
            ),
            wide_fused=_env_choice(environ, f"{PREFIX}WIDE_FUSED", SWITCH_VALUES, cls.wide_fused, "using 1"),
            wide_kernel=_env_choice(
                environ, f"{PREFIX}WIDE_KERNEL", {k: k for k in WIDE_KERNELS}, None, "measuring each run's kernels"
            ),
            moe_tc_picks=_env_int(environ, f"{PREFIX}MOE_TC_PICKS", cls.moe_tc_picks),
            nvcc=environ.get("QUANTPACK_NVCC") or None,
            cache_dir=Path(environ.get("QUANTPACK_CACHE_DIR") or Path(base) / "quantpack"),
        )


def _int_in(value: object, minimum: int, maximum: int | None = None) -> bool:
    """Whether ``value`` is an int (not a bool) from ``minimum`` to ``maximum`` (None: no upper limit)."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    return ok and (maximum is None or value <= maximum)


#: the most CTAs a launch may aim at per SM (an SM holds at most 32 resident blocks on sm_80 / sm_90)
MAX_CTAS_PER_SM = 32


def _env_int(
    environ: Mapping[str, str],
    name: str,
    default: int | None,
    minimum: int = 0,
    maximum: int | None = None,
    instead: str | None = None,
) -> int | None:
    """An integer setting, or ``default`` (with a warning naming the variable, and saying what happens ``instead``,
    when it is set but not an integer from ``minimum`` to ``maximum``)."""
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError
    except ValueError:
        limits = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
        instead = instead or f"using {'the default' if default is None else default}"
        logger.warning("quantpack: %s=%r is not an integer %s; %s", name, raw, limits, instead)
        return default
    return value


#: the spellings a switch accepts, and what each means
SWITCH_VALUES = {**dict.fromkeys(("1", "true", "on", "yes"), True), **dict.fromkeys(("0", "false", "off", "no"), False)}
#: the values of ``wide_kernel`` besides None
WIDE_KERNELS = ("split", "tc", "dense")


def _env_choice(environ: Mapping[str, str], name: str, choices: Mapping[str, T], default: T, instead: str) -> T:
    """The value of one of ``choices`` (its key, in any case) a setting names, or ``default`` (unset; or another
    value, with a warning naming the variable and saying what happens ``instead``)."""
    raw = environ.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw not in choices:
        logger.warning("quantpack: %s=%r is not one of %s; %s", name, raw, tuple(choices), instead)
        return default
    return choices[raw]


_current: Settings | None = None
_lock = threading.Lock()


def current() -> Settings:
    """The settings in force: read from the environment at the first call of the process, or those of the innermost
    :func:`using` block."""
    global _current
    if _current is None:
        with _lock:
            if _current is None:
                _current = Settings.from_env()
    return _current


@contextmanager
def using(**changes: object) -> Iterator[Settings]:
    """Run the block under the current settings with ``changes`` (field names of :class:`Settings`) replaced;
    restored on exit. Yields the settings in force inside.

    Raises:
        TypeError: a name that is not a field of :class:`Settings`.
    """
    global _current
    before = current()
    _current = dataclasses.replace(before, **changes)
    try:
        yield _current
    finally:
        _current = before
