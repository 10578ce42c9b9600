"""Idle cma engine CPU after pipelined copies (issue 15): two engines of one process, 64 rounds
of 64 writes of 64 KiB in flight between them (whole operations on the copy threads), then 3 s
of nothing: the process's CPU time. Usage: cma_pipe_idle.py"""

import asyncio
import time

import numpy as np

from afabric import Engine


async def main() -> None:
    async with Engine("cma") as a, Engine("cma") as b:
        src = a.register(np.ones(64 << 16, dtype=np.uint8), remote=False)
        dst = b.register(np.zeros(64 << 16, dtype=np.uint8))
        for _ in range(64):
            await asyncio.gather(
                *(a.write(src, dst.descriptor, 1 << 16, k << 16, k << 16) for k in range(64))
            )
        await asyncio.sleep(0.5)
        c0, t0 = time.process_time(), time.monotonic()
        await asyncio.sleep(3)
        cpu = 100 * (time.process_time() - c0) / (time.monotonic() - t0)
        print(f"IDLE cma after pipelined 64 KiB writes cpu%={cpu:.2f}", flush=True)


asyncio.run(main())
