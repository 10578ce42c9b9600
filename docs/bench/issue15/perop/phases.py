"""64 lanes of SIZE-byte writes to a target process, measured per burst of 1,024 writes (12
bursts), so that a rate that changes during a run shows; both regions MB MiB (default 128).
Prints each burst's GB/s and the writer's and target's worker naps. Environment: WPOLL /
TPOLL (polling of the writer / target engine, default adaptive), TSPIN (the target's
spin_us, default 50), MB. Usage: phases.py PROVIDER SIZE fixed|rotate (offset 0 every time,
or rotating through the region as bench p2p does)."""

import asyncio
import multiprocessing as mp
import os
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import uvloop

from afabric import Engine, MrDesc

MB = int(os.environ.get("MB", "128"))


def target(conn: Connection, prov: str) -> None:
    async def run() -> None:
        polling, spin = os.environ.get("TPOLL", "adaptive"), int(os.environ.get("TSPIN", "50"))
        async with Engine(prov, polling=polling, spin_us=spin) as eng:
            mr = eng.register(np.zeros(MB << 20, dtype=np.uint8), remote="rw")
            conn.send(bytes(mr.descriptor))
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)
            print("target naps", eng.stats()["worker_naps"], flush=True)

    uvloop.run(run())


async def main(prov: str, size: int, rotate: bool) -> None:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=target, args=(b, prov), daemon=True)
    p.start()
    desc = MrDesc.from_bytes(a.recv())
    eng: Any = Engine(prov, polling=os.environ.get("WPOLL", "adaptive"))
    mr = eng.register(np.zeros(MB << 20, dtype=np.uint8))
    span = (MB << 20) // size if rotate else 1
    rates = []
    per = 1024 // 64
    for _ in range(12):

        async def lane(k: int) -> None:
            for i in range(per):
                off = ((k * per + i) % span) * size
                await eng.write(mr, desc, size, src_offset=off, dst_offset=off)

        t0 = time.perf_counter()
        await asyncio.gather(*(lane(k) for k in range(64)))
        rates.append(1024 * size / (time.perf_counter() - t0) / 1e9)
    st = eng.stats()
    print("writer naps", st["worker_naps"], "loop woken", st["loop_woken"])
    print(prov, size, MB, "rotate" if rotate else "fixed", " ".join(f"{x:.1f}" for x in rates), flush=True)
    await eng.aclose()
    a.send("x")
    p.join(10)


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "rotate"))
