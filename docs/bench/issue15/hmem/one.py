"""afabric's raw C loop and Python writes over a region of SLOTS slots of SIZE bytes.

Usage: one.py SIZE SLOTS [WINDOW]. SLOTS=1 writes one buffer over and over, as fi_rma_bw
does; SLOTS=128 MiB / SIZE is the span `afabric bench p2p` rotates through. Environment:
PROV (shm), ITERS (20000), POLL / TPOLL (writer / target polling), WCPU / TCPU (pin the
writer's / target's worker). Prints three repetitions, GB/s.
"""

import asyncio
import multiprocessing as mp
import os
import sys
import time
from multiprocessing.connection import Connection

import numpy as np

from afabric import Engine
from afabric.bench.raw import RawLoop
from afabric.descriptor import MrDesc

PROV = os.environ.get("PROV", "shm")
ITERS = int(os.environ.get("ITERS", "20000"))
POLL = os.environ.get("POLL", "adaptive")
TPOLL = os.environ.get("TPOLL", POLL)


def cpu(var: str) -> int | None:
    return int(os.environ[var]) if os.environ.get(var) else None


def target(conn: Connection, nbytes: int) -> None:
    async def run() -> None:
        async with Engine(PROV, polling=TPOLL, cpu=cpu("TCPU")) as eng:  # type: ignore[arg-type]
            mr = eng.register(np.zeros(nbytes, dtype=np.uint8), remote="rw")
            conn.send(bytes(mr.descriptor))
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)

    asyncio.run(run())


async def main(size: int, slots: int, window: int) -> None:
    a, b = mp.Pipe()
    p = mp.get_context("spawn").Process(target=target, args=(b, size * slots))
    p.start()
    desc = MrDesc.from_bytes(a.recv())
    async with Engine(PROV, polling=POLL, cpu=cpu("WCPU")) as eng:  # type: ignore[arg-type]
        mr = eng.register(np.ones(size * slots, dtype=np.uint8))
        raw = RawLoop(eng, mr, desc)
        per = ITERS // window
        for _ in range(3):
            ns = raw.write(size, window, ITERS)

            async def lane(k: int) -> None:
                for i in range(per):
                    off = ((k * per + i) % slots) * size
                    await eng.write(mr, desc, size, src_offset=off, dst_offset=off)

            t0 = time.perf_counter()
            await asyncio.gather(*(lane(k) for k in range(window)))
            dt = time.perf_counter() - t0
            print(
                f"{PROV} size {size} slots {slots} W {window}: raw {size * ITERS / ns:.2f} GB/s"
                f"  py {size * per * window / dt / 1e9:.2f} GB/s",
                flush=True,
            )
    a.send(b"x")
    p.join()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 64))
