"""One MoE layer's EXL3 expert bank on one tensor-parallel rank, by concept:

* :mod:`.plan`: the K-sorted slots, K groups and trellis offsets (:func:`plan_moe_layer`), the rank's intermediate
  channels;
* :mod:`.bank`: the six flat tensors that hold every expert (:class:`Exl3MoeBank`, :func:`bank_from_tensors`);
* :mod:`.tables`: the device pointer tables per slot and K group that grouped kernels take (built by
  :func:`.bank.pointer_tables`);
* :mod:`.reference`: the float64 reference forward (the oracle of the MoE tests).

See docs/moe-bank.md. Plain torch on any device; no vLLM and no exllamav3 import.
"""

from .bank import (
    GROUPED_OP_SCHEMA,
    Exl3MoeBank,
    ExpertViews,
    ProjView,
    bank_from_tensors,
    grouped_inputs,
    pointer_tables,
)
from .plan import (
    BANK_TENSORS,
    PIECE_KINDS,
    PROJ_DOWN,
    PROJ_GATE,
    PROJ_MODULES,
    PROJ_UP,
    PROJECTIONS,
    UNGATED_PROJECTIONS,
    ExpertBits,
    KGroup,
    MoePlan,
    ShardSlices,
    bank_layout,
    expert_projections,
    plan_moe_layer,
    proj_module,
    shard_slices,
    tp_shard,
    trellis_shape,
)
from .reference import ACTIVATIONS, dequantize_expert, reference_moe_forward
from .tables import BankTables, GroupTables, ProjTables

__all__ = [
    "ACTIVATIONS",
    "BANK_TENSORS",
    "GROUPED_OP_SCHEMA",
    "PIECE_KINDS",
    "PROJECTIONS",
    "PROJ_DOWN",
    "PROJ_GATE",
    "PROJ_MODULES",
    "PROJ_UP",
    "UNGATED_PROJECTIONS",
    "BankTables",
    "Exl3MoeBank",
    "ExpertBits",
    "ExpertViews",
    "GroupTables",
    "KGroup",
    "MoePlan",
    "ProjTables",
    "ProjView",
    "ShardSlices",
    "bank_from_tensors",
    "bank_layout",
    "dequantize_expert",
    "expert_projections",
    "grouped_inputs",
    "plan_moe_layer",
    "pointer_tables",
    "proj_module",
    "reference_moe_forward",
    "shard_slices",
    "tp_shard",
    "trellis_shape",
]
