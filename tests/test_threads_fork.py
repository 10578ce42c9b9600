"""Where an engine may be used from: its own loop's thread only (other threads and loops
are refused before anything is posted), native calls that are re-entrant, and fork: an
inherited engine is inert in the child and the parent's engine keeps working."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
from typing import Any

import numpy as np
import pytest

import afabric
from afabric import errors

from .procs import Ctl, Peer

N = 4096
OP_TIMEOUT = 5.0


async def write_target(ctl: Ctl, provider: str) -> bool:
    """A remote region and the engine's address; counts `imm` arrivals on request."""
    async with afabric.Engine(provider) as eng:
        buf = np.zeros(N, dtype=np.uint8)
        mr = eng.register(buf)
        ctl.put((bytes(eng.address), bytes(mr.descriptor)))
        src = eng.register(np.ones(8, dtype=np.uint8), remote=False)
        while (cmd := await ctl.get()) != "stop":
            if cmd[0] == "echo":  # write 8 bytes with an immediate back to the test
                _, blob, imm = cmd
                await eng.write(src, afabric.MrDesc.from_bytes(blob), 8, imm=imm)
                ctl.put("sent")
                continue
            imm, count = cmd
            await eng.expect_imm(imm, count, timeout=30)
            ctl.put(int(np.count_nonzero(buf)))
        return True


def native_ids_from_threads(eng: afabric.Engine, threads: int, per_thread: int) -> list[int]:
    """Operation ids the native layer hands out to several threads calling it at once."""
    ids: list[list[int]] = [[] for _ in range(threads)]
    start = threading.Barrier(threads)

    def run(k: int) -> None:
        start.wait()
        for i in range(per_thread):
            ids[k].append(eng._n.expect_imm(1 + k * per_thread + i, 1))

    ts = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return [i for row in ids for i in row]


async def test_native_calls_are_reentrant(provider: str) -> None:
    """Threads calling into one native engine at once each get their own result: no id is
    handed out twice (a shared ctypes out-parameter did that while the GIL was released)."""
    async with afabric.Engine(provider) as eng:
        got = native_ids_from_threads(eng, threads=4, per_thread=3000)
        dupes = len(got) - len(set(got))
        for op_id in set(got):
            eng._n.cancel(op_id)
        assert dupes == 0, f"{dupes} operation ids handed out twice"


def in_thread(fn: Any) -> BaseException | None:
    """Run fn() in a new thread; the exception it raised, or None."""
    seen: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            seen[0] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the call from another thread hung"
    return seen[0]


@pytest.mark.both_loops
async def test_other_threads_and_loops_refused_before_posting(provider: str, peers: list[Peer]) -> None:
    """Every call from a thread (or loop) other than the engine's raises UsageError and posts
    nothing; the engine keeps working on its own loop afterwards."""
    target = Peer(write_target, provider)
    peers.append(target)
    addr, blob = await target.get()
    desc = afabric.MrDesc.from_bytes(blob)
    async with afabric.Engine(provider, op_timeout=OP_TIMEOUT) as eng:
        src = eng.register(np.full(N, 7, dtype=np.uint8), remote=False)
        before = eng.stats()["nics"][0]
        imm = eng.alloc_imm()
        calls: dict[str, Any] = {
            "write": lambda: asyncio.run(eng.write(src, desc, N, imm=imm)),
            "send": lambda: asyncio.run(eng.send(afabric.Address.from_bytes(addr), b"x")),
            "expect_imm": lambda: asyncio.run(eng.expect_imm(imm, 1)),
            "scatter": lambda: asyncio.run(eng.scatter(src, [afabric.ScatterTarget(desc, 8)])),
            "register": lambda: eng.register(bytearray(64)),
            "deregister": lambda: eng.deregister(src),
            "alloc_imm": eng.alloc_imm,
            "close": eng.close,
        }
        for name, call in calls.items():
            e = in_thread(call)
            assert isinstance(e, errors.UsageError), f"{name} from another thread: {e!r}"
            assert "thread" in str(e), str(e)
        after = eng.stats()["nics"][0]
        assert after["writes"] == before["writes"] and after["sends"] == before["sends"]
        assert not eng.closed and src.registered
        target.put((imm, 1))
        await eng.write(src, desc, N, imm=imm)  # still works from its own loop
        assert await target.get() == N
    target.put("stop")
    assert await target.result() is True


