"""Memory and bookkeeping safety of the shim and the libfabric provider, between real
processes: arrivals never lost to a cancelled expectation, deadlines that
measure progress, no byte landing after deregister() returned, no crash writing to a
closed engine, and no lost notification reported as a success."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import numpy as np
import pytest

import afabric
from afabric import errors

from .conftest import WITH_CMA
from .procs import Ctl, Peer

# ---- expect_imm cancelled while arrivals stream in (item 12) ----

ARRIVALS = 20_000


async def imm_streamer(ctl: Ctl, provider: str, blob: bytes, imm: int, total: int) -> int:
    """Writes `total` 8-byte writes with immediate `imm`, many in flight at once."""
    desc = afabric.MrDesc.from_bytes(blob)
    async with afabric.Engine(provider) as eng:
        src = eng.register(np.ones(8, dtype=np.uint8), remote=False)
        sent = 0
        while sent < total:
            batch = min(250, total - sent)
            await asyncio.gather(*(eng.write(src, desc, 8, imm=imm) for _ in range(batch)))
            sent += batch
        return sent


async def test_cancelled_expectations_never_lose_arrivals(provider: str, peers: list[Peer]) -> None:
    """A tight cancel/re-expect loop on one immediate while 20,000 arrivals stream in: an
    expectation withdrawn just as it completed gives back what it consumed, so what the
    completed expectations counted plus what is left adds up to every arrival, exactly."""
    async with afabric.Engine(provider) as eng:
        buf = np.zeros(8, dtype=np.uint8)
        mr = eng.register(buf)
        imm = eng.alloc_imm()
        writer = Peer(imm_streamer, provider, bytes(mr.descriptor), imm, ARRIVALS)
        peers.append(writer)
        done = asyncio.ensure_future(writer.result(timeout=100))
        counted = cancels = 0
        rng = np.random.default_rng(12)
        # How long an expectation lives before the cancel adapts to the machine's pace (a
        # loaded machine needs more loop turns for a completion to come back), so that both
        # outcomes keep happening; after the writer is done the loop goes on over the
        # arrivals already counted until each outcome was seen often enough.
        turns = 5
        deadline = asyncio.get_running_loop().time() + 60
        while not done.done() or (
            min(counted, cancels) <= 100
            and ARRIVALS - counted > 200
            and asyncio.get_running_loop().time() < deadline
        ):
            t = asyncio.ensure_future(eng.expect_imm(imm, 1))
            for _ in range(int(rng.integers(1, turns + 1))):  # cancel at every stage of its life
                await asyncio.sleep(0)
            if not t.done():
                t.cancel()
                cancels += 1
                turns = min(turns + 1, 500)
            else:
                turns = max(turns - 1, 1)
            with contextlib.suppress(asyncio.CancelledError):
                await t
                counted += 1
        assert await done == ARRIVALS
        left = ARRIVALS - counted
        print(f"\n{provider}: {counted} counted in the loop, {cancels} cancels, {left} left")
        assert cancels > 100 and counted > 100, "the loop never raced a cancel against arrivals"
        if left:
            await eng.expect_imm(imm, left, timeout=20)
        with pytest.raises(errors.OperationTimeout):
            await eng.expect_imm(imm, 1, timeout=0.5)


# ---- op_timeout bounds the time without progress, not the whole operation (item 11) ----

PAGES = 400_000
PAGE = 16


async def page_sink(ctl: Ctl, provider: str) -> int:
    """Registers PAGES pages and answers how many carry the writer's bytes."""
    async with afabric.Engine(provider) as eng:
        buf = np.zeros(PAGES * PAGE, dtype=np.uint8)
        mr = eng.register(buf)
        ctl.put(bytes(mr.descriptor))
        assert await ctl.get(timeout=100) == "count"
        return int(np.count_nonzero(buf.reshape(PAGES, PAGE).all(axis=1)))


