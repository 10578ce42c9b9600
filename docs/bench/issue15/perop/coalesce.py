"""An experiment, not a product path: 64 lanes each awaiting single writes, against the same
lanes whose writes are gathered per loop iteration into one write_many (each lane's future
resolved when its batch completes). Whether handing the worker batches instead of single
requests would lift the lanes' rate, and what it does to the loop thread's CPU per write.
Three alternated runs of 40,000 writes, to a target process. Usage: coalesce.py PROVIDER SIZE"""

import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import uvloop

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run with python -P too
from perop import start_target

from afabric import Engine

W, N = 64, 40000


async def main(prov: str, size: int) -> None:
    a, p, desc = start_target(prov)
    eng = Engine(prov)
    mr = eng.register(np.ones(1 << 20, dtype=np.uint8))
    loop = asyncio.get_running_loop()
    pending: list[asyncio.Future[None]] = []
    tasks: set[asyncio.Task[None]] = set()

    async def send(batch: list[asyncio.Future[None]]) -> None:
        await eng.write_many(mr, desc, [size] * len(batch))
        for f in batch:
            f.set_result(None)

    def flush() -> None:
        t = loop.create_task(send(pending[:]))
        tasks.add(t)
        t.add_done_callback(tasks.discard)
        pending.clear()

    def gathered(_mr: Any, _desc: Any, _n: int) -> Awaitable[None]:
        f: asyncio.Future[None] = loop.create_future()
        if not pending:
            loop.call_soon(flush)
        pending.append(f)
        return f

    for _ in range(3):
        for mode, write in (("lanes", eng.write), ("gathered", gathered)):
            w: Callable[[Any, Any, int], Awaitable[None]] = write

            async def lane(w: Callable[[Any, Any, int], Awaitable[None]] = w) -> None:
                for _ in range(N // W):
                    await w(mr, desc, size)

            t0, c0 = time.perf_counter(), time.thread_time()
            await asyncio.gather(*(lane() for _ in range(W)))
            dt, cpu = time.perf_counter() - t0, time.thread_time() - c0
            rate, per = N * size / dt / 1e9, cpu / N * 1e6
            print(f"{mode} {prov} {size}: {rate:.2f} GB/s, loop CPU per write {per:.2f} µs", flush=True)
    await eng.aclose()
    a.send("x")
    p.join(10)


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1], int(sys.argv[2])))
