"""The event loop polls the completion ring itself while it waits for a few operations
(Engine._poll_tick), so an awaited write does not wait for the event fd's wake-up; with
``spin_us=0`` or once the window passed, the fd wakes it as before. Where the process has
few CPUs and the target's worker copies each write, the looks yield the CPU between looks."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from afabric import Engine, MrDesc, _native

from .procs import Ctl, Peer, stop_process

WRITES = 100


@contextlib.contextmanager
def _cpus(n: int) -> Iterator[None]:
    """This thread (and the engines' threads it starts) on the first n CPUs it may use."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, sorted(before)[:n])
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


async def _polled_and_woken(provider: str, spin_us: int) -> tuple[int, int]:
    """WRITES awaited writes one at a time, each checked at the target: the writer's
    loop_polled and loop_woken."""
    async with Engine(provider) as target:
        dst = np.zeros(4096, np.uint8)
        desc = target.register(dst).descriptor
        async with Engine(provider, spin_us=spin_us) as writer:
            src = writer.register(np.zeros(4096, np.uint8))
            for i in range(1, WRITES + 1):
                src.buffer[:] = i % 256
                await writer.write(src, desc, 4096)
                assert (dst == i % 256).all()
            st = writer.stats()
    return st["loop_polled"], st["loop_woken"]


async def test_awaited_writes_are_found_by_polling() -> None:
    """cma (the writer copies): with a window longer than any write here takes, nearly every
    completion is found by the loop's look (the worker is told not to signal the fd);
    without a window, none is."""
    polled, _ = await _polled_and_woken("cma", 1_000_000)
    assert polled >= WRITES // 2
    polled, woken = await _polled_and_woken("cma", 0)
    assert (polled, woken >= WRITES // 2) == (0, True)


@pytest.mark.parametrize("provider", ["tcp", "shm"])
async def test_looks_yield_where_the_target_copies_on_one_cpu(provider: str) -> None:
    """tcp and shm writes complete when the target's worker copied them, and on one CPU
    that worker and the writer's own run only when the loop's look gives the CPU up: the
    looks yield between looks (afs_pending_wait), so they find the completions within the
    default window. Measured with the looks not yielding: none found (each write went by
    the fd, ~50 µs of look held the CPU for nothing)."""
    with _cpus(1):
        polled, _ = await _polled_and_woken(provider, 50)
    assert polled >= WRITES // 2


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 4, reason="needs 4 CPUs")
async def test_polling_where_the_target_copies_on_enough_cpus() -> None:
    polled, _ = await _polled_and_woken("tcp", 1_000_000)
    assert polled >= WRITES // 2


async def test_a_write_longer_than_the_window_is_woken_by_the_fd() -> None:
    """The loop stops looking spin_us after the write started; the last look asks the worker
    to signal the fd again, which then wakes the loop for the completion."""
    async with Engine("cma") as target:
        dst = np.zeros(32 << 20, np.uint8)
        desc = target.register(dst).descriptor
        async with Engine("cma", spin_us=1) as writer:
            src = writer.register(np.full(32 << 20, 7, np.uint8))
            await asyncio.wait_for(writer.write(src, desc, 32 << 20), 30)
            assert writer.stats()["loop_woken"] >= 1
    assert (dst == 7).all()


async def test_a_look_waits_at_most_its_time_and_returns_at_a_completion() -> None:
    """Each look keeps looking for a slice (afs_pending_wait): with nothing in flight it
    returns 0 once its time is up, not before and not unbounded later; with a write in flight
    it returns when the completion is there, long before its limit."""
    async with Engine("cma") as target, Engine("cma", spin_us=0) as writer:
        desc = target.register(np.zeros(4096, np.uint8)).descriptor
        src = writer.register(np.full(4096, 3, np.uint8))
        await writer.write(src, desc, 4096)  # resolves the peer, imports the descriptor
        native = writer._n
        t0 = time.monotonic()
        assert native.pending_wait(20_000_000) == 0
        assert 0.019 <= time.monotonic() - t0 < 5
        # no await from here to the drain: the loop's fd reader cannot take the record
        op = native.write("write", src.id or 0, writer._remote(desc)[0], 4096, 0, 0, _native.NO_IMM)
        t0 = time.monotonic()
        assert native.pending_wait(4_000_000_000) == 1
        assert time.monotonic() - t0 < 2
        plain: list[int] = []
        native.drain(None, plain)
        assert plain == [op]


async def test_closing_while_the_loop_polls() -> None:
    """Writes in flight when the engine closes fail with a typed error; the loop's look,
    already scheduled, finds the engine closed and stops (no error on the loop)."""
    errors_seen: list[dict[str, object]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, ctx: errors_seen.append(ctx))
    try:
        async with Engine("cma") as target:
            desc = target.register(np.zeros(1 << 20, np.uint8)).descriptor
            writer = Engine("cma", spin_us=1_000_000)
            src = writer.register(np.zeros(1 << 20, np.uint8))
            tasks = [asyncio.ensure_future(writer.write(src, desc, 1 << 20)) for _ in range(4)]
            await asyncio.sleep(0)
            await writer.aclose()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(r is None or type(r).__module__ == "afabric.errors" for r in results), results
            await asyncio.sleep(0.01)
            assert not writer._polling
    finally:
        loop.set_exception_handler(None)
    assert errors_seen == []


def _looks_find_completions(eng: Engine) -> None:
    """Each look with an operation in flight, in Python or in afs_submit_take, waits until
    its completion is there (a completion later than the slice would make the tests below
    depend on timing); a tick with nothing in flight looks for the usual slice."""
    eng._poll_slice_ns = 2_000_000_000
    eng._take_ns = 2_000_000_000
    wait = eng._n.pending_wait
    eng._n.pending_wait = lambda ns: wait(ns if eng._ops else 5_000)  # type: ignore[method-assign]


@pytest.mark.parametrize("where", ["tick", "inline"])
async def test_a_look_that_raises_leaves_the_fd_asked_for(where: str) -> None:
    """A poll that raises (here: the drain, once) goes to the loop's exception handler. From
    the tick: its last look still asks the worker to signal the fd and the poller stops, so
    later writes complete and poll again (left marked running, with the worker told not to
    signal, a write might never be heard of). From the awaiting call's inline look (a read:
    a write alone is looked for in afs_submit_take): that read still completes (the tick is
    running) and does not raise what was not its own."""
    seen: list[dict[str, object]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx))
    try:
        async with Engine("cma") as target, Engine("cma", spin_us=1_000_000) as writer:
            dst = np.zeros(4096, np.uint8)
            desc = target.register(dst, remote="rw").descriptor
            src = writer.register(np.full(4096, 5, np.uint8))
            native = writer._n
            drain = native.drain
            failed: list[bool] = []

            def drain_failing_once(
                room: Callable[[], int] | None = None, plain: list[int] | None = None, poll: bool = False
            ) -> list[_native.Event]:
                if poll and not failed:
                    failed.append(True)
                    raise RuntimeError("look failed")
                return drain(room, plain, poll)

            native.drain = drain_failing_once  # type: ignore[method-assign]
            if where == "tick":  # submitted without a look: its await waits, the tick looks
                take = native.take
                native.take = lambda *a: take(*a[:-1], -1)  # type: ignore[method-assign]
            else:
                _looks_find_completions(writer)  # the inline look finds it, then raises
            back = writer.register(np.zeros(4096, np.uint8), remote=False)
            first = writer.write(src, desc, 4096) if where == "tick" else writer.read(back, desc, 4096)
            await asyncio.wait_for(first, 10)
            writer._poll_slice_ns = 5_000
            assert failed and writer._polling == (where == "inline")
            assert ("inline" in str(seen[0]["message"])) == (where == "inline")
            polled = writer.stats()["loop_polled"]
            for _ in range(20):
                await asyncio.wait_for(writer.write(src, desc, 4096), 10)
            assert (dst == 5).all()
            assert writer.stats()["loop_polled"] >= polled + 10
    finally:
        loop.set_exception_handler(None)
    assert [str(c.get("exception")) for c in seen] == ["look failed"]


