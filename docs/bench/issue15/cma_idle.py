"""Idle cma engine CPU after work on its copy threads: two engines of one process, then 3 s
of nothing, the process's CPU time. `large` (default): 8 writes of 16 MiB (split copies);
`pipe`: 64 rounds of 64 writes of 64 KiB in flight (whole operations on the copy threads).
Usage: cma_idle.py [large|pipe]"""

import asyncio
import sys
import time

import numpy as np

from afabric import Engine


async def main(mode: str) -> None:
    async with Engine("cma") as a, Engine("cma") as b:
        size = 16 << 20 if mode == "large" else 64 << 16
        src = a.register(np.ones(size, dtype=np.uint8), remote=False)
        dst = b.register(np.zeros(size, dtype=np.uint8))
        if mode == "large":
            for _ in range(8):
                await a.write(src, dst.descriptor, size)
        else:
            for _ in range(64):
                lanes = (a.write(src, dst.descriptor, 1 << 16, k << 16, k << 16) for k in range(64))
                await asyncio.gather(*lanes)
        await asyncio.sleep(0.5)
        c0, t0 = time.process_time(), time.monotonic()
        await asyncio.sleep(3)
        cpu = 100 * (time.process_time() - c0) / (time.monotonic() - t0)
        what = "16 MiB writes" if mode == "large" else "pipelined 64 KiB writes"
        print(f"IDLE cma after {what} cpu%={cpu:.2f}", flush=True)


asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "large"))
