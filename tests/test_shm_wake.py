"""libfabric 1.17 shm: an idle engine sleeps on its wake-up socket instead of waking every
millisecond, and a write to it wakes it (providers/ofi/ofi_wake.c)."""

from __future__ import annotations

import asyncio
import mmap
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from afabric import Engine

from .conftest import libfabric_version

pytestmark = pytest.mark.skipif(libfabric_version()[:2] != (1, 17), reason="1.17's shm only")

WRITES = 50


def _wake_files() -> set[Path]:
    return set(Path("/dev/shm").glob(f"{os.getpid()}:*:wake"))


def _map_word(path: Path) -> mmap.mmap:
    """The wake file's page, read-only (the `sleeping` word is at byte 8)."""
    with path.open("rb") as f:
        return mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ)


async def _until(cond: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.0005)


async def test_idle_target_sleeps_and_a_write_wakes_it() -> None:
    """The target's worker, idle, sets its `sleeping` word (it sleeps on the socket: at
    most 20 ms, the shim's cap). Each of WRITES writes is sent once it is asleep again: with
    the writer's kick each lands at once; without, each waits out the target's sleep
    (about 20 ms, just begun: ~1 s for all of them). Half a second allows for a slow machine
    twenty-fold."""
    before = _wake_files()
    async with Engine("shm") as target:
        (wake_file,) = _wake_files() - before
        word = _map_word(wake_file)

        def asleep() -> bool:
            return bool(struct.unpack_from("<I", word, 8)[0] == 1)

        dst = np.zeros(4096, np.uint8)
        desc = target.register(dst).descriptor
        async with Engine("shm") as writer:
            src = writer.register(np.zeros(4096, np.uint8))
            await writer.write(src, desc, 4096)  # the first contact, out of the count
            waited = 0.0
            for i in range(1, WRITES + 1):
                await _until(asleep, f"the target did not go to sleep before write {i}")
                src.buffer[:] = i
                t0 = time.monotonic()
                await writer.write(src, desc, 4096)
                waited += time.monotonic() - t0
                assert (dst == i).all()
        word.close()
    assert waited < 0.5, f"{WRITES} writes to a sleeping target took {waited * 1e3:.0f} ms"