async def test_awaits_found_inline_yield_to_the_loop_regularly() -> None:
    """An operation awaited alone gets its first look from the awaiting call, and when that
    finds it the await does not suspend; at most _INLINE_RUN in a row do, then one yields, so
    a task that awaits writes back to back never starves the loop's other tasks."""
    ticks = 0

    async def other() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    async with Engine("cma") as target, Engine("cma", spin_us=1_000_000) as writer:
        desc = target.register(np.zeros(4096, np.uint8)).descriptor
        src = writer.register(np.full(4096, 9, np.uint8))
        await writer.write(src, desc, 4096)
        bg = asyncio.ensure_future(other())
        await asyncio.sleep(0)
        before = ticks
        _looks_find_completions(writer)
        drains = 0
        drain = writer._n.drain

        def counted(*a: Any, **k: Any) -> list[_native.Event]:
            nonlocal drains
            drains += 1
            return drain(*a, **k)

        writer._n.drain = counted  # type: ignore[method-assign]
        for _ in range(9 * 20):
            await writer.write(src, desc, 4096)
        writer._poll_slice_ns = 5_000
        bg.cancel()
        # found inline, 8 of 9 writes never suspend: each of the others lets `other` run a
        # few times; a write that always suspended would let it run at least 9 * 20 times
        assert 20 <= ticks - before < 9 * 20
        # ...and their completions were taken where they were submitted, not drained: the
        # ninth's too (it yields once after its look, instead of waiting on a future)
        assert drains <= 2, drains


