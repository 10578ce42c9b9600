"""The common baseline, on the same processes and memory: every trainer sends its shards to
training rank 0 (``gather``), which assembles whole parameters, converts every slice of the
plan once (the same bytes the point-to-point path writes: fusion, casts, fp8) and sends
them to inference rank 0 (``send``), which lays out every inference rank's buffer and hands
each its own (``scatter``). All through torch.distributed (gloo), one NIC carrying
everything at each step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .meta import box_numel, dtype_size
from .plan import replica_sets
from .prepare import apply_writes, materialize, torch_dtype

if TYPE_CHECKING:
    from .session import WeightTransfer


def _primaries(s: WeightTransfer) -> dict[int, list[tuple[str, Any]]]:
    """For every trainer, the (param, box) it contributes: one holder per distinct shard."""
    out: dict[int, list[tuple[str, Any]]] = {r: [] for r in s.trainers}
    for name in sorted(s.plan.sources):
        for box, ranks in replica_sets(s.plan.sources[name]):
            out[ranks[0]].append((name, box))
    return out


def _nbytes(s: WeightTransfer, items: list[tuple[str, Any]]) -> int:
    return sum(box_numel(b) * dtype_size(s.plan.sources[n].dtype) for n, b in items)


async def run(s: WeightTransfer, version: int) -> tuple[int, int]:
    """This rank's part of a rank-0 update; ``(bytes sent, bytes received)``."""
    import torch
    import torch.distributed as dist

    plan = s.plan
    t0, i0 = plan.trainers[0], plan.inference[0]
    sent = received = 0
    if s.sender is not None:
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
        sent += off if s.rank != t0 else 0
        if s.rank == t0:
            assert gathered is not None
            full: dict[str, Any] = {}
            for k, r in enumerate(s.trainers):
                o = 0
                for name, box in prim[r]:
                    src = plan.sources[name]
                    t = full.get(name)
                    if t is None:
                        t = full[name] = torch.empty(src.shape, dtype=torch_dtype(src.dtype))
                    n = box_numel(box) * dtype_size(src.dtype)
                    shape = tuple(b - a for a, b in box)
                    piece = gathered[k][o : o + n].view(torch_dtype(src.dtype)).view(shape)
                    t[tuple(slice(a, b) for a, b in box)] = piece
                    o += n
            received += sum(_nbytes(s, prim[r]) for r in s.trainers if r != t0)
            del gathered
            dev = s.sender.device
            unique = torch.empty(plan.unique_bytes(), dtype=torch.uint8)
            o = 0
            for task in plan.tasks:
                src_t = full[task.param]
                if dev is not None and src_t.device != dev:
                    full[task.param] = src_t = src_t.to(dev)
                unique[o : o + task.nbytes].copy_(materialize(task, src_t))
                o += task.nbytes
            del full
            await s._control(lambda: dist.send(unique, dst=i0, group=s.ctrl), "rank-0 send")
            sent += unique.numel()
        return sent, received
    assert s.receiver is not None
    width = max(plan.dst_sizes)
    out = torch.empty(width, dtype=torch.uint8)
    parts = None
    if s.rank == i0:
        unique = torch.empty(plan.unique_bytes(), dtype=torch.uint8)
        await s._control(lambda: dist.recv(unique, src=t0, group=s.ctrl), "rank-0 recv")
        received += unique.numel()
        parts = [torch.zeros(width, dtype=torch.uint8) for _ in plan.inference]
        o = 0
        for task in plan.tasks:
            apply_writes(plan, task, unique[o : o + task.nbytes], parts)
            o += task.nbytes
        sent += sum(plan.dst_sizes[1:])
    await s._control(
        lambda: dist.scatter(out, parts, src=i0, group=s.inference_group), "rank-0 scatter"
    )
    if s.rank != i0:
        received += plan.dst_sizes[plan.inference.index(s.rank)]
    hdr = plan.header_bytes
    size = s.receiver.layout.nbytes
    s.receiver.buffer[hdr:size].copy_(out[hdr:size])
    s.receiver.set_version(version)
    return sent, received
