"""An adaptive target stays awake while plain writes (no immediate, no event of their own at
the target) keep arriving: its worker must progress each one (libfabric 1.17 tcp and shm
complete a write once the target has taken it), and a nap between them made every write wait
for the target's wake-up (tcp: awaited 8 B p50 59.9 -> 21.2 µs on the 2-core machine once the
target stayed awake). shm counts remote writes (FI_RMA_EVENT); 1.17 tcp;ofi_rxm counts none,
so there the provider reports its wait object drained by a progress call
(AFP_ACTIVITY_ARRIVED)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from afabric import Engine

WRITES = 400


@pytest.mark.parametrize("provider", ["tcp", "shm"])
async def test_a_target_does_not_nap_between_arriving_writes(provider: str) -> None:
    """The target's spin window (20 ms) is far longer than the gap between two writes here, so
    a target that sees them arrive never naps during the run; one that does not naps before
    nearly every write (its window passed since its last event: the warm-up)."""
    async with Engine(provider, spin_us=20_000) as target, Engine(provider) as writer:
        dst = np.zeros(4096, np.uint8)
        desc = target.register(dst).descriptor
        src = writer.register(np.zeros(4096, np.uint8))
        await writer.write(src, desc, 8)  # resolves the peer, imports the descriptor
        await asyncio.sleep(0.2)  # the target's window passes: it naps
        before = target.stats()["worker_naps"]
        for i in range(1, WRITES + 1):
            src.buffer[:8] = i % 256
            await writer.write(src, desc, 8)
        assert (dst[:8] == WRITES % 256).all()
        naps = target.stats()["worker_naps"] - before
    # the nap the run found in progress ends (+1), a scheduling gap of 20 ms may add one
    assert naps <= 5, f"the target napped {naps} times during {WRITES} writes"


async def test_a_tcp_target_stays_awake_with_the_default_window() -> None:
    """tcp's look at the wait object sees about 60% of the arrivals (those that came before
    the look, not while the progress call that took them ran), so one spin_us after a seen
    one let two unseen in a row put the target to sleep: 232-963 naps per 2,000 writes on
    the 2-core machine, 0-6 with ARRIVAL_SPINS (shim/worker.c)."""
    async with Engine("tcp") as target, Engine("tcp") as writer:
        desc = target.register(np.zeros(4096, np.uint8)).descriptor
        src = writer.register(np.zeros(4096, np.uint8))
        for _ in range(100):
            await writer.write(src, desc, 8)
        before = target.stats()["worker_naps"]
        for _ in range(2000):
            await writer.write(src, desc, 8)
        naps = target.stats()["worker_naps"] - before
    assert naps <= 100, f"the target napped {naps} times during 2,000 writes"