@pytest.mark.parametrize(("spin_us", "look_ns"), [(50, 50_000), (20, 20_000), (3, 3_000), (10_000, 50_000)])
async def test_a_write_alone_is_looked_for_up_to_spin_us_at_most_50us(spin_us: int, look_ns: int) -> None:
    """tcp's 8 B writes complete later than one poll slice (the target acknowledges each), so
    the look in the submitting call lasts up to spin_us, capped at _TAKE_MAX_NS (50 µs: the
    loop is held no longer). Given that long, tcp writes awaited alone are taken there."""
    async with Engine("tcp") as target, Engine("tcp", spin_us=spin_us) as writer:
        desc = target.register(np.zeros(4096, np.uint8)).descriptor
        src = writer.register(np.full(4096, 9, np.uint8))
        await writer.write(src, desc, 8)
        looks: list[tuple[bool, int]] = []
        take = writer._n.take

        def counted(*a: Any) -> tuple[int, int]:
            op, took = take(*a)
            if a[-1] >= 0:  # a look (-1: submitted only)
                looks.append((took == _native.TAKEN, a[-1]))
            return op, took

        writer._n.take = counted  # type: ignore[method-assign]
        for _ in range(9):
            await writer.write(src, desc, 8)
        assert {ns for _, ns in looks} == {look_ns}, looks
        writer._take_ns = 2_000_000_000  # every look waits for its completion (none is late)
        looks.clear()
        for _ in range(18):
            await writer.write(src, desc, 8)
    # every one is looked for where it was submitted, the two that let the loop run too
    assert len(looks) == 18 and all(hit for hit, _ in looks), looks


@pytest.mark.parametrize("provider", ["cma", "tcp"])
async def test_reads_awaited_alone_are_taken_where_submitted(provider: str) -> None:
    """A read awaited alone goes through afs_submit_take as a write does: its completion is
    consumed in the submitting call (not drained), and its bytes are in place when the await
    returns; every ninth then lets the loop run once (found all the same)."""
    async with Engine(provider) as target, Engine(provider, spin_us=1_000_000) as reader:
        data = np.random.default_rng(7).integers(0, 256, 64 * 36, dtype=np.uint8)
        desc = target.register(data, remote="r").descriptor
        dst = np.zeros_like(data)
        mr = reader.register(dst)
        await reader.read(mr, desc, 8)
        _looks_find_completions(reader)
        took: list[int] = []
        drains = 0
        take, drain = reader._n.take, reader._n.drain

        def counted_take(*a: Any) -> tuple[int, int]:
            op, t = take(*a)
            took.append(t)
            return op, t

        def counted_drain(*a: Any, **k: Any) -> list[_native.Event]:
            nonlocal drains
            drains += 1
            return drain(*a, **k)

        reader._n.take = counted_take  # type: ignore[method-assign]
        reader._n.drain = counted_drain  # type: ignore[method-assign]
        for i in range(36):
            at = slice(i * 64, (i + 1) * 64)
            await reader.read(mr, desc, 64, src_offset=i * 64, dst_offset=i * 64)
            assert (dst[at] == data[at]).all(), i
        reader._poll_slice_ns = 5_000
    # a look that found another record first drains it instead
    assert len(took) == 36 and took.count(_native.TAKEN) >= 34, took
    assert drains < 36 // 2


