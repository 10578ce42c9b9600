"""Watchers and triggered operations (CPU writers here; tests/gpu has the CUDA kernel)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

import afabric
from afabric import errors

from .procs import Ctl, Peer


async def test_watcher_reports_every_paced_change(provider: str) -> None:
    async with afabric.Engine(provider) as eng:
        w = eng.uvm_watcher()
        assert w.device_ptr == 0 and w.host_ptr and w.value == 0
        n = 50
        observed = threading.Semaphore(0)

        def writer() -> None:  # another thread, like a GPU kernel: no Python loop involved
            for _ in range(n):
                time.sleep(0.001)
                w.add(1)
                # paced by the reader, so a loaded machine cannot merge two bumps into one
                # observation (tests/gpu does the unpaced version with a real kernel)
                assert observed.acquire(timeout=30)

        t = threading.Thread(target=writer)
        t.start()
        seen: list[tuple[int, int]] = []
        async for old, new in w:
            seen.append((old, new))
            observed.release()
            if new == n:
                break
        t.join()
        assert seen == [(k, k + 1) for k in range(n)]
        assert await asyncio.wait_for(w.wait_for(n), 5) == n
        w.close()
        with pytest.raises(errors.EngineClosed):
            w.add(1)


async def test_fast_writer_never_breaks_the_chain(provider: str) -> None:
    """Changes faster than the watcher looks are coalesced, never lost: old/new chain up."""
    async with afabric.Engine(provider) as eng:
        w = eng.uvm_watcher()

        def writer() -> None:
            for _ in range(20000):
                w.add(1)

        t = threading.Thread(target=writer)
        t.start()
        last = 0
        async for old, new in w:
            assert old == last and new > old
            last = new
            if new == 20000:
                break
        t.join()


async def triggered_target(ctl: Ctl, provider: str, layers: int, page: int) -> bool:
    async with afabric.Engine(provider) as eng:
        buf = np.zeros(layers * page, dtype=np.uint8)
        mr = eng.register(buf)
        ctl.put(bytes(mr.descriptor))
        for layer in range(layers):
            await eng.expect_imm(100 + layer, 1, timeout=60)
            # layer k's bytes are there; later layers' are not yet (they wait for the watcher)
            assert (buf[layer * page : (layer + 1) * page] == layer + 1).all()
            ctl.put(layer)
        return True


async def test_triggered_writes_fire_in_order_of_the_watcher(provider: str, peers: list[Peer]) -> None:
    """Layer-by-layer: all writes are armed up front; each leaves when the watcher reaches
    its layer, and not before."""
    layers, page = 8, 64 * 1024
    p = Peer(triggered_target, provider, layers, page)
    peers.append(p)
    desc = afabric.MrDesc.from_bytes(await p.get())
    async with afabric.Engine(provider) as eng:
        src = np.repeat(np.arange(1, layers + 1, dtype=np.uint8), page)
        mr = eng.register(src)
        w = eng.uvm_watcher()
        writes = [
            asyncio.ensure_future(
                eng.write(
                    mr,
                    desc,
                    page,
                    src_offset=k * page,
                    dst_offset=k * page,
                    imm=100 + k,
                    when=w.reaches(k + 1),
                )
            )
            for k in range(layers)
        ]
        await asyncio.sleep(0.1)
        assert not any(t.done() for t in writes), "a triggered write left before its layer"
        for k in range(layers):
            w.add(1)
            assert await p.get() == k
            await asyncio.wait_for(writes[k], 10)
            assert not any(t.done() for t in writes[k + 1 :])
        assert await p.result()


async def test_imm_count_trigger_and_disarm(provider: str) -> None:
    async with afabric.Engine(provider) as a, afabric.Engine(provider) as b:
        dst = np.zeros(4096, dtype=np.uint8)
        rmr = b.register(dst)
        amr = a.register(np.zeros(64, dtype=np.uint8))
        src = a.register(np.full(4096, 9, dtype=np.uint8))
        bsrc = b.register(np.zeros(8, dtype=np.uint8))
        # a's write fires after 3 arrivals of immediate 40 at a (one came early)
        await b.write(bsrc, amr.descriptor, 0, imm=40)
        fired = asyncio.ensure_future(
            a.write(src, rmr.descriptor, 4096, imm=41, when=afabric.imm_count(40, 3))
        )
        await asyncio.sleep(0.1)
        assert not fired.done()
        for _ in range(2):
            await b.write(bsrc, amr.descriptor, 0, imm=40)
        await asyncio.wait_for(fired, 10)
        await b.expect_imm(41, 1, timeout=10)
        assert (dst == 9).all()
        # the three arrivals were consumed by the trigger
        with pytest.raises(errors.OperationTimeout):
            await a.expect_imm(40, 1, timeout=0.3)
        # disarming: a cancelled trigger never fires, even when its condition comes later
        w = a.uvm_watcher()
        dst[:] = 0
        armed = asyncio.ensure_future(a.write(src, rmr.descriptor, 4096, imm=42, when=w.reaches(1)))
        await asyncio.sleep(0.05)
        armed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await armed
        w.add(5)
        await asyncio.wait_for(w.wait_for(5), 5)
        with pytest.raises(errors.OperationTimeout):
            await b.expect_imm(42, 1, timeout=0.3)
        assert not dst.any()
        # bad triggers are refused before anything is armed
        with pytest.raises(errors.InvalidArgument):
            await a.write(src, rmr.descriptor, 8, when="soon")  # type: ignore[arg-type]
        with pytest.raises(errors.ImmediateOutOfRange):
            afabric.imm_count(-1, 1)
        w.close()
        with pytest.raises(errors.EngineClosed):
            w.reaches(1)


async def test_watchers_die_with_their_engine(provider: str) -> None:
    eng = afabric.Engine(provider)
    w = eng.uvm_watcher()
    pending = asyncio.ensure_future(w.wait_for(1))
    await asyncio.sleep(0.01)
    await eng.aclose()
    with pytest.raises(errors.EngineClosed):
        await asyncio.wait_for(pending, 5)
    with pytest.raises(errors.EngineClosed):
        eng.uvm_watcher()


async def test_stamped_store_is_clocked_before_it_lands(provider: str) -> None:
    """`bench trigger`'s bump (afs_watcher_store): the word takes the value, the watcher
    reports the change, and the stamp is the clock read between the call and the store."""
    async with afabric.Engine(provider) as eng:
        w = eng.uvm_watcher()
        before = time.monotonic_ns()
        stamp = eng._n.watcher_store(w.id, 7)
        after = time.monotonic_ns()
        assert before <= stamp <= after
        assert w.value == 7
        assert await asyncio.wait_for(w.wait_for(7), 5) == 7
        for bad in (-1, 1 << 64, 2.0, True):
            with pytest.raises(errors.InvalidArgument):
                eng._n.watcher_store(w.id, bad)  # type: ignore[arg-type]
        assert w.value == 7
        w.close()
        with pytest.raises(errors.StaleRegion):
            eng._n.watcher_store(w.id, 8)
