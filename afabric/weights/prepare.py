"""Turning a task's slice into the bytes that travel: slice, cast or fp8-quantise, stage.

Shared by the transfer pipeline, the rank-0 baseline and :func:`simulate` (the plan run
with plain arrays, no transport), so all three produce the same bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import InvalidArgument
from .meta import Box, box_shape
from .plan import Plan, Task
from .quant import quantize_blocks


def torch_dtype(name: str) -> Any:
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise InvalidArgument(f"unknown torch dtype {name!r}")
    return dt


def slice_of(task: Task, region: Any, region_box: Box) -> Any:
    """The task's slice of a tensor holding ``region_box`` of the parameter."""
    if tuple(region.shape) != box_shape(region_box):
        raise InvalidArgument(
            f"{task.param}: local tensor has shape {tuple(region.shape)}, the plan expects "
            f"{box_shape(region_box)} (metadata and tensors disagree)"
        )
    index = tuple(slice(lo - r0, hi - r0) for (lo, hi), (r0, _) in zip(task.box, region_box, strict=True))
    return region[index]


def convert(task: Task, piece: Any) -> list[Any]:
    """The staged parts of a task, in order: the slice in its output dtype (contiguous),
    then (fp8) its float32 tile scales."""
    if task.fp8:
        data, scale = quantize_blocks(piece, task.block)
        return [data, scale]
    return [piece.to(torch_dtype(task.out_dtype)).contiguous()]


def stage_into(task: Task, parts: Sequence[Any], out: Any) -> None:
    """Copy the converted parts into ``out`` (a uint8 tensor of ``task.nbytes``)."""
    import torch

    offsets = [0, task.scale_offset]
    for part, off in zip(parts, offsets, strict=False):
        flat = part.reshape(-1).view(torch.uint8)
        out[off : off + flat.numel()].copy_(flat, non_blocking=True)


def materialize(task: Task, full: Any) -> Any:
    """A task's staged bytes (uint8 tensor) from the whole parameter."""
    import torch

    piece = slice_of(task, full, tuple((0, int(n)) for n in full.shape))
    out = torch.empty(task.nbytes, dtype=torch.uint8, device=full.device)
    if task.fp8:
        out[task.data_bytes : task.scale_offset].zero_()
    stage_into(task, convert(task, piece), out)
    return out


def simulate(plan: Plan, full: Mapping[str, Any]) -> list[Any]:
    """What every inference rank's buffer holds after one update (header left zero),
    computed from whole parameters with no transport: the reference the tests and the
    rank-0 baseline use."""
    import torch

    bufs = [torch.zeros(n, dtype=torch.uint8) for n in plan.dst_sizes]
    for task in plan.tasks:
        staged = materialize(task, full[task.param]).cpu()
        apply_writes(plan, task, staged, bufs)
    return bufs


def apply_writes(plan: Plan, task: Task, staged: Any, bufs: Sequence[Any]) -> None:
    """Copy a task's staged bytes to where its writes put them, in local buffers."""
    for _t, dst, s, d, n in plan.writes_of(task).tolist():
        bufs[dst][d : d + n].copy_(staged[s : s + n])