async def test_a_slow_but_progressing_paged_write_does_not_time_out(provider: str, peers: list[Peer]) -> None:
    """A paged write that lasts longer than op_timeout in all, but completes pages all
    along, must succeed with every page delivered (it failed with OperationTimeout after
    op_timeout while deadlines ran from the start). How long a write of this size takes
    depends on the machine (0.36 s on shm once the writer stopped napping), so the target is
    made to stall on purpose: SIGSTOPped for STALL s at a time (less than op_timeout), let
    run for RUN s in between, as long as the write lasts (at most STOPS times)."""
    stall, run, max_stops, op_timeout = 0.5, 0.05, 8, 2.0
    target = Peer(page_sink, provider)
    peers.append(target)
    desc = afabric.MrDesc.from_bytes(await target.get())
    pid = target.proc.pid
    assert pid is not None
    stops = 0
    writing = True

    async def stall_target() -> None:
        nonlocal stops
        try:
            while writing and stops < max_stops:
                os.kill(pid, signal.SIGSTOP)
                await asyncio.sleep(stall)
                os.kill(pid, signal.SIGCONT)
                if writing:
                    stops += 1  # a whole stall while the write was in flight
                await asyncio.sleep(run)
        finally:
            os.kill(pid, signal.SIGCONT)

    async with afabric.Engine(provider, op_timeout=op_timeout) as eng:
        src = eng.register(np.full(PAGES * PAGE, 7, dtype=np.uint8), remote=False)
        idx = np.arange(PAGES, dtype=np.int64)
        dst = np.random.default_rng(16).permutation(PAGES)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        pages = {"src_pages": afabric.Pages(idx, PAGE), "dst_pages": afabric.Pages(dst, PAGE)}
        write = asyncio.ensure_future(eng.write_paged(src, desc, page_len=PAGE, **pages))
        await asyncio.sleep(0.02)  # under way: the first pages are out
        staller = asyncio.ensure_future(stall_target())
        try:
            await write
        finally:
            writing = False
            await staller
        took = loop.time() - t0
    print(f"\n{provider}: {PAGES} pages in {took:.2f} s, {stops} stalls of {stall} s")
    assert stops >= 4, "the write ended before the target was stalled often enough: make it larger"
    assert took > op_timeout
    target.put("count")
    assert await target.result(timeout=100) == PAGES


# ---- no byte lands after deregister() returned (item 3) ----

MiB = 1 << 20
BIG = 8 * MiB
ROUNDS = 4


