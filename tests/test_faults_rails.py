"""A rail that slows to a crawl under a two-rail NIC group (two network namespaces joined by
two veth pairs, tests/netns.py; rail 1 shaped with tc): writes sharded over both rails fail
with OperationTimeout within the engine's bound instead of hanging, and once the rail is
fast again the same engine writes over both rails and every byte is right."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Iterator

import numpy as np
import pytest

import afabric
from afabric import errors

from . import netns
from .faults import Held, held, pattern
from .netns import TwoRails
from .procs import Ctl, Peer

MiB = 1 << 20
OP_TIMEOUT = 2.0
SLACK = 15.0


@pytest.fixture
def rails() -> Iterator[TwoRails]:
    netns.require()
    with TwoRails() as tb:
        yield tb


async def rails_target(ctl: Ctl, nics: list[str], nbytes: int) -> bool:
    """Publishes a region; on "check" says how many bytes are neither 0 nor pattern seed 7;
    on "expect" waits for one arrival of its immediate and checks every byte."""
    async with afabric.Engine("tcp", nics=nics) as eng:
        buf = np.zeros(nbytes, dtype=np.uint8)
        mr = eng.register(buf)
        imm = eng.alloc_imm()
        ctl.put((bytes(mr.descriptor), imm))
        want = pattern(nbytes, 7)
        while (cmd := await ctl.get(timeout=120)) != "stop":
            if cmd == "check":
                ctl.put(int(np.count_nonzero((buf != 0) & (buf != want))))
            elif cmd == "expect":
                await eng.expect_imm(imm, 1, timeout=60)
                ctl.put(bool(np.array_equal(buf, want)))
        return True


async def rails_initiator(
    ctl: Ctl, nics: list[str], desc_b: bytes, imm: int, nbytes: int
) -> tuple[str, float, Held, Held]:
    """One write sharded over both rails while rail 1 crawls (must time out), then, told the
    rail is fast again, the whole region with the immediate. Returns the first write's
    error class, how long it took to fail, and what this process held before the engine
    and after closing it."""
    async with afabric.Engine("tcp", nics=nics):
        pass  # what libfabric keeps for the process is in the baseline
    before = held()
    async with afabric.Engine("tcp", nics=nics, op_timeout=OP_TIMEOUT) as eng:
        src = eng.register(pattern(nbytes, 7).copy())
        desc = afabric.MrDesc.from_bytes(desc_b)
        assert eng.nics == 2
        ctl.put("ready")
        assert await ctl.get() == "write"
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(eng.write(src, desc, nbytes), OP_TIMEOUT + SLACK)
            outcome = "completed"
        except errors.AfabricError as e:
            outcome = type(e).__name__
        failed_after = time.monotonic() - t0
        ctl.put("failed")
        assert await ctl.get() == "again"
        # The rail is fast again, but TCP may still be backing off from the drops of the crawl
        # (its retransmission timer doubles: 1.5 s measured here, more on a loaded machine, which
        # is close to op_timeout). Once the provider has let go of the timed-out write, its
        # bytes went through and the connection is moving again: only then is "the same engine
        # writes at full speed" the question.
        t1 = time.monotonic()
        while eng.stats()["buffers_held"]:
            assert time.monotonic() - t1 < 60, "the timed-out write was never let go"
            await asyncio.sleep(0.05)
        await eng.write(src, desc, nbytes, imm=imm)
    del src  # the 8 MiB source buffer is the test's, not a leak...
    gc.collect()  # ...nor is the failed write's traceback cycle, which still refers to it
    return outcome, failed_after, before, held()


async def test_crawling_rail_times_out_then_recovers(rails: TwoRails, peers: list[Peer]) -> None:
    nbytes = 8 * MiB  # 4 MiB per rail: ~34 s at 1 Mbit/s, far past the 2 s bound
    target = rails.peer("b", rails_target, ["r0b", "r1b"], nbytes)
    peers.append(target)
    desc_b, imm = await target.get(timeout=60)
    initiator = rails.peer("a", rails_initiator, ["r0a", "r1a"], desc_b, imm, nbytes)
    peers.append(initiator)
    assert await initiator.get(timeout=60) == "ready"
    shaping = rails.slow_rail(1, delay_ms=50, rate="1mbit")
    initiator.put("write")
    assert await initiator.get(timeout=OP_TIMEOUT + SLACK + 10) == "failed"
    rails.fast_rail(1)
    target.put("check")
    assert await target.get() == 0, "bytes other than the written ones landed"
    initiator.put("again")
    target.put("expect")
    assert await target.get(timeout=60) is True, "the write after recovery left wrong bytes"
    outcome, failed_after, before, after = await initiator.result(timeout=60)
    print(f"\nrail 1 shaped with `{shaping}`: the sharded write -> {outcome} after {failed_after:.1f} s")
    print(f"initiator: start: {before}\ninitiator: end:   {after}")
    assert outcome == "OperationTimeout"
    assert failed_after < OP_TIMEOUT + SLACK
    assert after.native_threads <= before.native_threads and after.fds <= before.fds
    assert after.heap_mib - before.heap_mib < 8
    target.put("stop")
    assert await target.result() is True
