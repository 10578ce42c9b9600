"""Idle cma engine CPU after large copies (its copy threads started): two engines of one
process, 16 MiB writes between them, then 3 s of nothing, the process's CPU time.
Usage: cma_idle.py"""

import asyncio
import time

import numpy as np

from afabric import Engine


async def main() -> None:
    async with Engine("cma") as a, Engine("cma") as b:
        src = a.register(np.ones(16 << 20, dtype=np.uint8), remote=False)
        dst = b.register(np.zeros(16 << 20, dtype=np.uint8))
        for _ in range(8):
            await a.write(src, dst.descriptor, 16 << 20)
        await asyncio.sleep(0.5)
        c0, t0 = time.process_time(), time.monotonic()
        await asyncio.sleep(3)
        cpu = 100 * (time.process_time() - c0) / (time.monotonic() - t0)
        print(f"IDLE cma after 16 MiB writes cpu%={cpu:.2f}", flush=True)


asyncio.run(main())