@pytest.mark.parametrize(("provider", "looked"), [("shm", 0), ("tcp", 0), ("cma", 1)])
async def test_writes_of_tasks_resumed_together_are_not_alone(provider: str, looked: int) -> None:
    """A drain that resolves several writes resumes their tasks one after another. The first
    of them to write again finds nothing in flight, yet where the target's worker copies
    (shm, tcp) it is not alone: a look in its call would hold the loop, and the tasks ready
    behind it, for a round trip longer than a future costs (in 64 lanes of 8 B shm writes,
    12-14% of the writes went so, one at a time). cma's round trip is shorter: its resumed
    writes are still looked for. Once they have run, a write is alone again."""
    async with Engine(provider) as target, Engine(provider, spin_us=1_000_000) as writer:
        desc = target.register(np.zeros(4096, np.uint8)).descriptor
        src = writer.register(np.full(4096, 5, np.uint8))
        await writer.write(src, desc, 8)
        looks: list[int] = []
        take = writer._n.take

        def counted(*a: Any) -> tuple[int, int]:
            looks.append(a[-1])  # the look's ns; -1: submitted only
            return take(*a)

        writer._n.take = counted  # type: ignore[method-assign]
        writer._take_ns = 2_000_000_000  # every look waits for its completion
        # in flight until the watcher fires it (a long write could complete, and be drained by
        # a look, before the lanes below have run: on two CPUs a look that yields may last
        # a scheduler slice)
        w = writer.uvm_watcher()
        held = asyncio.ensure_future(writer.write(src, desc, 8, dst_offset=64, when=w.reaches(1)))
        await asyncio.sleep(0)
        assert looks == [] and len(writer._ops) == 1
        second: list[int] = []

        async def lane(i: int) -> None:
            await writer.write(src, desc, 8, dst_offset=i * 8)  # not alone: the long one is in flight
            n = len(looks)
            await writer.write(src, desc, 8, dst_offset=i * 8)  # resumed with the others
            second.append(len(looks) - n)

        lanes = [asyncio.ensure_future(lane(i)) for i in range(4)]
        await asyncio.sleep(0)
        assert looks == [] and len(writer._ops) == 5  # the four went through futures
        w.add(1)
        # the loop held until all five completions wait in the ring: one drain takes them all
        deadline = time.monotonic() + 30
        while writer._n.pending_wait(0) < 5 and time.monotonic() < deadline:
            time.sleep(0.005)  # noqa: ASYNC251
        await asyncio.gather(held, *lanes)
        assert second == [looked] * 4, looks  # shm, tcp: none of them submitted through a look
        await writer.write(src, desc, 8)  # after them, alone: looked for in its call
        assert looks[-1] == 2_000_000_000


async def test_tasks_that_run_in_a_yield_of_a_write_alone_are_not_alone() -> None:
    """The write alone that lets the loop run (every ninth) is found where it was submitted
    and then yields once. The tasks that run in that yield are not alone even where nothing
    is in flight: each one's look would hold the others for a round trip, and 64 lanes of cma
    writes went one at a time that way (59,661 of 60,000 writes alone, `resumed.py`)."""
    async with Engine("cma") as target, Engine("cma", spin_us=1_000_000) as writer:
        desc = target.register(np.zeros(4096, np.uint8)).descriptor
        src = writer.register(np.full(4096, 3, np.uint8))
        await writer.write(src, desc, 8)
        _looks_find_completions(writer)
        looks: list[int] = []
        take = writer._n.take

        def counted(*a: Any) -> tuple[int, int]:
            looks.append(a[-1])
            return take(*a)

        writer._n.take = counted  # type: ignore[method-assign]
        writer._inline_left = 1  # the next write alone is the one that yields
        other = asyncio.ensure_future(writer.write(src, desc, 8, dst_offset=8))  # ready, not run yet
        await writer.write(src, desc, 8)
        assert len(looks) == 1  # this write's own look; `other` ran in its yield, through a future
        await other
        await writer.write(src, desc, 8)  # after them, alone again
        assert len(looks) == 2 and looks[-1] == 2_000_000_000


