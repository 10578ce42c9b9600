"""A worker stuck inside its provider for good (shim/peers.c watches it): everything in flight
fails with EngineStuck within a bounded time and the engine closes itself, instead of every
caller waiting forever.

The stuck worker is made the way it happens: libfabric 1.17's shm keeps a spin lock in each
endpoint's shared region, taken by every writer to it and by its owner's progress; a process
SIGKILLed while it holds it (seen in CI: `afabric bench p2p`'s target) leaves writers
spinning on it for ever. Here the test holds that lock itself (it takes the lock word of the
target's region, found and checked below, with glibc's spin lock calls) instead of waiting for
a kill to land inside the critical section, and lets go of it at the end so that the spinning
threads can finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import mmap
import os
import platform
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import afabric
from afabric import errors
from afabric.bench.raw import RawLoop

from .conftest import libfabric_version
from .faults import commanded_writer, pattern, victim_target
from .procs import Peer

pytestmark = pytest.mark.asyncio

# libfabric 1.17 shm, struct smr_region: uint8 version, resv; uint16 flags; int pid; uint8 x2,
# uint32 max_sar_buf_per_peer; void *base_addr (16); pthread_spinlock_t lock (24).
PID_AT, BASE_AT, LOCK_AT = 4, 16, 24
LOCK_FREE, LOCK_HELD = 1, 0  # glibc's x86-64 spin lock: 1 free, taken by decrementing it
SLACK = 10.0  # what a loaded 2-core machine may add to the watchdog's bound
_LIBC = ctypes.CDLL(None)  # pthread_spin_trylock / _unlock: glibc's, as libfabric's
_LIBC.pthread_spin_trylock.argtypes = _LIBC.pthread_spin_unlock.argtypes = [ctypes.c_void_p]


def region_file(address: bytes) -> Path:
    """The /dev/shm file of an shm engine's region: its address says "fi_shm://NAME"."""
    at = address.index(b"fi_shm://") + len(b"fi_shm://")
    return Path("/dev/shm") / address[at : address.index(b"\0", at)].decode()


@contextlib.contextmanager
def holding_region_lock(path: Path, owner: int) -> Iterator[None]:
    """Hold the spin lock of process `owner`'s shm region `path`, as a process that died
    inside its critical section would; let go at the end. The layout is checked first (the
    owner's pid, the address the owner maps the region at, a free lock), so a libfabric whose
    region differs fails this test rather than have it write somewhere else."""
    fd = os.open(path, os.O_RDWR)
    try:
        m = mmap.mmap(fd, mmap.PAGESIZE)
    finally:
        os.close(fd)
    with m:
        pid, base, lock = (
            struct.unpack_from(f, m, at)[0] for f, at in (("<i", PID_AT), ("<Q", BASE_AT), ("<i", LOCK_AT))
        )
        with open(f"/proc/{owner}/maps") as maps:
            mapped = {int(line.split("-", 1)[0], 16) for line in maps if line.rstrip().endswith(str(path))}
        assert pid == owner and base in mapped, f"not libfabric 1.17's shm region layout: {path}"
        assert lock in (LOCK_FREE, LOCK_HELD), f"the region's lock word reads {lock}, not a spin lock"
        # Taken as libfabric takes it (glibc's own spin lock calls on the shared word): the
        # owner's progress holds it for a moment at a time, so a plain store could land inside
        # such a moment (and be undone by the owner's unlock), and a free word is not a given.
        word = ctypes.c_int.from_buffer(m, LOCK_AT)
        lock_p = ctypes.c_void_p(ctypes.addressof(word))
        try:
            deadline = time.monotonic() + 5
            while _LIBC.pthread_spin_trylock(lock_p) != 0:
                assert time.monotonic() < deadline, "the region's lock stayed taken for 5 s"
                time.sleep(0.0001)
            try:
                yield
            finally:
                _LIBC.pthread_spin_unlock(lock_p)
        finally:
            del word  # the mmap closes only once no ctypes object points into it


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the lock word's values are glibc's x86-64 ones")
async def test_stuck_worker_fails_everything_and_closes_the_engine() -> None:
    """Before: a write to a peer whose region lock is held waited for ever (op_timeout cannot
    fire: the worker that enforces it is the one spinning), and so did `afabric bench p2p`'s
    raw loop, which blocked its event loop. Now: both fail with EngineStuck after
    WORKER_STUCK_S, the engine closes itself, later calls say why, and when the worker does
    come back it frees the engine (its endpoint's /dev/shm file goes with it)."""
    if libfabric_version() >= (2, 0):
        pytest.skip("libfabric 2.x's shm keeps no lock in its region: nothing can hold it")
    target = Peer(victim_target, "shm", 1 << 20)
    writer = afabric.Engine("shm", op_timeout=120)  # the failure must come from the watchdog
    writer_file = region_file(bytes(writer.address))
    try:
        desc_b, addr_b, pid = await target.get()
        dst = afabric.MrDesc.from_bytes(desc_b)
        src = writer.register(pattern(1 << 20, 7))
        await writer.write(src, dst, 4096)  # the path works before
        with holding_region_lock(region_file(addr_b), pid):
            t0 = time.monotonic()
            pending = asyncio.ensure_future(writer.write(src, dst, 4096))
            await asyncio.sleep(0.2)
            assert not pending.done(), "the write completed although the target's region is locked"
            with pytest.raises(errors.EngineStuck, match="inside provider shm"):
                RawLoop(writer, src, dst).write(4096, 4, 100)  # blocks until then
            took = time.monotonic() - t0
            assert afabric.WORKER_STUCK_S <= took < afabric.WORKER_STUCK_S + SLACK, took
            with pytest.raises(errors.EngineStuck, match="will not come back"):
                await asyncio.wait_for(pending, 5)
            assert writer.closed
            with pytest.raises(errors.EngineClosed, match="closed itself"):
                await writer.write(src, dst, 8)
            with pytest.raises(errors.EngineClosed, match="closed itself"):
                writer.register(np.zeros(64, np.uint8))
            assert writer_file.exists()  # the stuck worker still holds the endpoint
        # Let go: the worker returns from the provider, sees it was given up on, and frees it.
        for _ in range(int(SLACK / 0.05)):
            if not writer_file.exists():
                break
            await asyncio.sleep(0.05)
        assert not writer_file.exists(), "the worker that came back did not free its engine"
        target.put("check")  # only the writer's worker was stuck: the target answers, and
        assert await target.get() == 0  # holds nothing but the writer's bytes
        target.put("stop")
        assert await target.result() is True
    finally:
        writer.close()
        target.close()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the lock word's values are glibc's x86-64 ones")