async def big_streamer(ctl: Ctl, provider: str) -> list[int]:
    """Per round: a fresh engine streams 8 MiB writes (two in flight; cma: with 16 writes of
    64 KiB, and every other round those alone) to the descriptor it is given, errors and
    all, until told "next"; returns how many succeeded per round."""
    ok_per_round: list[int] = []
    while (msg := await ctl.get(timeout=100)) != "stop":
        desc = afabric.MrDesc.from_bytes(msg)
        eng = afabric.Engine(provider, op_timeout=2.0)
        try:
            src = eng.register(np.full(BIG, 0xAB, dtype=np.uint8), remote=False)
            nxt = asyncio.ensure_future(ctl.get(timeout=100))
            ok = 0
            # cma: 16 writes of 64 KiB (the last ends the region) go first, run whole on the
            # copy threads; every other round they stream alone
            small = [(k + 1) * (BIG // 16) - 64 * 1024 for k in range(16)]
            small = small if provider == "cma" else []
            big = 0 if small and len(ok_per_round) % 2 else 2
            while not nxt.done():
                res = await asyncio.gather(
                    *(eng.write(src, desc, 64 * 1024, 0, o) for o in small),
                    *(eng.write(src, desc, BIG) for _ in range(big)),
                    return_exceptions=True,
                )
                ok += sum(r is None for r in res)
                if not all(r is None for r in res):
                    await asyncio.sleep(0.01)
            assert nxt.result() == "next"
            ok_per_round.append(ok)
        finally:
            eng.close()
    return ok_per_round


@pytest.mark.parametrize("provider", WITH_CMA)
async def test_no_byte_lands_after_deregister_returns(
    provider: str, peers: list[Peer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer streams 8 MiB writes into a region; the target deregisters it mid-stream,
    paints a canary over it at once, keeps progressing for 200 ms and finds the canary
    intact: deregister() returned only once nothing more could land. Several rounds.
    cma's writer splits each write over 3 copiers, its threads' parts held back 20 ms by a
    testing hook: deregister must wait for those parts too (the writer slot covers them);
    its 64 KiB writes run whole on the copy threads, each holding its own writer slot
    across the 20 ms hold and the copy: deregister must wait for those too (in rounds 1
    and 3 they stream alone, so deregister meets them mid-hold)."""
    if provider == "cma":
        monkeypatch.setenv("AFABRIC_CMA_THREADS", "3")
        monkeypatch.setenv("AFABRIC_CMA_TEST_PART_DELAY_US", "20000")
    writer = Peer(big_streamer, provider)
    peers.append(writer)
    rng = np.random.default_rng(3)
    async with afabric.Engine(provider) as eng:
        for rnd in range(ROUNDS):
            buf = np.zeros(BIG, dtype=np.uint8)
            mr = eng.register(buf)
            writer.put(bytes(mr.descriptor))
            loop = asyncio.get_running_loop()
            until = loop.time() + 30
            while buf[-1] != 0xAB:  # a whole write landed: the stream is flowing
                assert loop.time() < until, "no write landed"
                await asyncio.sleep(0.001)
            await asyncio.sleep(float(rng.uniform(0, 0.01)))  # somewhere inside a write
            t0 = loop.time()
            eng.deregister(mr)
            took = loop.time() - t0
            # painted from the end backwards, so that a copy still running front to back
            # (cma: the writer's process_vm_writev) meets the paint and shows
            for k in range(BIG // MiB - 1, -1, -1):
                buf[k * MiB : (k + 1) * MiB] = 0x5A
            await asyncio.sleep(0.2)  # the worker keeps progressing meanwhile
            changed = int(np.count_nonzero(buf != 0x5A))
            print(
                f"\n{provider} round {rnd}: deregister took {took * 1e3:.1f} ms, "
                f"{changed} bytes changed after it"
            )
            assert changed == 0, f"{changed} bytes landed after deregister() returned"
            writer.put("next")
        writer.put("stop")
        print(f"writes that succeeded per round: {await writer.result(timeout=100)}")


# ---- writing to a closed engine fails, never crashes (item 4) ----


async def test_writing_to_a_closed_engine_of_this_process_fails_at_once(provider: str) -> None:
    """Two engines of one process that wrote to each other; one closes. Writes and sends
    to it fail with PeerUnreachable before anything is posted (shm used to segfault in
    libfabric on the worker thread), so does a third engine resolving it, and the survivor
    still works and closes cleanly (no /dev/shm file left: the autouse fixture checks)."""
    a = afabric.Engine(provider, op_timeout=5.0)
    b = afabric.Engine(provider, op_timeout=5.0)
    try:
        abuf, bbuf = np.zeros(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
        amr, bmr = a.register(abuf), b.register(bbuf)
        await a.write(amr, bmr.descriptor, 4096)
        await b.write(bmr, amr.descriptor, 4096)
        b_addr, b_desc = b.address, bmr.descriptor
        await b.aclose()
        loop = asyncio.get_running_loop()
        for _ in range(3):
            t0 = loop.time()
            with pytest.raises(errors.PeerUnreachable, match="closed"):
                await a.write(amr, b_desc, 4096)
            with pytest.raises(errors.PeerUnreachable, match="closed"):
                await a.send(b_addr, b"hello")
            assert loop.time() - t0 < 1.0, "the failure was not immediate"
        async with afabric.Engine(provider, op_timeout=5.0) as c:
            cmr = c.register(np.zeros(4096, dtype=np.uint8))
            with pytest.raises(errors.PeerUnreachable, match="closed"):
                await c.write(cmr, b_desc, 4096)
            await c.write(cmr, amr.descriptor, 4096)  # the survivor still takes writes
            await a.write(amr, cmr.descriptor, 4096)  # ... and makes them
    finally:
        await b.aclose()
        await a.aclose()


async def closing_target(ctl: Ctl, provider: str) -> bool:
    """Registers a region, hands out its descriptor, closes its engine on request and stays
    alive until told to stop (its shm files are gone by then)."""
    eng = afabric.Engine(provider)
    mr = eng.register(np.zeros(4096, dtype=np.uint8))
    ctl.put((bytes(mr.descriptor), bytes(eng.address)))
    assert await ctl.get() == "close"
    await eng.aclose()
    ctl.put("closed")
    assert await ctl.get() == "stop"
    return True


@pytest.mark.parametrize("first_write", [True, False])
async def test_writing_to_a_closed_engine_of_another_process_fails(
    provider: str, first_write: bool, peers: list[Peer]
) -> None:
    """The closed engine lives in another (still running) process, its /dev/shm file gone:
    writes to it fail with a typed error within op_timeout, whether or not this engine had
    talked to it before, and the engine still works for others. On shm the failure is
    PeerUnreachable at once (a write posted there would stall the endpoint for good)."""
    target = Peer(closing_target, provider)
    peers.append(target)
    blob, _addr = await target.get()
    desc = afabric.MrDesc.from_bytes(blob)
    async with afabric.Engine(provider, op_timeout=2.0) as eng:
        src = eng.register(np.ones(4096, dtype=np.uint8))
        if first_write:
            await eng.write(src, desc, 4096)
        target.put("close")
        assert await target.get() == "closed"
        await asyncio.sleep(0.05)  # shm looks for the peer's file at most every 10 ms
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises((errors.PeerUnreachable, errors.OperationTimeout)) as seen:
            await asyncio.wait_for(eng.write(src, desc, 4096), 10)
        print(
            f"\n{provider}: write to a closed engine -> {type(seen.value).__name__} "
            f"after {loop.time() - t0:.2f} s: {seen.value}"
        )
        if provider == "shm":
            assert isinstance(seen.value, errors.PeerUnreachable)
        async with afabric.Engine(provider) as other:
            dst = other.register(np.zeros(4096, dtype=np.uint8))
            await eng.write(src, dst.descriptor, 4096)
    target.put("stop")
    assert await target.result() is True


# ---- an immediate the target refused is an error, not a success (item 8) ----


async def counting_target(ctl: Ctl, provider: str) -> bool:
    """Registers a region; on "count N" answers whether N arrivals of its immediate came
    (within 1 s), on "deregister" revokes the region."""
    async with afabric.Engine(provider) as eng:
        mr = eng.register(np.zeros(64, dtype=np.uint8))
        imm = eng.alloc_imm()
        ctl.put((bytes(mr.descriptor), imm))
        while (cmd := await ctl.get()) != "stop":
            if cmd == "deregister":
                eng.deregister(mr)
                ctl.put("revoked")
            else:
                try:
                    await eng.expect_imm(imm, int(cmd.split()[1]), timeout=1.0)
                    ctl.put("counted")
                except errors.OperationTimeout:
                    ctl.put("not counted")
    return True


@pytest.mark.parametrize(
    "provider",
    [
        "tcp",
        pytest.param(
            "shm",
            marks=pytest.mark.xfail(
                strict=True,
                reason="libfabric shm completes a zero-length write locally and drops a refused "
                "one at the target unseen (1.17: delivery-complete never completes; docs/limitations.md)",
            ),
        ),
    ],
)
async def test_a_refused_barrier_is_an_error(provider: str, peers: list[Peer]) -> None:
    """A barrier (zero-length writes with an immediate) into a live region is counted; into
    a deregistered one it must fail at the initiator (the target never counts it), never
    report success."""
    target = Peer(counting_target, provider)
    peers.append(target)
    blob, imm = await target.get()
    desc = afabric.MrDesc.from_bytes(blob)
    async with afabric.Engine(provider, op_timeout=3.0) as eng:
        await eng.barrier([desc], imm)
        target.put("count 1")
        assert await target.get() == "counted"
        target.put("deregister")
        assert await target.get() == "revoked"
        for _ in range(3):
            with pytest.raises(errors.TransportError):
                await eng.barrier([desc], imm)
            target.put("count 1")
            assert await target.get() == "not counted"
    target.put("stop")
    assert await target.result() is True