async def test_many_in_flight_wake_the_loop_for_several_completions() -> None:
    """Signal moderation (shim/ring.c HOLD_*): with 16 or more operations in flight the
    worker signals a waiting loop once several completions wait (or 20 us after the first),
    not for each. 64 lanes of 8 B shm writes: the loop was woken for 0.84-0.95 of the writes
    before (2-core machine), 0.10-0.12 with it; every write still completes and lands."""
    lanes, per = 64, 100
    async with Engine("shm") as target:
        dst = np.zeros(lanes * 8, np.uint8)
        desc = target.register(dst).descriptor
        async with Engine("shm", spin_us=0) as writer:
            src = writer.register(np.arange(lanes * 8, dtype=np.uint64).astype(np.uint8))
            before = writer.stats()["loop_woken"]

            async def lane(k: int) -> None:
                for _ in range(per):
                    await writer.write(src, desc, 8, src_offset=8 * k, dst_offset=8 * k)

            await asyncio.gather(*(lane(k) for k in range(lanes)))
            woken = writer.stats()["loop_woken"] - before
    assert (dst == src.buffer).all()
    assert woken <= lanes * per // 2, f"the loop was woken {woken} times for {lanes * per} writes"


async def _idle_target(ctl: Ctl, provider: str) -> bool:
    async with Engine(provider) as eng:
        mr = eng.register(np.zeros(1 << 12, np.uint8), remote="rw")
        ctl.put(bytes(mr.descriptor))
        await ctl.get()
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("provider", ["tcp", "shm"])
async def test_writes_to_a_stopped_peer_hold_up_no_other(provider: str, peers: list[Peer]) -> None:
    """20 writes in flight to a stopped peer (the provider refuses to post them) and writes
    to a live engine: each live write completes at once. Its signal waits 20 us at most for
    company that does not come (signal moderation), and its post is not queued behind the
    refused ones (shim/worker.c POST_REFUSED_NS): before, one such write held every later
    one until its op_timeout. Meanwhile the worker naps between retries instead of spinning
    (it took a whole core), and once the peer runs again the 20 complete."""
    stuck = Peer(_idle_target, provider)
    peers.append(stuck)
    desc_stuck = MrDesc.from_bytes(await stuck.get())
    assert stuck.proc.pid is not None
    await stop_process(stuck.proc.pid)
    async with Engine(provider) as live:
        dst = np.zeros(64, np.uint8)
        desc_live = live.register(dst).descriptor
        async with Engine(provider, op_timeout=30) as writer:
            src = writer.register(np.full(64, 7, np.uint8))
            await writer.write(src, desc_live, 64)  # the live peer resolved
            pending = [asyncio.ensure_future(writer.write(src, desc_stuck, 64)) for _ in range(20)]
            await asyncio.sleep(0.2)
            took = []
            for i in range(5):
                dst[:] = 0
                t0 = time.monotonic()
                await asyncio.wait_for(writer.write(src, desc_live, 64), 10)
                took.append(time.monotonic() - t0)
                assert (dst == 7).all(), i
            assert not any(t.done() for t in pending)
            await asyncio.sleep(0.1)
            c0, t0 = time.process_time(), time.monotonic()
            await asyncio.sleep(0.5)
            cpu = (time.process_time() - c0) / (time.monotonic() - t0)
            os.kill(stuck.proc.pid, signal.SIGCONT)
            await asyncio.wait_for(asyncio.gather(*pending), 10)
    assert max(took) < 1.0, took
    assert cpu < 0.5, f"{cpu:.0%} of a core while the writes waited on the stopped peer"