async def test_peer_dead_with_its_lock_held_fails_only_its_operations(shm_cleanup: None) -> None:
    """The case behind the CI hang: the target is SIGKILLed while it holds its region's lock.
    Before: the writer's worker spun on it for ever (the engine lost for every peer). Now: the
    watch thread sees the death (pidfd), the provider fences that region (ofi_shmfence.c), the
    write to the dead peer fails with PeerUnreachable long before the stuck-worker bound, and
    the engine goes on serving another peer."""
    if libfabric_version() >= (2, 0):
        pytest.skip("libfabric 2.x's shm keeps no lock in its region: nothing can hold it")
    target = Peer(victim_target, "shm", 1 << 20)
    other = Peer(victim_target, "shm", 1 << 20)
    writer = afabric.Engine("shm", op_timeout=120)
    try:
        desc_b, addr_b, pid = await target.get()
        other_desc, _, _ = await other.get()
        dst, alive = afabric.MrDesc.from_bytes(desc_b), afabric.MrDesc.from_bytes(other_desc)
        src = writer.register(pattern(1 << 20, 7))
        await writer.write(src, dst, 4096)
        await writer.write(src, alive, 4096)
        with holding_region_lock(region_file(addr_b), pid):
            pending = asyncio.ensure_future(writer.write(src, dst, 4096))
            await asyncio.sleep(0.2)
            assert not pending.done(), "the write completed although the target's region is locked"
            t0 = time.monotonic()
            target.kill()
            with pytest.raises(errors.PeerUnreachable, match="exited"):
                await asyncio.wait_for(pending, afabric.WORKER_STUCK_S + SLACK)
            took = time.monotonic() - t0
            print(f"\nthe write to the dead peer failed {took * 1e3:.0f} ms after the SIGKILL")
            assert took < afabric.WORKER_STUCK_S, f"{took:.1f} s: the worker was only let go as stuck"
        assert not writer.closed
        await writer.write(src, alive, 1 << 20)  # the other peer is served as before
        other.put("check")
        assert await other.get() == 0
        other.put("stop")
        assert await other.result() is True
    finally:
        await writer.aclose()
        target.close()
        other.close()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the lock word's values are glibc's x86-64 ones")
async def test_writer_dead_inside_the_targets_lock_lets_go(shm_cleanup: None) -> None:
    """The other way round: a writer SIGKILLed while it holds the *target's* region lock
    (its few-microsecond critical section). Before: every other writer to that engine spun
    for ever and the target could not progress. Now: when the target's watch thread sees
    the writer exit, the target frees its own lock if it stays taken with the command queue
    unmoved for 200 ms (ofi_shmfence.c), and the other writer's write completes. (The test
    holds the lock itself: the dead writer stands for whoever held it.)"""
    if libfabric_version() >= (2, 0):
        pytest.skip("libfabric 2.x's shm keeps no lock in its region: nothing can hold it")
    async with afabric.Engine("shm") as target:
        buf = np.zeros(1 << 16, np.uint8)
        desc_b = bytes(target.register(buf).descriptor)
        events = target.peer_events()
        dead = Peer(commanded_writer, "shm", desc_b, 0, 1)
        live = Peer(commanded_writer, "shm", desc_b, 4096, 2)
        try:
            assert (await dead.get(), await live.get()) == ("ready", "ready")
            ups = [await asyncio.wait_for(events.__anext__(), 10) for _ in range(2)]
            assert [ev.kind for ev in ups] == ["up", "up"]  # their hellos: both watched here
            buf[:] = 0
            with holding_region_lock(region_file(bytes(target.address)), os.getpid()):
                live.put("write")
                with pytest.raises(TimeoutError):
                    await live.get(timeout=0.5)  # it spins on the target's lock
                t0 = time.monotonic()
                dead.kill()
                assert await live.get(timeout=afabric.WORKER_STUCK_S) == "written"
                took = time.monotonic() - t0
            print(f"\nthe live writer's write done {took * 1e3:.0f} ms after the SIGKILL")
            assert took < afabric.WORKER_STUCK_S, took
            assert np.array_equal(buf[4096:8192], pattern(4096, 2)) and not buf[:4096].any()
            assert not target.closed
            live.put("stop")
            assert await live.result() is True
        finally:
            dead.close()
            live.close()
