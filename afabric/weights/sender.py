"""A training rank's part of an update: a pipeline over its tasks.

Per task: take a staging slice (waiting while the staging buffer is full: the watermark),
then on the preparation thread cut the slice from the local shard (or from the unsharded
parameter), copy it to the compute device if it lives elsewhere, fuse/cast or quantise it
to fp8 with tile scales, and copy it into the staging slice; then, on the loop, post its
writes (one scatter per destination rank, each write carrying that rank's immediate) and
give the slice back when they complete. Preparing the
next task overlaps the writes of the previous ones. Parameter groups (one mesh and
placement each) run one after another; every rank of a group's mesh unshards that group's
unshard parameters in plan order (``full_tensor()`` is a collective), dropping each as soon
as its slices are staged.
"""

from __future__ import annotations

import asyncio
import functools
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..descriptor import MrDesc
from ..errors import InvalidArgument
from ..groups import ScatterTarget
from .arena import Arena
from .meta import Box, LocalShard, full_box
from .plan import Group, Plan, Task
from .prepare import convert, slice_of, stage_into
from .progress import UpdateProgress
from .worker import Worker

if TYPE_CHECKING:
    from ..engine import Engine


class Sender:
    """One training rank's tasks of the plan, its staging buffer and its preparation thread."""

    def __init__(
        self,
        engine: Engine,
        plan: Plan,
        rank: int,
        params: Mapping[str, Any],
        *,
        descs: Sequence[bytes],
        addresses: Sequence[bytes],
        imms: Sequence[int],
        staging_bytes: int,
        device: str | None,
    ) -> None:
        import torch

        self.engine = engine
        self.plan = plan
        self.rank = rank
        self.slot = plan.trainer_slot(rank)
        self.params = dict(params)
        self.tasks = plan.tasks_of(rank)
        self.by_group: dict[int, dict[str, list[Task]]] = defaultdict(lambda: defaultdict(list))
        for t in self.tasks:
            self.by_group[t.group][t.param].append(t)
        for t in self.tasks:
            if t.param not in self.params:
                raise InvalidArgument(f"rank {rank}: the plan has it send {t.param}, which it does not hold")
        self.device = torch.device(device) if device is not None else None
        self.descs = [MrDesc.from_bytes(d) for d in descs]
        self.imms = list(imms)
        self.group = engine.peer_group(list(addresses))
        need = max((t.nbytes for t in self.tasks), default=0)
        size = max(int(staging_bytes), need, 4096)
        pin = self.device is not None and self.device.type == "cuda"
        self.staging = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        self.mr = engine.register(self.staging, remote=False)
        self.arena = Arena(size)
        self.words = np.zeros(2, dtype=np.int64)
        self.words_mr = engine.register(self.words, remote=False)
        self._prep = Worker(f"afabric-weights-prep-{rank}")
        # each task's writes by destination rank: (src offset, dst offset, length)
        self.targets: dict[int, dict[int, list[tuple[int, int, int]]]] = {}
        for t in self.tasks:
            by_dst: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
            for _ti, dst, s, d, n in plan.writes_of(t).tolist():
                if n > engine.max_write_size:
                    raise InvalidArgument(
                        f"{t.param}: a {n}-byte write exceeds the provider's {engine.max_write_size}; "
                        "plan with a smaller max_task_bytes"
                    )
                by_dst[dst].append((s, d, n))
            self.targets[t.index] = dict(by_dst)

    def close(self) -> None:
        self._prep.close()
        for mr in (self.mr, self.words_mr):
            if mr.registered and not self.engine.closed:
                self.engine.deregister(mr)

    async def _words(self, version: int, which: int) -> None:
        """Write this rank's begin (0) or done (1) word to every inference rank."""
        self.words[:] = version
        await asyncio.gather(*(
            self.engine.write(self.words_mr, d, 8, 8 * which, 16 * self.slot + 8 * which, imm=imm)
            for d, imm in zip(self.descs, self.imms, strict=True)
        ))  # fmt: skip

    async def run(self, version: int, prog: UpdateProgress) -> None:
        await self._words(version, 0)
        pending: list[asyncio.Task[None]] = []
        try:
            for gi, g in enumerate(self.plan.groups):
                await self._run_group(gi, g, prog, pending)
        finally:
            results = await asyncio.gather(*pending, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        await self._words(version, 1)

    def local(self, name: str) -> tuple[Any, Box]:
        from torch.distributed.tensor import DTensor

        t = self.params[name]
        if isinstance(t, LocalShard):
            t = t.tensor
        local = t.to_local() if isinstance(t, DTensor) else t
        return local, self.plan.sources[name].box_of(self.rank)

    def _unshard(self, name: str) -> Any:
        from torch.distributed.tensor import DTensor

        t = self.params.get(name)
        if not isinstance(t, DTensor):
            raise InvalidArgument(
                f"{name}: the plan unshards it, but rank {self.rank} holds no DTensor of it"
            )
        return t.full_tensor()

    def _stage(self, task: Task, region: Any, region_box: Box, off: int) -> None:
        import torch

        piece = slice_of(task, region, region_box)
        if self.device is not None and piece.device != self.device:
            piece = piece.to(self.device)
        stage_into(task, convert(task, piece), self.staging[off : off + task.nbytes])
        if piece.device.type == "cuda":
            torch.cuda.synchronize(piece.device)

    async def _post(self, task: Task, off: int, n: int, prog: UpdateProgress) -> None:
        by_dst = self.targets[task.index]
        try:
            await asyncio.gather(*(
                self.engine.scatter(
                    self.mr, [ScatterTarget(self.descs[d], ln, off + s, do) for s, do, ln in rows],
                    group=self.group, imm=self.imms[d],
                )
                for d, rows in by_dst.items()
            ))  # fmt: skip
        finally:
            await self.arena.free(off, n)
        prog.add(sum(r[2] for rows in by_dst.values() for r in rows))

    async def _run_group(
        self, gi: int, g: Group, prog: UpdateProgress, pending: list[asyncio.Task[None]]
    ) -> None:
        """Prepare and post this rank's tasks of one group; writes stay in flight (in
        ``pending``) while the next group is prepared, but collectives keep plan order."""
        mine = self.by_group.get(gi, {})
        in_mesh = self.rank in g.mesh_ranks
        unshard = set(g.unshard) if in_mesh else set()
        for name in sorted(unshard | set(mine)):
            full = None
            if name in unshard:
                full = await self._prep.call(functools.partial(self._unshard, name))
            for task in mine.get(name, []):
                for p in pending:
                    if p.done() and (exc := p.exception()) is not None:
                        raise exc
                off, n = await self.arena.alloc(task.nbytes)
                if task.unshard:
                    assert full is not None
                    region, rbox = full, full_box(tuple(int(x) for x in full.shape))
                else:
                    region, rbox = self.local(name)
                try:
                    await self._prep.call(functools.partial(self._stage, task, region, rbox, off))
                except BaseException:
                    await self.arena.free(off, n)
                    raise
                pending.append(asyncio.ensure_future(self._post(task, off, n, prog)))
            del full
