"""RL weight transfer: training ranks write weights straight into inference ranks' memory.

:func:`build_plan` turns parameter metadata (:class:`SourceParam`, from DTensor placements)
and inference sharding (:class:`DestTensor`: TP slices, fused projections, fp8 with tile
scales) into a static :class:`Plan`; :class:`WeightTransfer` runs it every step over an
:class:`afabric.Engine`, with torch.distributed (gloo) as the control plane, and also runs
the rank-0 baseline. Nothing here imports torch until it is used.
"""

from .layout import FP8, DestTensor, Part, RankLayout
from .meta import Box, LocalShard, Placement, SourceParam, source_of
from .models import (
    PRESETS,
    ModelShape,
    fsdp_sources,
    inference_layouts,
    rank_tensors,
    small_model,
    training_params,
)
from .plan import Group, Plan, PlanOptions, Task, build_plan
from .prepare import simulate
from .receiver import Receiver, WeightUpdateFailed
from .session import UpdateStats, WeightTransfer

__all__ = [
    "FP8",
    "PRESETS",
    "Box",
    "DestTensor",
    "Group",
    "LocalShard",
    "ModelShape",
    "Part",
    "Placement",
    "Plan",
    "PlanOptions",
    "RankLayout",
    "Receiver",
    "SourceParam",
    "Task",
    "UpdateStats",
    "WeightTransfer",
    "WeightUpdateFailed",
    "build_plan",
    "fsdp_sources",
    "inference_layouts",
    "rank_tensors",
    "simulate",
    "small_model",
    "source_of",
    "training_params",
]
