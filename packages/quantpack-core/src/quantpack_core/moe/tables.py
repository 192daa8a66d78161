"""Device pointer tables of an expert bank: per physical slot, the ``data_ptr()`` of its trellis, suh and svh for
each projection, whole and sliced per K group, as grouped kernels take them.

Follows docs/moe-bank.md ("Pointer tables") and exllamav3 ``exllamav3/modules/multilinear.py`` (``ptrs_trellis`` /
``ptrs_suh`` / ``ptrs_svh`` as int64 tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ProjTables:
    """Device pointer tables of one projection, one entry per slot (physical order).

    Attributes:
        trellis: int64 ``(n,)``, ``data_ptr()`` of each slot's trellis.
        suh: int64 ``(n,)``, ``data_ptr()`` of each slot's suh.
        svh: int64 ``(n,)``, ``data_ptr()`` of each slot's svh.

    Source: docs/moe-bank.md; exllamav3 ``multilinear.py`` (``ptrs_trellis``, ``ptrs_suh``, ``ptrs_svh``).
    """

    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor

    def slice(self, lo: int, hi: int) -> ProjTables:
        """Entries of slots ``[lo, hi)`` (views of these tables)."""
        return ProjTables(self.trellis[lo:hi], self.suh[lo:hi], self.svh[lo:hi])


@dataclass(frozen=True)
class GroupTables:
    """The pointer tables of one K group: everything one grouped kernel launch needs.

    Attributes:
        k_gu, k_d: the group's K of w1 / w3 and of w2.
        lo, hi: its slots ``[lo, hi)``.
        gate, up, down: :class:`ProjTables` of w1, w3, w2 over those slots.

    Source: docs/moe-bank.md.
    """

    k_gu: float
    k_d: float
    lo: int
    hi: int
    gate: ProjTables
    up: ProjTables
    down: ProjTables


@dataclass(frozen=True)
class BankTables:
    """All pointer tables of a bank.

    Attributes:
        groups: one :class:`GroupTables` per K group, in slot order.
        gate, up, down: the whole-layer :class:`ProjTables` (all E slots) the groups are slices of.

    Source: docs/moe-bank.md.
    """

    groups: tuple[GroupTables, ...]
    gate: ProjTables
    up: ProjTables
    down: ProjTables
