"""Per-operation cost of the Python API: 64 coroutines each awaiting 8 B writes to a target
process, as `bench p2p`'s lanes do. Prints, over 7 runs of 60,000 writes, the wall time per
write and the CPU time the loop's thread spent per write (min and median): where the thread
is busy all the time (wall = CPU) its CPU time is the API's cost per operation.
Usage: perop.py PROVIDER"""

import asyncio
import multiprocessing as mp
import sys
import time
from typing import Any

import numpy as np
import uvloop

from afabric import Engine, MrDesc


def target(conn: Any, prov: str) -> None:
    async def run() -> None:
        async with Engine(prov) as eng:
            mr = eng.register(np.ones(1 << 20, dtype=np.uint8), remote="rw")
            conn.send(bytes(mr.descriptor))
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)

    uvloop.run(run())


def start_target(prov: str) -> tuple[Any, Any, MrDesc]:
    """The target process (a registered 1 MiB region, writable and readable) and its region's
    descriptor: (pipe, process, descriptor); send anything on the pipe to stop it."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=target, args=(b, prov), daemon=True)
    p.start()
    return a, p, MrDesc.from_bytes(a.recv())


async def lanes(eng: Any, mr: Any, desc: Any, n: int, width: int) -> tuple[float, float]:
    per = n // width

    async def lane() -> None:
        w = eng.write
        for _ in range(per):
            await w(mr, desc, 8)

    t0, c0 = time.perf_counter(), time.thread_time()
    await asyncio.gather(*(lane() for _ in range(width)))
    ops = per * width
    return (time.perf_counter() - t0) / ops * 1e6, (time.thread_time() - c0) / ops * 1e6


async def main(prov: str) -> None:
    a, p, desc = start_target(prov)
    eng = Engine(prov)
    mr = eng.register(np.ones(1 << 20, dtype=np.uint8))
    await lanes(eng, mr, desc, 20000, 64)
    r = [await lanes(eng, mr, desc, 60000, 64) for _ in range(7)]
    wall, cpu = sorted(x for x, _ in r), sorted(y for _, y in r)
    print(
        f"PEROP {prov} wall us/op min {wall[0]:.2f} med {wall[3]:.2f}; "
        f"loop thread cpu us/op min {cpu[0]:.2f} med {cpu[3]:.2f}",
        flush=True,
    )
    await eng.aclose()
    a.send("x")
    p.join(10)


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1]))
