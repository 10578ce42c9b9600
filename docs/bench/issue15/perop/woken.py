"""64 lanes of awaited writes (as perop.py) and how often the event fd woke the loop for
them: wall time and loop-thread CPU per write, and loop_woken / loop_polled / worker_naps
per write (Engine.stats). Usage: woken.py PROVIDER [SIZE [N]] (SIZE bytes, default 8; N
writes, default 200,000)."""

import asyncio
import os
import sys
import time
from typing import Any

import numpy as np
import uvloop

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run with python -P too
from perop import start_target

from afabric import Engine

KEYS = ("loop_woken", "loop_polled", "worker_naps")


async def lanes(eng: Any, mr: Any, desc: Any, size: int, n: int) -> tuple[float, float, dict[str, float]]:
    per, width = n // 64, 64

    async def lane() -> None:
        w = eng.write
        for _ in range(per):
            await w(mr, desc, size)

    s0 = eng.stats()
    t0, c0 = time.perf_counter(), time.thread_time()
    await asyncio.gather(*(lane() for _ in range(width)))
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    s1, ops = eng.stats(), per * width
    return wall / ops * 1e6, cpu / ops * 1e6, {k: (s1[k] - s0[k]) / ops for k in KEYS}


async def main(prov: str, size: int, n: int) -> None:
    a, p, desc = start_target(prov)
    eng = Engine(prov)
    mr = eng.register(np.ones(1 << 20, dtype=np.uint8))
    await lanes(eng, mr, desc, size, 20000)
    wall, cpu, per = await lanes(eng, mr, desc, size, n)
    counts = ", ".join(f"{k} {v:.3f}" for k, v in per.items())
    print(f"WOKEN {prov} {size} B: wall {wall:.2f} us/write, loop cpu {cpu:.2f}; per write {counts}")
    await eng.aclose()
    a.send("x")
    p.join(10)


if __name__ == "__main__":
    args = sys.argv[1:]
    uvloop.run(main(args[0], int(args[1]) if len(args) > 1 else 8, int(args[2]) if len(args) > 2 else 200000))