async def test_cross_thread_use_through_the_loop(provider: str) -> None:
    """The supported way from another thread: hand the coroutine to the engine's loop."""
    async with afabric.Engine(provider, op_timeout=OP_TIMEOUT) as a, afabric.Engine(provider) as b:
        dst = np.zeros(N, dtype=np.uint8)
        desc = b.register(dst).descriptor
        src = a.register(np.full(N, 3, dtype=np.uint8), remote=False)
        loop = asyncio.get_running_loop()
        await asyncio.to_thread(
            lambda: asyncio.run_coroutine_threadsafe(a.write(src, desc, N), loop).result(30)
        )
        assert int(np.count_nonzero(dst)) == N


FORK = mp.get_context("fork")


def inherited_engine_calls(
    eng: afabric.Engine, mr: afabric.MemoryRegion, w: Any, desc: Any
) -> dict[str, str]:
    """In a forked child: what each use of the inherited engine and its objects did."""
    out: dict[str, str] = {}

    def note(name: str, fn: Any) -> None:
        try:
            fn()
            out[name] = "returned"
        except errors.UsageError as e:
            out[name] = f"UsageError: {e}"
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out[name] = f"{type(e).__name__}: {e}"

    async def enter() -> None:
        async with eng:
            pass

    for name, coro in {
        "write": lambda: eng.write(mr, desc, 8),
        "expect_imm": lambda: eng.expect_imm(1, 1),
        "send": lambda: eng.send(eng.address, b"x"),
        "recv": eng.recv,
        "async with": enter,
    }.items():
        note(name, lambda c=coro: asyncio.run(asyncio.wait_for(c(), 10)))

    note("register", lambda: eng.register(bytearray(64)))
    note("alloc_imm", eng.alloc_imm)
    note("stats", eng.stats)
    note("deregister", lambda: eng.deregister(mr))
    note("descriptor", lambda: mr.descriptor)
    note("watcher add", lambda: w.add(1))
    note("watcher value", lambda: w.value)
    note("close", eng.close)
    note("close again", eng.close)
    return out


def forked(fn: Any, *args: Any, timeout: float = 30.0) -> Any:
    """Run fn(*args) in a forked child (it inherits everything, engines included); its
    result, or an AssertionError if it hung or died."""
    rx, tx = FORK.Pipe(duplex=False)

    def child() -> None:
        tx.send(fn(*args))

    p = FORK.Process(target=child, daemon=True)
    p.start()
    tx.close()
    try:
        if not rx.poll(timeout):
            raise AssertionError(f"the forked child hung for {timeout} s")
        return rx.recv()
    finally:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()
        rx.close()


@pytest.mark.both_loops
async def test_fork_leaves_parent_working_and_child_inert(provider: str, peers: list[Peer]) -> None:
    """After fork the child's copy of an engine refuses every call with UsageError at once
    (its worker thread does not exist there) and its close() only drops the child's copies;
    the parent's writes, expect_imm and watcher keep working."""
    target = Peer(write_target, provider)
    peers.append(target)
    _, blob = await target.get()
    desc = afabric.MrDesc.from_bytes(blob)
    async with afabric.Engine(provider, op_timeout=OP_TIMEOUT) as eng:
        src = eng.register(np.full(N, 5, dtype=np.uint8))
        w = eng.uvm_watcher()

        # a child that only closes its copy (this used to take the parent's eventfd out of
        # the epoll set both share, and then wait for a worker the child does not have)
        def close_only() -> bool:
            eng.close()
            return eng.closed

        assert await asyncio.to_thread(forked, close_only) is True
        seen = await asyncio.to_thread(forked, inherited_engine_calls, eng, src, w, desc)
        bad = {k: v for k, v in seen.items() if not v.startswith("UsageError") and not k.startswith("close")}
        assert not bad, f"calls on an inherited engine that did not raise UsageError: {bad}"
        assert seen["close"] == seen["close again"] == "returned", seen
        assert "fork" in seen["register"], seen["register"]
        # the parent: engine, regions and watcher as before
        assert not eng.closed and src.registered and bytes(src.descriptor)
        for _ in range(3):
            imm = eng.alloc_imm()
            target.put((imm, 1))
            await asyncio.wait_for(eng.write(src, desc, N, imm=imm), OP_TIMEOUT + 5)
            assert await target.get() == N
            back = eng.alloc_imm()
            target.put(("echo", bytes(src.descriptor), back))
            assert await target.get() == "sent"
            await eng.expect_imm(back, 1, timeout=OP_TIMEOUT + 5)
        assert w.add(2) == 2
        assert await asyncio.wait_for(w.wait_for(2), OP_TIMEOUT) == 2
    target.put("stop")
    assert await target.result() is True
