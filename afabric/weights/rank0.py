"""The common baseline, on the same processes and memory: every trainer sends its shards to
training rank 0 (``gather``), which assembles whole parameters, converts every slice of the
plan once (the same bytes the point-to-point path writes: fusion, casts, fp8) and sends
them to inference rank 0 (``send``), which lays out every inference rank's buffer and hands
each its own (``scatter``). All through torch.distributed (gloo), one NIC carrying
everything at each step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from .meta import Box, box_numel, dtype_size
from .plan import Plan, replica_sets
from .prepare import apply_writes, materialize, torch_dtype

if TYPE_CHECKING:
    from .receiver import Receiver
    from .sender import Sender


class SessionView(Protocol):
    """What this baseline uses of the session (:class:`afabric.weights.session.WeightTransfer`,
    which calls :func:`run`): named here so this module stands below the session instead of
    importing it back."""

    rank: int
    trainers: list[int]
    plan: Plan
    receiver: Receiver | None
    sender: Sender | None
    ctrl: Any
    trainer_group: Any
    inference_group: Any

    async def _control(self, fn: Any, what: str) -> Any: ...


def _primaries(s: SessionView) -> dict[int, list[tuple[str, Box]]]:
    """For every trainer, the (param, box) it contributes: one holder per distinct shard."""
    out: dict[int, list[tuple[str, Box]]] = {r: [] for r in s.trainers}
    for name in sorted(s.plan.sources):
        for box, ranks in replica_sets(s.plan.sources[name]):
            out[ranks[0]].append((name, box))
    return out


def _nbytes(s: SessionView, items: list[tuple[str, Box]]) -> int:
    return sum(box_numel(b) * dtype_size(s.plan.sources[n].dtype) for n, b in items)


async def run(s: SessionView, version: int) -> tuple[int, int]:
    """This rank's part of a rank-0 update; ``(bytes sent, bytes received)``."""
    if s.sender is not None:
        return await _trainer(s)
    return await _inference(s, version)


async def _trainer(s: SessionView) -> tuple[int, int]:
    import torch
    import torch.distributed as dist

    assert s.sender is not None
    plan = s.plan
    t0 = plan.trainers[0]
    prim = _primaries(s)
    width = max(_nbytes(s, items) for items in prim.values())
    buf = torch.zeros(width, dtype=torch.uint8)
    off = 0
    for name, box in prim[s.rank]:
        local, lbox = s.sender.local(name)
        assert tuple(box) == tuple(lbox)
        flat = local.detach().reshape(-1).view(torch.uint8)
        buf[off : off + flat.numel()].copy_(flat)
        off += flat.numel()
    gathered = [torch.empty(width, dtype=torch.uint8) for _ in s.trainers] if s.rank == t0 else None
    await s._control(lambda: dist.gather(buf, gathered, dst=t0, group=s.trainer_group), "rank-0 gather")
    if s.rank != t0:
        return off, 0
    assert gathered is not None
    full = _assemble(s, prim, gathered)
    gathered.clear()  # the shards are copied into whole parameters now
    dev = s.sender.device
    unique = torch.empty(plan.unique_bytes(), dtype=torch.uint8)
    o = 0
    for task in plan.tasks:
        src = full[task.param]
        if dev is not None and src.device != dev:
            full[task.param] = src = src.to(dev)
        unique[o : o + task.nbytes].copy_(materialize(task, src))
        o += task.nbytes
    del full
    await s._control(lambda: dist.send(unique, dst=plan.inference[0], group=s.ctrl), "rank-0 send")
    return unique.numel(), sum(_nbytes(s, prim[r]) for r in s.trainers if r != t0)


def _assemble(
    s: SessionView, prim: dict[int, list[tuple[str, Box]]], gathered: list[Any]
) -> dict[str, Any]:
    """Whole parameters from every trainer's gathered shards."""
    import torch

    full: dict[str, Any] = {}
    for k, r in enumerate(s.trainers):
        o = 0
        for name, box in prim[r]:
            src = s.plan.sources[name]
            t = full.get(name)
            if t is None:
                t = full[name] = torch.empty(src.shape, dtype=torch_dtype(src.dtype))
            n = box_numel(box) * dtype_size(src.dtype)
            shape = tuple(b - a for a, b in box)
            t[tuple(slice(a, b) for a, b in box)] = gathered[k][o : o + n].view(t.dtype).view(shape)
            o += n
    return full


async def _inference(s: SessionView, version: int) -> tuple[int, int]:
    import torch
    import torch.distributed as dist

    assert s.receiver is not None
    plan = s.plan
    i0 = plan.inference[0]
    width = max(plan.dst_sizes)
    out = torch.empty(width, dtype=torch.uint8)
    parts = None
    sent = received = 0
    if s.rank == i0:
        unique = torch.empty(plan.unique_bytes(), dtype=torch.uint8)
        await s._control(lambda: dist.recv(unique, src=plan.trainers[0], group=s.ctrl), "rank-0 recv")
        received += unique.numel()
        parts = [torch.zeros(width, dtype=torch.uint8) for _ in plan.inference]
        o = 0
        for task in plan.tasks:
            apply_writes(plan, task, unique[o : o + task.nbytes], parts)
            o += task.nbytes
        sent += sum(plan.dst_sizes[1:])
    await s._control(lambda: dist.scatter(out, parts, src=i0, group=s.inference_group), "rank-0 scatter")
    if s.rank != i0:
        received += plan.dst_sizes[plan.inference.index(s.rank)]
    hdr = plan.header_bytes
    size = s.receiver.layout.nbytes
    s.receiver.buffer[hdr:size].copy_(out[hdr:size])
    s.receiver.set_version(version)
    return sent, received
