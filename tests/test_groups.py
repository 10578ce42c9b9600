"""Scatter and barrier across several processes, with peer groups: each target verifies its
own bytes and counts its immediates."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import afabric
from afabric import errors

from .procs import Ctl, Peer

NPEERS = 4
SLICE = 256 * 1024


def source() -> np.ndarray:
    return np.random.default_rng(11).integers(0, 256, NPEERS * SLICE, dtype=np.uint8)


async def scatter_member(ctl: Ctl, provider: str, rank: int) -> bool:
    """Receives its slice of one scatter, then joins a barrier among all members."""
    async with afabric.Engine(provider) as eng:
        buf = np.zeros(2 * SLICE, dtype=np.uint8)
        mr = eng.register(buf)
        ctl.put((bytes(mr.descriptor), bytes(eng.address)))
        imm, others = await ctl.get()
        # the scatter lands at offset SLICE of every member, with one arrival each
        await eng.expect_imm(imm, 1, timeout=60)
        want = source()[rank * SLICE : (rank + 1) * SLICE]
        assert np.array_equal(buf[SLICE:], want), f"rank {rank}: wrong bytes"
        assert not buf[:SLICE].any(), f"rank {rank}: bytes outside the target range"
        # barrier: everyone writes an immediate to everyone else, then waits for n-1
        descs = [afabric.MrDesc.from_bytes(d) for d in others]
        group = eng.peer_group([afabric.Address.from_bytes(a) for a in (await ctl.get())])
        await eng.barrier(descs, imm + 1, group=group)
        await eng.expect_imm(imm + 1, len(descs), timeout=60)
        return True


async def test_scatter_and_barrier_across_processes(provider: str, peers: list[Peer]) -> None:
    members = [Peer(scatter_member, provider, r) for r in range(NPEERS)]
    peers += members
    info = [await p.get() for p in members]
    descs = [afabric.MrDesc.from_bytes(d) for d, _ in info]
    addrs = [afabric.Address.from_bytes(a) for _, a in info]
    imm = 1000
    for r, p in enumerate(members):
        p.put((imm, [bytes(d) for i, d in enumerate(descs) if i != r]))
    async with afabric.Engine(provider) as eng:
        group = eng.peer_group(addrs)
        assert len(group) == NPEERS and descs[0] in group
        src = source()
        mr = eng.register(src)
        targets = [
            afabric.ScatterTarget(d, SLICE, src_offset=r * SLICE, dst_offset=SLICE)
            for r, d in enumerate(descs)
        ]
        await eng.scatter(mr, targets, group=group, imm=imm)
        for r, p in enumerate(members):
            p.put([bytes(a) for i, a in enumerate(addrs) if i != r])
        assert all([await p.result() for p in members])


async def test_scatter_checks_every_target_before_posting(provider: str) -> None:
    async with afabric.Engine(provider) as a, afabric.Engine(provider) as b, afabric.Engine(provider) as c:
        db, dc = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
        mb, mc = b.register(db), c.register(dc)
        mr = a.register(np.ones(8192, np.uint8))
        group = a.peer_group([b.address])
        ok = afabric.ScatterTarget(mb.descriptor, 1024)
        # one bad target anywhere fails the whole call, and nothing is posted to anyone
        for bad in (
            afabric.ScatterTarget(mc.descriptor, 4097),
            afabric.ScatterTarget(mc.descriptor, 1024, src_offset=8000),
            afabric.ScatterTarget(mc.descriptor, 1024, dst_offset=-1),
        ):
            with pytest.raises((errors.OutOfRange, errors.InvalidArgument)):
                await a.scatter(mr, [ok, bad], imm=5)
        with pytest.raises(errors.InvalidArgument):
            await a.scatter(mr, [ok, afabric.ScatterTarget(mc.descriptor, 8)], group=group, imm=5)
        with pytest.raises(errors.InvalidArgument):
            await a.scatter(mr, [(mb.descriptor, 8)], imm=5)  # type: ignore[list-item]
        with pytest.raises(errors.ImmediateOutOfRange):
            await a.barrier([mb.descriptor], -1)
        for eng in (b, c):
            with pytest.raises(errors.OperationTimeout):
                await eng.expect_imm(5, 1, timeout=0.3)
        assert not db.any() and not dc.any()
        # an empty scatter completes at once
        await asyncio.wait_for(a.scatter(mr, [], imm=5), 5)
