"""Helpers for the fault and load tests: what a process holds (threads, fds, memory), and
peer processes that serve as targets, bystanders and victims."""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import afabric

from .procs import Ctl

_PAGE = os.sysconf("SC_PAGE_SIZE")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")
    ]  # fmt: skip


def _heap_in_use_mib() -> float:
    """Bytes malloc has handed out and not had back (glibc's mallinfo2: heap chunks in use
    plus mmapped blocks), all threads' arenas together."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Mallinfo2
    m = libc.mallinfo2()
    return float(m.uordblks + m.hblkhd) / (1 << 20)


@dataclass(frozen=True)
class Held:
    """What this process holds: native threads (OS threads that are not Python threads:
    the shim's workers, libfabric's), open file descriptors, resident memory, and memory
    malloc has handed out. RSS alone is no leak measure here: each engine's worker thread
    may get its own malloc arena, and freed memory stays cached in them (tcp engines made
    and closed in a loop: RSS climbs to ~280 MiB and stays, heap in use stays at 8.6 MiB)."""

    native_threads: int
    fds: int
    rss_mib: float
    heap_mib: float

    def __str__(self) -> str:
        return (
            f"native threads {self.native_threads}, fds {self.fds}, RSS {self.rss_mib:.1f} MiB, "
            f"malloc in use {self.heap_mib:.2f} MiB"
        )


def held() -> Held:
    tasks = len(os.listdir("/proc/self/task"))
    fds = len(os.listdir("/proc/self/fd"))
    rss_pages = int(Path("/proc/self/statm").read_text().split()[1])
    return Held(tasks - threading.active_count(), fds, rss_pages * _PAGE / (1 << 20), _heap_in_use_mib())


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """`nbytes` of a recognisable pattern (uint8 view)."""
    words = (np.arange(nbytes // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(seed)
    out: np.ndarray = words.view(np.uint8)
    return out


async def noop(ctl: Ctl) -> None:
    """A peer that does nothing (its start brings up what multiprocessing keeps for good)."""


async def drain_messages(eng: afabric.Engine) -> None:
    while True:
        await eng.recv()


async def victim_target(ctl: Ctl, provider: str, nbytes: int, env: dict[str, str] | None = None) -> bool:
    """A target to be killed (or stopped): registers `nbytes`, publishes (descriptor,
    address), swallows messages, and on "check" answers whether every byte is either
    untouched (0) or what the writer wrote (pattern seed 7): nothing else may land. On
    "close" it closes its engine and lives on."""
    os.environ.update(env or {})
    async with afabric.Engine(provider) as eng:
        buf = np.zeros(nbytes, dtype=np.uint8)
        mr = eng.register(buf)
        ctl.put((bytes(mr.descriptor), bytes(eng.address), os.getpid()))
        sink = asyncio.ensure_future(drain_messages(eng))
        try:
            while True:
                cmd = await ctl.get(timeout=3600)
                if cmd == "check":
                    want = pattern(nbytes, 7)
                    ctl.put(int(np.count_nonzero((buf != 0) & (buf != want))))
                elif cmd == "zero?":
                    ctl.put(int(np.count_nonzero(buf)))
                elif cmd == "close":  # the engine goes, the process stays (until "stop")
                    sink.cancel()
                    await eng.aclose()
                    ctl.put("closed")
                elif cmd == "stop":
                    return True
        finally:
            sink.cancel()


async def bystander(ctl: Ctl, provider: str, nbytes: int, seed: int, rounds: int) -> int:
    """A peer that must be unaffected by faults elsewhere: each round it publishes an
    immediate, waits for `nbytes` of pattern `seed` with one arrival, checks and clears.
    Returns its pid."""
    async with afabric.Engine(provider) as eng:
        buf = np.zeros(nbytes, dtype=np.uint8)
        mr = eng.register(buf)
        ctl.put((bytes(mr.descriptor), bytes(eng.address)))
        want = pattern(nbytes, seed)
        for _ in range(rounds):
            imm = eng.alloc_imm()
            ctl.put(imm)
            await eng.expect_imm(imm, 1, timeout=60)
            assert np.array_equal(buf, want), "bystander's data is wrong"
            buf[:] = 0
            ctl.put("ok")
        return os.getpid()


async def imm_sender(ctl: Ctl, provider: str, desc_b: bytes, imm: int) -> None:
    """A victim on the sending side: small writes with an immediate to `desc_b`, until
    killed."""
    async with afabric.Engine(provider) as eng:
        desc = afabric.MrDesc.from_bytes(desc_b)
        src = eng.register(np.zeros(8, np.uint8), remote=False)
        ctl.put(("sending", os.getpid()))
        while True:
            await eng.write(src, desc, 8, imm=imm)


async def commanded_writer(ctl: Ctl, provider: str, desc_b: bytes, offset: int, seed: int) -> bool:
    """Writes 4 KiB of pattern `seed` to `desc_b` at `offset` once ("ready" after it), then
    again on each "write" ("written" after it), until "stop"."""
    async with afabric.Engine(provider) as eng:
        desc = afabric.MrDesc.from_bytes(desc_b)
        src = eng.register(pattern(4096, seed), remote=False)
        await eng.write(src, desc, 4096, dst_offset=offset)
        ctl.put("ready")
        while (cmd := await ctl.get(timeout=3600)) != "stop":
            assert cmd == "write", cmd
            await eng.write(src, desc, 4096, dst_offset=offset)
            ctl.put("written")
        return True
