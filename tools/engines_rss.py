"""Resident memory of one process holding many engines under load: E tcp engines, each
keeping W 4 KiB writes in flight to one target process, for M minutes; the RSS is printed
before the first write and every minute (flat once the working set is reached, or a leak).

    python tools/engines_rss.py [E=16] [W=1000] [M=10]
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import sys
import time
from multiprocessing.connection import Connection

import numpy as np

import afabric

PAGE = 4096


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def target(conn: Connection, engines: int) -> None:
    async def main() -> None:
        async with afabric.Engine("tcp") as eng:
            mr = eng.register(np.zeros(engines * PAGE, dtype=np.uint8))
            conn.send(bytes(mr.descriptor))
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)

    asyncio.run(main())


async def load(desc: afabric.MrDesc, engines: int, window: int, minutes: float) -> None:
    stop = time.monotonic() + minutes * 60
    done = [0]

    async def lane(eng: afabric.Engine, i: int) -> None:
        src = eng.register(np.full(PAGE, i, dtype=np.uint8))
        while time.monotonic() < stop:
            await asyncio.gather(*(eng.write(src, desc, PAGE, dst_offset=PAGE * i) for _ in range(window)))
            done[0] += window

    async def sample() -> None:
        t0 = time.monotonic()
        while time.monotonic() < stop:
            await asyncio.sleep(min(60.0, max(0.0, stop - time.monotonic())))
            took = time.monotonic() - t0
            print(f"{took:6.0f} s  writes {done[0]:>11,}  RSS {rss_mib():8.1f} MiB", flush=True)

    opened = [afabric.Engine("tcp") for _ in range(engines)]
    print(f"{engines} engines, {window} writes in flight each: RSS {rss_mib():.1f} MiB", flush=True)
    try:
        await asyncio.gather(sample(), *(lane(e, i) for i, e in enumerate(opened)))
    finally:
        for e in opened:
            await e.aclose()


def main() -> None:
    engines, window, minutes = (int(sys.argv[1]) if len(sys.argv) > 1 else 16,
                                int(sys.argv[2]) if len(sys.argv) > 2 else 1000,
                                float(sys.argv[3]) if len(sys.argv) > 3 else 10.0)  # fmt: skip
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=target, args=(theirs, engines))
    proc.start()
    asyncio.run(load(afabric.MrDesc.from_bytes(ours.recv()), engines, window, minutes))
    ours.send("stop")
    proc.join()


if __name__ == "__main__":
    main()
